"""GLUE (Wang et al. 2019): five sentence and sentence-pair tasks, train and dev (labels public).

`glue/<task>` for task in cola, sst2, mrpc, rte, stsb; splits train and validation (GLUE's
dev set: the test sets have no public labels). Features: `sentence1`, `sentence2` (empty for
the single-sentence tasks CoLA and SST-2), `label` (float32: the class index, or the STS-B
similarity score in [0, 5]) and `idx` (the example's line in the file).

Raw files are GLUE's TSVs, laid out as its download script writes them
(`glue/<Task>/{train,dev}.tsv`, as in ../shared/data); without a local copy the four
`dl.fbaipublicfiles.com/glue/data/<Task>.zip` archives are downloaded and unpacked. MRPC has
no such archive (GLUE's script assembles it from Microsoft's corpus): it needs a local copy.
"""

from __future__ import annotations

import dataclasses
import pathlib
import zipfile

import numpy as np
import tensorflow_datasets as tfds

from lowrank_attn.data import raw_files
from lowrank_attn.data.builders import base

_HOMEPAGE = 'https://gluebenchmark.com'
_CITATION = """@inproceedings{wang2019glue,
  title = {{GLUE}: A Multi-Task Benchmark and Analysis Platform for Natural Language
           Understanding},
  author = {Wang, Alex and Singh, Amanpreet and Michael, Julian and Hill, Felix and Levy, Omer
            and Bowman, Samuel R.},
  booktitle = {International Conference on Learning Representations}, year = {2019}}"""
_ZIP_URL = 'https://dl.fbaipublicfiles.com/glue/data/{folder}.zip'
_MRPC_SOURCE = (
    "GLUE's download_glue_data.py (github.com/nyu-mll/GLUE-baselines), which "
    'writes glue_data/MRPC/{train,dev}.tsv'
)


@dataclasses.dataclass(frozen=True)
class GlueTask:
  """One GLUE task: its folder, how its TSV lines read, its labels."""

  folder: str  # GLUE's folder name
  header: bool  # the first line names the columns
  sentence_columns: tuple[int, ...]  # one or two
  label_column: int
  label_names: tuple[str, ...] = ()  # text labels in class order; () : numbers in the file
  num_classes: int = 2  # 1: regression (STS-B)
  sha256: tuple[str, str] = ('', '')  # train.tsv, dev.tsv
  public_archive: bool = True  # GLUE's <folder>.zip exists (not for MRPC)

  @property
  def source(self) -> str:
    """Where the files come from for a user without a local copy."""
    return _ZIP_URL.format(folder=self.folder) if self.public_archive else _MRPC_SOURCE


TASKS = {
    'cola': GlueTask(
        'CoLA',
        False,
        (3,),
        1,
        sha256=(
            'cb368ebeb9f27d7ad03720d27ddc95687a311bdb100781a2fe59a5f5b1bc0624',
            '8c013e21dc39957cac37378d87bebe225b694a0d5fe13eded66c2856628833fd',
        ),
    ),
    'sst2': GlueTask(
        'SST-2',
        True,
        (0,),
        1,
        sha256=(
            '48eac26399f8456935f81dd9e3a745c1430adb6c62e233ccfe22db4a0d15d1d1',
            '54a9c12c77e402fc14d6a66a506f24d999f596b0176eb777c972cccc2f9cc4b0',
        ),
    ),
    'mrpc': GlueTask(
        'MRPC',
        True,
        (3, 4),
        0,
        public_archive=False,
        sha256=(
            'f178bcc72ab4c2c1c778b480912e0c8e1dba3ead150dc1d490d70682ab888c1e',
            '9e8f284788040f7c9ecde2e1b3c07237c756f926bd9ef8548ef5d34b56f69f17',
        ),
    ),
    # HF `glue/rte` and GLUE's own code: entailment = 0.
    'rte': GlueTask(
        'RTE',
        True,
        (1, 2),
        3,
        ('entailment', 'not_entailment'),
        sha256=(
            '41e3a9b063433392343fad9e962cf2f58b681c78d8f71592f4186f0837246c5c',
            '80230dfa1347282e7b532b06a1004a76a710087541189bf874223ddf0e3819fb',
        ),
    ),
    'stsb': GlueTask(
        'STS-B',
        True,
        (7, 8),
        9,
        num_classes=1,
        sha256=(
            '41c4d978b6162abdcada7e49a982211954cca5459c228db478af333124b257a2',
            'fe7dc0632a5033562f3cadff991f6e8d9b9b6311861660e78c3c82eb7db67f59',
        ),
    ),
}
_SPLIT_FILES = {'train': 'train', 'validation': 'dev'}


def raw_file(task: str, split: str) -> raw_files.RawFile:
  spec = TASKS[task]
  index = list(_SPLIT_FILES).index(split)
  return raw_files.RawFile(
      f'glue/{spec.folder}/{_SPLIT_FILES[split]}.tsv', spec.source, spec.sha256[index]
  )


def parse_tsv(text: str, task: str, *, where: str) -> list[dict]:
  """GLUE TSV text -> examples (no quoting: GLUE's files are read with csv.QUOTE_NONE)."""
  spec = TASKS[task]
  lines = [line.removesuffix('\r') for line in text.removeprefix('\ufeff').split('\n')]
  lines = [line for line in lines if line]
  if spec.header:
    lines = lines[1:]
  width = max(spec.sentence_columns + (spec.label_column,)) + 1
  examples = []
  for i, line in enumerate(lines):
    columns = line.split('\t')
    if len(columns) < width:
      raise ValueError(
          f'{where}: line {i + 1 + spec.header} has {len(columns)} tab-separated '
          f'columns, GLUE {spec.folder} needs {width}: {line[:100]!r}'
      )
    label = columns[spec.label_column]
    if spec.label_names:
      if label not in spec.label_names:
        raise ValueError(
            f'{where}: line {i + 1 + spec.header}: label {label!r} is not one of '
            f'{spec.label_names}.'
        )
      value = float(spec.label_names.index(label))
    else:
      value = float(label)
    sentences = [columns[c] for c in spec.sentence_columns]
    examples.append(
        {
            'sentence1': sentences[0],
            'sentence2': sentences[1] if len(sentences) > 1 else '',
            'label': value,
            'idx': i,
        }
    )
  return examples


class Glue(base.RawFileBuilder):
  """Five GLUE tasks, one builder config each."""

  name = 'glue'
  BUILDER_CONFIGS = [
      tfds.core.BuilderConfig(name=task, description=f'GLUE {spec.folder}')
      for task, spec in TASKS.items()
  ]

  def _info(self):
    return self._dataset_info(
        description='GLUE tasks (train and dev) as sentence or sentence-pair examples.',
        features=tfds.features.FeaturesDict(
            {
                'sentence1': tfds.features.Text(),
                'sentence2': tfds.features.Text(),
                'label': np.float32,
                'idx': np.int32,
            }
        ),
        homepage=_HOMEPAGE,
        citation=_CITATION,
    )

  def _split_generators(self, dl_manager):
    task = self.builder_config.name
    spec = TASKS[task]
    local_dir = raw_files.resolve_local_data_dir(self._raw_data_dir)
    if local_dir is None and spec.public_archive:
      # No local copy: GLUE's archive holds <Folder>/{train,dev}.tsv; unpack, then verify.
      archive = pathlib.Path(dl_manager.download(spec.source))
      unpacked = pathlib.Path(dl_manager.download_dir) / 'lowrank_attn' / 'glue'
      with zipfile.ZipFile(archive) as z:
        z.extractall(unpacked)
      local_dir = unpacked.parent
    elif local_dir is None:
      raise FileNotFoundError(
          f'glue/{task} has no public archive; make its files with {spec.source} and point '
          f'data.data_dir / ${raw_files.DATA_DIR_ENV} at the folder holding glue/{spec.folder}.'
      )
    found = {}
    for split in _SPLIT_FILES:
      file = raw_file(task, split)
      path = raw_files.fetch(file, local_dir=local_dir, download_dir=local_dir)
      if path is None:
        raw_files.warn_missing_split(self.name, split, file, local_dir)
        continue
      found[split] = path
    if not found:
      raise FileNotFoundError(
          f'glue/{task}: no raw file under {local_dir}/glue/'
          f'{spec.folder}/ (train.tsv, dev.tsv).'
      )
    return {split: self._generate_examples(path, task) for split, path in found.items()}

  def _generate_examples(self, path, task):
    text = pathlib.Path(path).read_text(encoding='utf-8')
    for example in parse_tsv(text, task, where=str(path)):
      yield example['idx'], example


DATASETS = {
    f'glue/{task}': base.DatasetSpec(
        Glue, task, text_feature='sentence1', splits=('train', 'validation')
    )
    for task in TASKS
}
