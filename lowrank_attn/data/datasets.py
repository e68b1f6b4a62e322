"""Data sets by name: ours (TFDS builders over local or downloaded raw files) and official
TFDS ones (`lm1b`, `wmt14_translate/de-en`, `wmt_t2t_translate/de-en`, ...).

Everything is read through `builder.as_data_source(split)`: ArrayRecord files with random
access, no TensorFlow. Official datasets must be prepared in ArrayRecord format; preparing
them (the first time) needs TensorFlow, e.g. on a TPU VM:
    pip install tensorflow-cpu && tfds build wmt14_translate/de-en --file_format=array_record \
        --data_dir=gs://<bucket>/tfds
after which `tfds_data_dir=gs://<bucket>/tfds` reads them without TensorFlow.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import gzip
import importlib.util
import os
from typing import Any

import tensorflow_datasets as tfds
from tensorflow_datasets.core.utils import tqdm_utils

from lowrank_attn import files
from lowrank_attn.data import builders

DatasetSpec = builders.DatasetSpec
# Ours, one builder module each (`builders/`): 'tiny_shakespeare', 'shakespeare', 'multi30k',
# 'multi30k_captions', 'ud_english_ewt', 'glue/<task>', ...
DATASETS: dict[str, DatasetSpec] = builders.DATASETS

# Official TFDS datasets we have used; any other registered TFDS name works the same way.
OFFICIAL_DATASETS: dict[str, DatasetSpec] = {
    'lm1b': DatasetSpec(None, text_feature='text', splits=('train', 'test')),
    'wmt14_translate/de-en': DatasetSpec(None, languages=('de', 'en')),
    'wmt_t2t_translate/de-en': DatasetSpec(None, languages=('de', 'en')),
}

_TF_INSTALL_HINT = (
    'Preparing official TFDS datasets needs TensorFlow and importlib_resources (`pip install '
    'tensorflow-cpu importlib_resources`, the optional extra documented in the README; TFDS '
    '4.9.10 forgets to declare the latter, tensorflow/datasets#11212); prepare once with '
    '`tfds build {name} --file_format=array_record --data_dir=<dir>` and point '
    'data.tfds_data_dir at <dir>, after '
    'which reading needs no TensorFlow.'
)


def dataset_spec(name: str) -> DatasetSpec:
  """The spec of `name`; unknown names are treated as official TFDS text datasets."""
  if name in DATASETS:
    return DATASETS[name]
  if name in OFFICIAL_DATASETS:
    return OFFICIAL_DATASETS[name]
  return DatasetSpec(None, text_feature='text')


def check_name(name: str, tfds_data_dir: str | os.PathLike) -> None:
  """A ValueError (one line) unless `name` is a data set `load_builder` can find: one of ours,
  one TFDS has a builder for, or one prepared under `tfds_data_dir` (a remote directory such
  as gs://... is not looked into). Reads no data; for checks before a run starts."""
  if name in DATASETS or name in OFFICIAL_DATASETS:
    return
  try:
    # 'wmt14_translate/de-en' -> its builder 'wmt14_translate'; 'lm1b:1.1.0' -> 'lm1b'.
    builder_name = str(tfds.core.naming.parse_builder_name_kwargs(name)[0])
  except ValueError:
    builder_name = None
  if builder_name is not None:
    try:
      builder_cls = tfds.builder_cls(builder_name)
    except (tfds.core.registered.DatasetNotFoundError, ValueError):
      builder_cls = None
    if builder_cls is not None and not issubclass(builder_cls, builders.base.RawFileBuilder):
      return
    tfds_data_dir = os.fspath(tfds_data_dir)
    if '://' in tfds_data_dir or os.path.isdir(os.path.join(tfds_data_dir, builder_name)):
      return
  raise ValueError(_unknown_name_message(name, os.fspath(tfds_data_dir)))


def _unknown_name_message(name: str, tfds_data_dir: str) -> str:
  # TFDS's own error lists its 250 names; ours are the ones to offer.
  without_tf = (
      ''
      if importlib.util.find_spec('tensorflow')
      else ' (TFDS knows some official names only with TensorFlow installed, and it is not)'
  )
  return (
      f'config.data.name={name!r} is not a data set: ours are {", ".join(sorted(DATASETS))}; '
      'any other must be an official TFDS name (e.g. lm1b, wmt14_translate/de-en) or one '
      f'prepared under data.tfds_data_dir={tfds_data_dir!r}{without_tf}.'
  )


def default_tfds_data_dir(workdir: str | os.PathLike | None) -> str:
  """Where prepared ArrayRecord datasets go when data.tfds_data_dir is None: `<workdir>/tfds`;
  for a remote workdir (gs://...) `tfds/` in this machine's directory of the run
  (`files.local_dir`), since they are read as local files and prepared by each machine."""
  if workdir is not None:
    return os.path.join(files.local_dir(workdir), 'tfds')
  return os.path.expanduser(os.path.join('~', 'tensorflow_datasets'))


def load_builder(
    name: str,
    *,
    data_dir: str | os.PathLike | None = None,
    tfds_data_dir: str | os.PathLike | None = None,
) -> tfds.core.DatasetBuilder:
  """A prepared TFDS builder for `name` (prepared now if it was not, reused otherwise).

  Args:
    name: one of `DATASETS` ('tiny_shakespeare', 'shakespeare', 'multi30k',
      'multi30k_captions', 'ud_english_ewt') or an official TFDS name ('lm1b',
      'wmt14_translate/de-en', ...).
    data_dir: local raw-data directory laid out like ../shared/data; None →
      $LOWRANK_ATTN_DATA → download from the public URLs. Ignored for official datasets.
    tfds_data_dir: where prepared ArrayRecord datasets live; None → ~/tensorflow_datasets.
  """
  tfds_data_dir = os.fspath(tfds_data_dir or default_tfds_data_dir(None))
  spec = dataset_spec(name)
  builder = _builder(name, spec, data_dir, tfds_data_dir)
  if builder.is_prepared():
    return builder
  # Processes sharing `tfds_data_dir` (a grid's parallel runs) would both prepare it and
  # collide on TFDS's final rename: the first prepares, the others wait, then read it.
  with files.local_lock(tfds_data_dir, '.tfds_prepare.lock'):  # (not the pipeline's lock file)
    builder = _builder(name, spec, data_dir, tfds_data_dir)  # another may have prepared it
    if not builder.is_prepared():
      if spec.builder_cls is None:
        missing = [
            m for m in ('tensorflow', 'importlib_resources') if importlib.util.find_spec(m) is None
        ]
        if missing:  # fail now rather than after TFDS has started downloading
          raise ImportError(
              f'{name!r} is not prepared in {builder.data_dir} and preparing it needs '
              f'{missing}. ' + _TF_INSTALL_HINT.format(name=name)
          )
      _prepare(builder, name)
  return builder


def _builder(name: str, spec, data_dir, tfds_data_dir: str) -> tfds.core.DatasetBuilder:
  if spec.builder_cls is not None:
    return spec.builder_cls(config=spec.config, data_dir=tfds_data_dir, raw_data_dir=data_dir)
  return _official_builder(name, tfds_data_dir)


def load_data_source(
    name: str,
    split: str,
    *,
    data_dir: str | os.PathLike | None = None,
    tfds_data_dir: str | os.PathLike | None = None,
) -> Sequence[dict[str, Any]]:
  """Random-access examples of one split (`len`, `[i]`); text features are `bytes`.

  Arguments as in `load_builder`; `split` is 'train', 'validation' or 'test' (or any TFDS
  split expression such as 'train[:1000]').
  """
  builder = load_builder(name, data_dir=data_dir, tfds_data_dir=tfds_data_dir)
  available = list(builder.info.splits.keys())
  base_split = split.split('[')[0]
  if base_split not in available:
    spec = dataset_spec(name)
    why = (
        f' ({builder.name} has splits {list(spec.splits)}; a split whose raw file was '
        'absent from the local data directory is skipped when the dataset is prepared. '
        f'To add it, provide the file and delete {builder.data_dir} so it is prepared again.)'
        if spec.builder_cls is not None and base_split in spec.splits
        else ''
    )
    raise ValueError(
        f'split={split!r} is not available for data set {name!r} prepared at '
        f'{builder.data_dir}; valid: {available}.{why}'
    )
  try:
    return builder.as_data_source(split)
  except NotImplementedError as e:
    raise ValueError(
        f'{name!r} at {builder.data_dir} was not prepared in ArrayRecord format, which '
        'random access (and our grain pipelines) need. ' + _TF_INSTALL_HINT.format(name=name)
    ) from e


def _official_builder(name: str, tfds_data_dir: str) -> tfds.core.DatasetBuilder:
  try:
    # Falls back to reading dataset_info.json from tfds_data_dir when the builder class is not
    # importable (TFDS registers several text builders only when TensorFlow is installed).
    return tfds.builder(name, data_dir=tfds_data_dir, file_format='array_record')
  except tfds.core.registered.DatasetNotFoundError as e:
    raise ValueError(
        f'data.name={name!r} is neither one of ours ({sorted(DATASETS)}) nor a TFDS dataset '
        f'prepared under data.tfds_data_dir={tfds_data_dir!r}. If it is an official TFDS '
        'dataset (e.g. lm1b, wmt14_translate/de-en), its builder may only be importable with '
        'TensorFlow. ' + _TF_INSTALL_HINT.format(name=name)
    ) from None  # TFDS's error lists all its 250 names
  except TypeError:
    # A read-only builder restored from files takes no file_format argument.
    return tfds.builder(name, data_dir=tfds_data_dir)


def _prepare(builder: tfds.core.DatasetBuilder, name: str) -> None:
  # No GCS probing: it would reach for the network, which may not be there.
  download_config = tfds.download.DownloadConfig(try_download_gcs=False)
  progress_was_shown = tqdm_utils._active  # pylint: disable=protected-access
  tfds.display_progress_bar(False)
  try:
    builder.download_and_prepare(download_config=download_config, file_format='array_record')
  except ImportError as e:
    raise ImportError(
        f'Preparing {name!r} failed: {e}. ' + _TF_INSTALL_HINT.format(name=name)
    ) from e
  finally:
    tfds.display_progress_bar(progress_was_shown)


class TextFiles(Sequence):
  """Examples of local text files, one per line: example i is {feature: line i of its file}.

  Text features are `bytes`, as in the TFDS data sources, so the same pipelines read both.
  """

  def __init__(self, lines: Mapping[str, list[bytes]], paths: Mapping[str, str]):
    self._lines, self.paths = dict(lines), dict(paths)
    self._length = len(next(iter(self._lines.values())))

  def __len__(self) -> int:
    return self._length

  def __getitem__(self, index):
    if isinstance(index, slice):
      return [self[i] for i in range(*index.indices(self._length))]
    index = range(self._length)[index]  # negative indices; IndexError past the end
    return {feature: lines[index] for feature, lines in self._lines.items()}

  def __getitems__(self, indices) -> list[dict[str, bytes]]:
    return [self[i] for i in indices]

  def __repr__(self) -> str:
    return f'TextFiles({self.paths}, {self._length} lines)'


def load_text_files(files: Mapping[str, str | os.PathLike]) -> TextFiles:
  """Random-access examples of parallel text files (`.gz` allowed), one example per line.

  Args:
    files: feature name -> path, e.g. {'en': 'a.en', 'de': 'a.de'}; line i of every file
      belongs to example i (line i of `a.en` translates to line i of `a.de`).

  Raises:
    FileNotFoundError: a file does not exist (named with its feature).
    ValueError: the files have different numbers of lines, a file is empty or not UTF-8.
  """
  lines, paths = {}, {}
  for feature, path in files.items():
    path = os.path.expanduser(os.fspath(path))
    if not os.path.isfile(path):
      raise FileNotFoundError(f'The {feature!r} text file {path!r} does not exist.')
    opener = gzip.open if path.endswith('.gz') else open
    try:
      with opener(path, 'rb') as f:
        text = f.read().decode('utf-8')
    except (UnicodeDecodeError, OSError) as e:
      raise ValueError(f'The {feature!r} text file {path!r} is not UTF-8 text: {e}') from e
    if not text:
      raise ValueError(f'The {feature!r} text file {path!r} is empty.')
    # One example per line; a final newline does not start another one.
    lines[feature] = [
        line.removesuffix('\r').encode('utf-8') for line in text.removesuffix('\n').split('\n')
    ]
    paths[feature] = path
  counts = {feature: len(v) for feature, v in lines.items()}
  if len(set(counts.values())) > 1:
    described = ', '.join(f'{paths[f]} ({f}) has {n}' for f, n in counts.items())
    raise ValueError(
        f'Parallel text files must have equal numbers of lines (line i of each belongs to '
        f'example i): {described}.'
    )
  return TextFiles(lines, paths)
