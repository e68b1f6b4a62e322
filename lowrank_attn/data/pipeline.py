"""grain input pipelines: tokenize, shuffle, pack or pad, shard per process, batch.

    pipeline = make_pipeline(config.data, split="train", seed=0, global_batch_size=64,
                             train=True, workdir=workdir,
                             process_index=jax.process_index(), process_count=jax.process_count())
    batch = next(pipeline)                 # this process's rows, numpy, fixed shapes
    state = pipeline.get_state()           # JSON; save one per process with each checkpoint
    pipeline.set_state(state)              # resume: the next batch is the one it would have been

The pipeline is a grain `MapDataset` (random access over the ArrayRecord split: per-process
slice, per-epoch shuffle, tokenization, length filter) turned into an `IterDataset` (packing,
padding, batching, optional worker processes). Its position is grain's iterator state plus
the number of batches served, which also seeds masked-LM corruption.
"""

from __future__ import annotations

from collections.abc import Iterator
import dataclasses
import math
import os
import re
from typing import Any, NamedTuple
import warnings

from absl import flags
import grain
from grain.experimental import ConcatThenSplitIterDataset
import ml_collections
from ml_collections import config_dict
import numpy as np

from lowrank_attn.data import datasets
from lowrank_attn.data import tokenizers as tokenizers_lib

TASKS = ("lm", "mlm", "nmt")
STATE_FORMAT = "lowrank_attn.data.Pipeline/1"

# Reading threads of the in-process part of the pipeline. Tokenization holds the GIL, so more
# threads buy little; worker processes (data.num_workers) are the knob that scales.
_READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=256)

# Every field make_pipeline reads, with its default (see make_pipeline's docstring).
DATA_CONFIG_DEFAULTS: dict[str, Any] = {
    "name": "tiny_shakespeare",
    "task": "lm",
    "data_dir": None,
    "tfds_data_dir": None,
    "max_length": 256,
    "tokenizer": "char",
    "vocab_size": 8000,
    "sentencepiece_model_type": "unigram",
    "vocab_path": None,
    "tokenizer_path": None,
    "tokenizer_max_corpus_chars": 10_000_000,
    "source_lang": "en",
    "target_lang": "de",
    "packing": True,
    "mlm_probability": 0.15,
    "num_workers": 0,
}
_OPTIONAL_STRINGS = ("data_dir", "tfds_data_dir", "vocab_path", "tokenizer_path")


def default_data_config(**overrides) -> ml_collections.ConfigDict:
  """A data config with every field at its default (fields documented in `make_pipeline`).

  Optional paths are typed placeholders so `--config.data.data_dir=/x` works from the
  command line although the default is None.
  """
  fields = {}
  for key, value in {**DATA_CONFIG_DEFAULTS, **overrides}.items():
    if key not in DATA_CONFIG_DEFAULTS:
      raise ValueError(
          f"Unknown data config field {key!r}; valid: {sorted(DATA_CONFIG_DEFAULTS)}")
    fields[key] = config_dict.placeholder(str) if key in _OPTIONAL_STRINGS else value
    if key in _OPTIONAL_STRINGS and value is not None:
      fields[key].set(value)
  return ml_collections.ConfigDict(fields)


class ArraySpec(NamedTuple):
  shape: tuple[int, ...]
  dtype: np.dtype


@dataclasses.dataclass(frozen=True)
class _Settings:
  """The validated data config."""

  name: str
  task: str
  data_dir: str | None
  tfds_data_dir: str | None
  max_length: int
  tokenizer: str
  vocab_size: int
  sentencepiece_model_type: str
  vocab_path: str | None
  tokenizer_path: str | None
  tokenizer_max_corpus_chars: int
  source_lang: str
  target_lang: str
  packing: bool
  mlm_probability: float
  num_workers: int


def _settings(data_config) -> _Settings:
  keys = set(data_config.keys())
  unknown = sorted(keys - set(DATA_CONFIG_DEFAULTS))
  if unknown:
    # A warning, not an error: a typo should be visible, a training config that keeps its
    # own extra fields next to ours should still run.
    warnings.warn(f"make_pipeline ignores data config fields {unknown}; it reads "
                  f"{sorted(DATA_CONFIG_DEFAULTS)}.")
  s = _Settings(**{k: data_config[k] if k in keys else default
                   for k, default in DATA_CONFIG_DEFAULTS.items()})
  if s.task not in TASKS:
    raise ValueError(f"data.task={s.task!r}; valid: {TASKS}")
  if s.tokenizer not in tokenizers_lib.TOKENIZER_KINDS:
    raise ValueError(f"data.tokenizer={s.tokenizer!r}; valid: {tokenizers_lib.TOKENIZER_KINDS}")
  if s.sentencepiece_model_type not in tokenizers_lib.SENTENCEPIECE_MODEL_TYPES:
    raise ValueError(
        f"data.sentencepiece_model_type={s.sentencepiece_model_type!r}; valid: "
        f"{tokenizers_lib.SENTENCEPIECE_MODEL_TYPES}")
  if not isinstance(s.max_length, int) or s.max_length < 2:
    raise ValueError(f"data.max_length={s.max_length!r}; must be an int >= 2")
  if not 0.0 < s.mlm_probability < 1.0:
    raise ValueError(f"data.mlm_probability={s.mlm_probability!r}; must be in (0, 1)")
  if not isinstance(s.num_workers, int) or s.num_workers < 0:
    raise ValueError(f"data.num_workers={s.num_workers!r}; must be an int >= 0 (0 = in-process)")
  if s.task == "nmt" and s.packing:
    raise ValueError(
        "data.packing=True with data.task='nmt': translation batches are padded to "
        "data.max_length per side; set data.packing=False.")
  return s


def make_pipeline(
    data_config,
    *,
    split: str,
    seed: int,
    global_batch_size: int,
    train: bool,
    workdir: str | os.PathLike | None = None,
    process_index: int = 0,
    process_count: int = 1,
) -> Pipeline:
  """Builds the input pipeline of one split.

  Args:
    data_config: `ml_collections.ConfigDict` (a plain dict works too) with fields
      (defaults in `DATA_CONFIG_DEFAULTS`, `default_data_config()` builds one):
      name: data set: 'tiny_shakespeare' | 'shakespeare' (full works) | 'multi30k' |
        'ud_english_ewt' (ours, from local files or their public URLs), or an official TFDS
        name: 'lm1b' | 'wmt14_translate/de-en' | 'wmt_t2t_translate/de-en' | ... (prepared in
        ArrayRecord format under tfds_data_dir; see `lowrank_attn.data.datasets`).
      task: 'lm' (decoder LM, next-token targets) | 'mlm' (BERT masked LM) | 'nmt'.
      data_dir: local raw-data directory laid out like ../shared/data; None →
        $LOWRANK_ATTN_DATA → download from the public URLs.
      tfds_data_dir: where prepared ArrayRecord datasets are written and read; None →
        `<workdir>/tfds` if workdir else ~/tensorflow_datasets.
      max_length: lm/mlm: tokens per row; nmt: max tokens per side, EOS included.
      tokenizer: 'char' | 'sentencepiece' | 'wordpiece'.
      vocab_size: SentencePiece vocabulary size (> 261: 5 special ids + 256 byte pieces).
      sentencepiece_model_type: 'unigram' | 'bpe'.
      vocab_path: WordPiece `vocab.txt`; None → the installed all-MiniLM-L6-v2 vocabulary.
      tokenizer_path: file where the trained char/SentencePiece vocabulary is cached; None →
        `<workdir>/tokenizers/<dataset>_<kind>…` (or trained in memory without a workdir).
      tokenizer_max_corpus_chars: characters of the training split used to train it.
      source_lang, target_lang: nmt sides (feature names, e.g. 'en', 'de'); for lm/mlm on a
        parallel corpus, source_lang picks the side.
      packing: lm/mlm: concatenate documents and split them into rows (segment_ids mark the
        documents); False pads or truncates each document to its own row. Must be False
        for nmt.
      mlm_probability: share of tokens chosen for masked-LM corruption.
      num_workers: grain worker processes for training pipelines; 0 runs in-process. The
        batches depend on it (each worker packs its own slice), so keep it fixed when
        resuming.
    split: 'train' | 'validation' | 'test' (or a TFDS split expression like 'train[:10%]').
    seed: shuffling (per epoch) and masked-LM corruption derive from it.
    global_batch_size: rows per step over all processes; divisible by process_count.
    train: True: infinite, reshuffled each epoch, documents too long for nmt dropped, last
      partial batch dropped. False: one pass in file order, every example exactly once
      (nmt/unpacked examples truncated to max_length), the last batch padded with rows of
      weight 0; every process yields the same number of batches.
    workdir: run directory (tokenizer cache, default tfds_data_dir).
    process_index, process_count: this process's rows are examples
      process_index::process_count of the split (`jax.process_index()`, `jax.process_count()`).

  Returns:
    A `Pipeline` yielding dicts of numpy arrays with `global_batch_size // process_count` rows.
  """
  settings = _settings(data_config)
  if global_batch_size <= 0 or process_count <= 0 or global_batch_size % process_count:
    raise ValueError(
        f"global_batch_size={global_batch_size} must be a positive multiple of "
        f"process_count={process_count}.")
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index}; valid: 0..{process_count - 1}")
  tfds_data_dir = settings.tfds_data_dir or datasets.default_tfds_data_dir(workdir)
  spec = datasets.dataset_spec(settings.name)
  if settings.name == "multi30k_captions":
    raise ValueError(
        "data.name='multi30k_captions' is a retrieval test set (5 captions per image), not a "
        "training corpus; read it with lowrank_attn.data.load_data_source.")
  source = datasets.load_data_source(
      settings.name, split, data_dir=settings.data_dir, tfds_data_dir=tfds_data_dir)
  fields = _text_fields(settings, spec, source)
  tokenizer = _load_tokenizer(settings, fields, workdir=workdir, tfds_data_dir=tfds_data_dir)
  return Pipeline(
      source=source,
      settings=settings,
      fields=fields,
      tokenizer=tokenizer,
      split=split,
      seed=seed,
      global_batch_size=global_batch_size,
      train=train,
      process_index=process_index,
      process_count=process_count,
  )


def _text_fields(settings: _Settings, spec: datasets.DatasetSpec, source) -> tuple[str, ...]:
  """Features holding the text: (text,) for lm/mlm, (source, target) for nmt."""
  features = list(source[0].keys()) if len(source) else []
  if settings.task == "nmt":
    fields = (settings.source_lang, settings.target_lang)
    if settings.source_lang == settings.target_lang:
      raise ValueError(f"data.source_lang and data.target_lang are both {settings.source_lang!r}")
  elif spec.text_feature is not None and spec.text_feature in features:
    fields = (spec.text_feature,)
  else:
    fields = (settings.source_lang,)
  for field in fields:
    if field not in features:
      raise ValueError(
          f"data.name={settings.name!r} has no feature {field!r} (features: {features}); "
          "for nmt set data.source_lang/target_lang to two of them.")
  return fields


def _load_tokenizer(settings: _Settings, fields, *, workdir,
                    tfds_data_dir) -> tokenizers_lib.Tokenizer:
  cache_path = settings.tokenizer_path
  if cache_path is None and workdir is not None and settings.tokenizer != "wordpiece":
    kind = settings.tokenizer
    if kind == "sentencepiece":
      kind = f"spm_{settings.sentencepiece_model_type}{settings.vocab_size}"
    dataset = re.sub(r"[^A-Za-z0-9_.-]", "_", settings.name)
    suffix = "json" if settings.tokenizer == "char" else "model"
    cache_path = os.path.join(
        os.fspath(workdir), "tokenizers", f"{dataset}_{'+'.join(fields)}_{kind}.{suffix}")

  def training_texts() -> Iterator[str]:
    try:
      train_source = datasets.load_data_source(
          settings.name, "train", data_dir=settings.data_dir, tfds_data_dir=tfds_data_dir)
    except ValueError as e:
      raise ValueError(
          f"The {settings.tokenizer} tokenizer is trained on the 'train' split of "
          f"{settings.name!r}, which is not available ({e}). Set data.tokenizer_path to an "
          "existing tokenizer file, or use data.tokenizer='wordpiece'.") from e
    budget = settings.tokenizer_max_corpus_chars
    chunk = 1024  # batched reads are ~2x faster than one record at a time
    for start in range(0, len(train_source), chunk):
      stop = min(start + chunk, len(train_source))
      for example in train_source.__getitems__(range(start, stop)):
        for field in fields:
          text = example[field].decode("utf-8")
          yield text
          budget -= len(text)
        if budget <= 0:
          return

  return tokenizers_lib.load_or_train(
      settings.tokenizer,
      cache_path=cache_path,
      training_texts=training_texts() if settings.tokenizer != "wordpiece" else None,
      vocab_size=settings.vocab_size,
      model_type=settings.sentencepiece_model_type,
      vocab_path=settings.vocab_path,
  )


# ------------------------------------------------------------------------- per-example steps
# Callable classes rather than closures: grain worker processes pickle them.


class _EncodeLM:
  """Document → {'inputs': [bos, t1..tn], 'targets': [t1..tn, eos]}, truncated if unpacked."""

  def __init__(self, tokenizer, field: str, truncate_to: int | None):
    self.tokenizer, self.field, self.truncate_to = tokenizer, field, truncate_to

  def __call__(self, example):
    ids = self.tokenizer.encode(example[self.field].decode("utf-8"))
    tokens = np.asarray([self.tokenizer.bos_id, *ids, self.tokenizer.eos_id], np.int32)
    inputs, targets = tokens[:-1], tokens[1:]
    if self.truncate_to is not None:
      inputs, targets = inputs[: self.truncate_to], targets[: self.truncate_to]
    return {"inputs": inputs, "targets": targets}


class _EncodeMLM:
  """Document → {'tokens': [bos, t1..tn, eos]} (BERT's [CLS] … [SEP]), truncated if unpacked."""

  def __init__(self, tokenizer, field: str, truncate_to: int | None):
    self.tokenizer, self.field, self.truncate_to = tokenizer, field, truncate_to

  def __call__(self, example):
    ids = self.tokenizer.encode(example[self.field].decode("utf-8"))
    if self.truncate_to is not None:
      ids = ids[: self.truncate_to - 2]
    return {"tokens": np.asarray([self.tokenizer.bos_id, *ids, self.tokenizer.eos_id], np.int32)}


class _EncodeNMT:
  """Pair → {'inputs': source + [eos], 'targets': target + [eos]}; truncated when evaluating."""

  def __init__(self, tokenizer, fields: tuple[str, str], max_length: int, truncate: bool):
    self.tokenizer, self.fields = tokenizer, fields
    self.max_length, self.truncate = max_length, truncate

  def __call__(self, example):
    out = {}
    for key, field in zip(("inputs", "targets"), self.fields):
      ids = self.tokenizer.encode(example[field].decode("utf-8"))
      if self.truncate:
        ids = ids[: self.max_length - 1]
      out[key] = np.asarray([*ids, self.tokenizer.eos_id], np.int32)
    return out


class _FitsLength:
  def __init__(self, max_length: int):
    self.max_length = max_length

  def __call__(self, element) -> bool:
    return all(len(v) <= self.max_length for v in element.values())


class _PadRow:
  """Variable-length sequences → fixed-length rows with the batch keys of the task."""

  def __init__(self, task: str, max_length: int):
    self.task, self.max_length = task, max_length

  def _pad(self, x):
    out = np.zeros(self.max_length, np.int32)
    out[: len(x)] = x
    return out

  def __call__(self, element):
    if self.task == "nmt":
      targets = self._pad(element["targets"])
      return {"inputs": self._pad(element["inputs"]), "targets": targets,
              "weights": (targets != 0).astype(np.float32)}
    key = "inputs" if self.task == "lm" else "tokens"
    n = len(element[key])
    segment_ids = np.zeros(self.max_length, np.int32)
    segment_ids[:n] = 1
    positions = np.zeros(self.max_length, np.int32)
    positions[:n] = np.arange(n)
    row = {k: self._pad(v) for k, v in element.items()}
    return _finish_row(self.task, row, segment_ids, positions)


class _FinishPackedRow:
  """Renames grain's packing outputs to the batch keys of the task."""

  def __init__(self, task: str):
    self.task = task

  def __call__(self, packed):
    key = "inputs" if self.task == "lm" else "tokens"
    row = {k: packed[k] for k in (("inputs", "targets") if self.task == "lm" else ("tokens",))}
    return _finish_row(self.task, row, packed[f"{key}_segment_ids"], packed[f"{key}_positions"])


def _finish_row(task, row, segment_ids, positions):
  if task == "lm":
    return {"inputs": row["inputs"], "targets": row["targets"],
            "weights": (segment_ids > 0).astype(np.float32),
            "segment_ids": segment_ids, "positions": positions}
  # mlm: inputs/targets/weights are filled in by the masking step after batching.
  return {"tokens": row["tokens"], "segment_ids": segment_ids, "positions": positions}


def mask_tokens(
    tokens: np.ndarray, segment_ids: np.ndarray, tokenizer, probability: float,
    rng: np.random.Generator,
) -> dict[str, np.ndarray]:
  """BERT masked-LM corruption (Devlin et al. 2019, sec. 3.1).

  Each real, non-special token is chosen with `probability`; a chosen token becomes [MASK]
  80% of the time, a random regular token 10%, and stays unchanged 10%. Loss weights are 1
  exactly on chosen tokens; targets are the original tokens.
  """
  special = (segment_ids == 0) | (tokens == tokenizer.bos_id) | (tokens == tokenizer.eos_id)
  chosen = (rng.random(tokens.shape) < probability) & ~special
  action = rng.random(tokens.shape)
  inputs = tokens.copy()
  inputs[chosen & (action < 0.8)] = tokenizer.mask_id
  randomized = chosen & (action >= 0.8) & (action < 0.9)
  inputs[randomized] = rng.integers(
      tokenizer.first_regular_id, tokenizer.vocab_size, size=int(randomized.sum()))
  return {"inputs": inputs.astype(np.int32), "targets": tokens.astype(np.int32),
          "weights": chosen.astype(np.float32)}


# ---------------------------------------------------------------------------------- Pipeline


class Pipeline:
  """An iterator of batches (dicts of numpy arrays) with a checkpointable position.

  Attributes:
    tokenizer: the `Tokenizer` (vocab_size, pad_id == 0, bos_id, eos_id, mask_id, ...).
    task: 'lm' | 'mlm' | 'nmt'.
    split: the split read.
    train: True for the infinite, shuffled training stream.
    global_batch_size, batch_size: rows per step over all processes / on this process.
    element_spec: name → ArraySpec(shape, dtype) of every batch.
    data_source: random-access examples of the split (raw text as bytes), in file order.

  For evaluation (train=False) each `for` loop is one pass: once a pass has ended, `iter()`
  starts the next one from the beginning. `num_batches` gives its length.
  """

  def __init__(self, *, source, settings: _Settings, fields, tokenizer, split: str, seed: int,
               global_batch_size: int, train: bool, process_index: int, process_count: int):
    self.tokenizer = tokenizer
    self.task = settings.task
    self.split = split
    self.train = train
    self.seed = seed
    self.global_batch_size = global_batch_size
    self.batch_size = global_batch_size // process_count
    self.max_length = settings.max_length
    self.data_source = source
    self.process_index, self.process_count = process_index, process_count
    self._settings = settings
    self._fields = fields
    if train and settings.task == "nmt":
      self._check_some_pairs_fit()
    self._dataset = self._build(source)
    self._iterator = None
    self._step = 0  # batches served in this pass (train: since the start)
    self._exhausted = False  # eval: the pass has ended
    self._num_batches: int | None = None

  # ------------------------------------------------------------------ the grain dataset

  def _encoder(self, truncate: bool):
    s = self._settings
    if s.task == "nmt":
      return _EncodeNMT(self.tokenizer, self._fields, s.max_length, truncate=truncate)
    truncate_to = None if s.packing else s.max_length
    cls = _EncodeLM if s.task == "lm" else _EncodeMLM
    return cls(self.tokenizer, self._fields[0], truncate_to)

  def _check_some_pairs_fit(self, sample_size: int = 256) -> None:
    """Training drops pairs longer than max_length; if all are, it would search forever."""
    encode = self._encoder(truncate=False)
    sample = [encode(self.data_source[i]) for i in range(min(sample_size, len(self.data_source)))]
    if sample and not any(_FitsLength(self.max_length)(pair) for pair in sample):
      longest = sorted(max(len(v) for v in pair.values()) for pair in sample)
      raise ValueError(
          f"data.max_length={self.max_length}: none of the first {len(sample)} pairs of "
          f"{self._settings.name}/{self.split} fits (their longer side has a median of "
          f"{longest[len(longest) // 2]} tokens with EOS); training drops pairs longer than "
          "max_length, so raise it.")

  def _shard(self, source) -> grain.MapDataset:
    return grain.MapDataset.source(source)[self.process_index :: self.process_count]

  def _build(self, source) -> grain.IterDataset:
    s = self._settings
    ds = self._shard(source)
    if self.train:
      # Shuffle before repeat: grain folds the epoch into the seed, so every epoch is a new
      # permutation, the same for the same seed.
      ds = ds.seed(self.seed).shuffle().repeat(None)
    ds = ds.map(self._encoder(truncate=not self.train))
    if self.train and s.task == "nmt":
      ds = ds.filter(_FitsLength(s.max_length))
    it = ds.to_iter_dataset(_READ_OPTIONS)
    if s.packing:
      key_lengths = ({"inputs": s.max_length, "targets": s.max_length} if s.task == "lm"
                     else {"tokens": s.max_length})
      it = ConcatThenSplitIterDataset(it, length_struct=key_lengths)
      it = it.map(_FinishPackedRow(s.task))
    else:
      it = it.map(_PadRow(s.task, s.max_length))
    it = it.batch(self.batch_size, drop_remainder=self.train)
    if self.train and s.num_workers > 0:
      # Evaluation stays in-process: per-worker partial last batches would break the
      # "same number of batches on every process" guarantee.
      if not flags.FLAGS.is_parsed():
        # grain's workers read absl flags; outside an absl app (tests, notebooks) use defaults.
        flags.FLAGS.mark_as_parsed()
      it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=s.num_workers))
    return it

  # ------------------------------------------------------------------------- iteration

  @property
  def element_spec(self) -> dict[str, ArraySpec]:
    shape = (self.batch_size, self.max_length)
    int32, float32 = np.dtype(np.int32), np.dtype(np.float32)
    if self.task == "nmt":
      return {"inputs": ArraySpec(shape, int32), "targets": ArraySpec(shape, int32),
              "weights": ArraySpec(shape, float32)}
    return {"inputs": ArraySpec(shape, int32), "targets": ArraySpec(shape, int32),
            "weights": ArraySpec(shape, float32), "segment_ids": ArraySpec(shape, int32),
            "positions": ArraySpec(shape, int32)}

  def __iter__(self) -> Pipeline:
    if self._exhausted:
      self.reset()
    return self

  def reset(self) -> None:
    """Back to the first batch (of the first epoch, for training)."""
    self.close()
    self._step, self._exhausted = 0, False

  def _grain_iterator(self):
    if self._iterator is None:
      self._iterator = iter(self._dataset)
    return self._iterator

  def __next__(self) -> dict[str, np.ndarray]:
    if self._exhausted:
      raise StopIteration
    if not self.train and self.process_count > 1 and self._step >= self.num_batches:
      self._exhausted = True
      raise StopIteration
    try:
      batch = next(self._grain_iterator())
    except StopIteration:
      if self.train or self.process_count == 1 or self._step >= self.num_batches:
        self._exhausted = True
        raise
      batch = None  # this process ran out before the others: a batch of padding
    batch = self._finish_batch(batch)
    self._step += 1
    return batch

  def _finish_batch(self, batch) -> dict[str, np.ndarray]:
    spec = self.element_spec
    if batch is None:  # rows of padding only; mlm rows hold `tokens` until masked below
      keys = ("tokens", "segment_ids", "positions") if self.task == "mlm" else tuple(spec)
      batch = {k: np.zeros((0, self.max_length), spec.get(k, spec["inputs"]).dtype) for k in keys}
    rows = len(next(iter(batch.values())))
    if rows < self.batch_size:  # the last evaluation batch: pad with weight-0 rows
      batch = {k: np.concatenate([v, np.zeros((self.batch_size - rows,) + v.shape[1:], v.dtype)])
               for k, v in batch.items()}
    if self.task == "mlm":
      rng = np.random.default_rng([self.seed, self.process_index, self._step])
      tokens = batch.pop("tokens")
      batch.update(mask_tokens(tokens, batch["segment_ids"], self.tokenizer,
                               self._settings.mlm_probability, rng))
    return {k: batch[k] for k in spec}

  @property
  def num_batches(self) -> int | None:
    """Batches in one evaluation pass, the same on every process (None for training)."""
    if self.train:
      return None
    if self._num_batches is None:
      self._num_batches = max(
          math.ceil(self._rows_of_process(p) / self.batch_size) for p in range(self.process_count))
    return self._num_batches

  def _rows_of_process(self, process: int) -> int:
    shard = grain.MapDataset.source(self.data_source)[process :: self.process_count]
    if not self._settings.packing:
      return len(shard)
    # Concat-then-split fills every row but the last: rows = ceil(tokens / row length).
    encode = self._encoder(truncate=True)
    key = "inputs" if self.task == "lm" else "tokens"
    tokens = sum(len(encode(shard[i])[key]) for i in range(len(shard)))
    return math.ceil(tokens / self.max_length)

  def close(self) -> None:
    """Stops grain worker processes, if any (also done on garbage collection)."""
    if self._iterator is not None and hasattr(self._iterator, "close"):
      self._iterator.close()
    self._iterator = None

  # ------------------------------------------------------------------------------ state

  def get_state(self) -> dict[str, Any]:
    """JSON-serializable position; `set_state` on a pipeline built the same way resumes it."""
    return {
        "format": STATE_FORMAT,
        "name": self._settings.name,
        "split": self.split,
        "seed": self.seed,
        "process_index": self.process_index,
        "process_count": self.process_count,
        "num_workers": self._settings.num_workers if self.train else 0,
        "step": self._step,
        "exhausted": self._exhausted,
        "grain": _to_json(self._grain_iterator().get_state()),
    }

  def set_state(self, state: dict[str, Any]) -> None:
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
      raise ValueError(
          f"Not a pipeline state (expected format {STATE_FORMAT!r}): {str(state)[:200]}")
    expected = {"name": self._settings.name, "split": self.split, "seed": self.seed,
                "process_index": self.process_index, "process_count": self.process_count,
                "num_workers": self._settings.num_workers if self.train else 0}
    mismatched = {k: (state.get(k), v) for k, v in expected.items() if state.get(k) != v}
    if mismatched:
      details = ", ".join(f"{k}: state {a!r} vs pipeline {b!r}" for k, (a, b) in mismatched.items())
      raise ValueError(
          f"This state was taken from a different pipeline ({details}); the data order would "
          "not continue. Save and restore one state per process, with the same data config.")
    self._grain_iterator().set_state(_from_json(state["grain"]))
    self._step = int(state["step"])
    self._exhausted = bool(state["exhausted"])


# grain's iterator states hold tuples (packing slices) that must come back as tuples; JSON
# would turn them into lists, and restoring from lists silently resumes at the wrong token.
_TUPLE, _NONSTR_DICT, _BYTES = "__tuple__", "__dict_items__", "__bytes__"


def _to_json(value):
  if isinstance(value, dict):
    if all(isinstance(k, str) for k in value):
      return {k: _to_json(v) for k, v in value.items()}
    return {_NONSTR_DICT: [[_to_json(k), _to_json(v)] for k, v in value.items()]}
  if isinstance(value, tuple):
    return {_TUPLE: [_to_json(v) for v in value]}
  if isinstance(value, list):
    return [_to_json(v) for v in value]
  if isinstance(value, bytes):
    return {_BYTES: value.hex()}
  if isinstance(value, np.generic):
    return value.item()
  return value


def _from_json(value):
  if isinstance(value, dict):
    if set(value) == {_TUPLE}:
      return tuple(_from_json(v) for v in value[_TUPLE])
    if set(value) == {_NONSTR_DICT}:
      return {_from_json(k): _from_json(v) for k, v in value[_NONSTR_DICT]}
    if set(value) == {_BYTES}:
      return bytes.fromhex(value[_BYTES])
    return {k: _from_json(v) for k, v in value.items()}
  if isinstance(value, list):
    return [_from_json(v) for v in value]
  return value
