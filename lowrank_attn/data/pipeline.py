"""grain input pipelines: tokenize, shuffle, pack or pad, shard per process, batch.

    pipeline = make_pipeline(config.data, format=task.data_format, split='train', seed=0,
                             global_batch_size=64, train=True, workdir=workdir,
                             process_index=jax.process_index(), process_count=jax.process_count())
    pipeline.element_spec                  # name -> ArraySpec(shape, dtype) of every batch
    batch = next(pipeline)                 # this process's rows, numpy, fixed shapes
    state = pipeline.get_state()           # JSON; save one per process with each checkpoint
    pipeline.set_state(state)              # resume: the next batch is the one it would have been

The pipeline is a grain `MapDataset` (random access over the ArrayRecord split: per-process
slice, per-epoch shuffle, tokenization, length filter) turned into an `IterDataset` (packing,
padding, batching, optional worker processes). Its position is grain's iterator state plus
the number of batches served, which also seeds masked-LM corruption. Formats that pack whole
examples by first fit (`RowFormat.first_fit_packing`: nmt training) skip grain: the split is
encoded once (cached in `<workdir>/encoded/`), and `packing.PackedDataset` packs each epoch's
shuffled examples on their lengths and gathers rows by index, with no per-example Python work
(`benchmarks/input_pipeline.py` measures both); its position is (epoch, window, row). The
per-example steps come from the task's `RowFormat` (`format.py`; each task module in
`lowrank_attn.tasks` owns one) built from the steps in `transforms.py`; the fields of the data
config are in `config.py`.
`lowrank_attn.tasks.make_pipeline(config.data, ...)` picks the format by `data.task`.
"""

from collections.abc import Callable, Iterator
import math
import os
import re
from typing import Any

from absl import flags
import grain
import numpy as np

from lowrank_attn import files
from lowrank_attn.data import datasets
from lowrank_attn.data import packing as packing_lib
from lowrank_attn.data import tokenizers as tokenizers_lib
from lowrank_attn.data.config import FILE_SPLIT_PREFIX, DataConfig, as_data_config
from lowrank_attn.data.format import ArraySpec, RowFormat

STATE_FORMAT = 'lowrank_attn.data.Pipeline/1'

# Reading threads of the in-process part of the pipeline. Tokenization holds the GIL, so more
# threads buy little; worker processes (data.num_workers) are the knob that scales.
_READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=256)


Barrier = Callable[[str], None]


def make_pipeline(
    data_config,
    *,
    format: RowFormat,  # pylint: disable=redefined-builtin
    split: str,
    seed: int,
    global_batch_size: int,
    train: bool,
    workdir: str | os.PathLike | None = None,
    process_index: int = 0,
    process_count: int = 1,
    barrier: Barrier | None = None,
) -> 'Pipeline':
  """Builds the input pipeline of one split.

  Args:
    data_config: `config.data` (a ConfigDict from `default_data_config`), a plain dict (missing
      fields take their defaults) or a `DataConfig`; fields documented in `DataConfig`.
    format: the task's `RowFormat` (`lowrank_attn.tasks.get(name).data_format`).
    split: 'train' | 'validation' | 'test' (or a TFDS split expression like 'train[:10%]'), or
      local text files: 'file:SOURCE:TARGET' (nmt; line i of SOURCE translates to line i of
      TARGET) or 'file:PATH' (lm, mlm; one document per line), gzip allowed, read with the
      run's tokenizer (`DataConfig.extra_test_splits` names the ones of extra_test_files).
    seed: shuffling (per epoch) and masked-LM corruption derive from it.
    global_batch_size: rows per step over all processes; divisible by process_count.
    train: True: infinite, reshuffled each epoch, nmt pairs with a side longer than max_length
      dropped, nmt pairs packed when data.packing. False: one pass in file order, every example
      exactly once (nmt/unpacked examples truncated to max_length, nmt one pair per row), the
      last batch padded with rows of weight 0; every process yields the same number of batches.
    workdir: run directory (tokenizer cache, default tfds_data_dir). A remote one (gs://...):
      the tokenizer is still kept there (read and written through epath: one vocabulary
      for all hosts), while the prepared data and the encoded rows, which are read as local
      files, go to this machine's directory of the run (`files.local_dir`).
    process_index, process_count: this process's rows are examples
      process_index::process_count of the split (`jax.process_index()`, `jax.process_count()`).
    barrier: with process_count > 1, process 0 prepares the data set and trains the tokenizer
      (files under tfds_data_dir and workdir), then every process calls `barrier(name)`, then
      the others load what process 0 wrote (or prepare their own copy where the directories
      are not shared: a remote workdir's local data; the processes of one machine then take
      turns, by a lock file there, so that one prepares and the others read). None: `jax.experimental.multihost_utils.sync_global_devices` when JAX
      runs several processes, else no barrier. Every process must build its pipelines in the
      same order.

  Returns:
    A `Pipeline` yielding dicts of numpy arrays with `global_batch_size // process_count` rows.
  """
  config = as_data_config(data_config)
  format.check_config(config)
  if global_batch_size <= 0 or process_count <= 0 or global_batch_size % process_count:
    raise ValueError(
        f'global_batch_size={global_batch_size} must be a positive multiple of '
        f'process_count={process_count}.'
    )
  if not 0 <= process_index < process_count:
    raise ValueError(f'process_index={process_index}; valid: 0..{process_count - 1}')
  tfds_data_dir = config.tfds_data_dir or datasets.default_tfds_data_dir(workdir)
  # A remote workdir's local caches are per machine: its processes take turns preparing.
  machine_dir = (
      files.local_dir(workdir) if workdir is not None and files.is_remote(workdir) else None
  )

  def prepare():
    with files.local_lock(machine_dir):
      source = _load_source(config, format, split, tfds_data_dir)
      fields = _text_fields(config, format, source)
      tokenizer = _load_tokenizer(config, fields, workdir=workdir, tfds_data_dir=tfds_data_dir)
      encoded = None
      if format.first_fit_packing(config, train=train) is not None:
        encoder = format.encoder(tokenizer, fields, config, truncate=False)
        path = (
            None
            if workdir is None
            else _encoded_cache_path(config, split, format, encoder, len(source), workdir)
        )
        encoded = packing_lib.load_or_encode(source, encoder, path, tokenizers_lib.write_atomically)
      return source, fields, tokenizer, encoded

  source, fields, tokenizer, encoded = process_zero_first(
      prepare,
      process_index=process_index,
      process_count=process_count,
      barrier=barrier,
      name=f'lowrank_attn.data prepared {config.name} {split}',
  )
  return Pipeline(
      source=source,
      config=config,
      format=format,
      fields=fields,
      tokenizer=tokenizer,
      split=split,
      seed=seed,
      global_batch_size=global_batch_size,
      train=train,
      process_index=process_index,
      process_count=process_count,
      encoded=encoded,
  )


def process_zero_first(
    prepare, *, process_index: int, process_count: int, barrier: Barrier | None, name: str
):
  """`prepare()` on process 0, then a barrier, then `prepare()` on the others.

  Two hosts writing the same TFDS directory or tokenizer file would collide; this way the
  others only read what process 0 wrote. Process 0 reaches the barrier even when `prepare`
  fails, so the others fail with their own error instead of waiting forever.
  """
  if process_count == 1:
    return prepare()
  barrier = barrier or _jax_barrier
  if process_index == 0:
    try:
      return prepare()
    finally:
      barrier(name)
  barrier(name)
  return prepare()


def _jax_barrier(name: str) -> None:
  import jax  # pylint: disable=g-import-not-at-top  # only multi-process runs need it

  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

    multihost_utils.sync_global_devices(name)


def _load_source(config: DataConfig, fmt: RowFormat, split: str, tfds_data_dir: str):
  if not split.startswith(FILE_SPLIT_PREFIX):
    return datasets.load_data_source(
        config.name, split, data_dir=config.data_dir, tfds_data_dir=tfds_data_dir
    )
  paths = split.removeprefix(FILE_SPLIT_PREFIX).split(':')
  features = _file_features(config, fmt)
  if len(paths) != len(features) or not all(paths):
    form = 'file:' + ':'.join(f.upper() for f in features)
    raise ValueError(
        f'split={split!r}: task={fmt.name!r} reads text files as {form!r} '
        f'(features {features}).'
    )
  return datasets.load_text_files(dict(zip(features, paths)))


def _file_features(config: DataConfig, fmt: RowFormat) -> tuple[str, ...]:
  """The features local text files are read as (one file each)."""
  return fmt.file_features(config, datasets.dataset_spec(config.name).text_feature)


def _text_fields(config: DataConfig, fmt: RowFormat, source) -> tuple[str, ...]:
  """The features holding the text (the format's choice), checked against the source."""
  spec = datasets.dataset_spec(config.name)
  features = list(source[0].keys()) if len(source) else []
  text_feature = spec.text_feature if spec.text_feature in features else None
  fields = fmt.text_fields(config, text_feature)
  for field in fields:
    if field not in features:
      raise ValueError(
          f'data.name={config.name!r} has no feature {field!r} (features: {features}); '
          'for nmt set data.source_lang/target_lang to two of them.'
      )
  return fields


def _encoded_cache_path(
    config: DataConfig, split: str, fmt: RowFormat, encoder, num_examples: int, workdir
) -> str:
  """The whole split encoded once (`packing.Encoded`), named by what the encoding depends on;
  in `<workdir>/encoded`, or this machine's directory of a remote run (read as a local file)."""
  name = re.sub(r'[^A-Za-z0-9_.-]', '_', f'{config.name}_{split}_{fmt.name}')
  return os.path.join(
      files.local_dir(workdir),
      'encoded',
      f'{name}_{packing_lib.fingerprint(encoder, num_examples)}.npz',
  )


def _tokenizer_cache_path(config: DataConfig, fields, workdir) -> str | None:
  cache_path = config.tokenizer_path
  if cache_path is None and workdir is not None and config.tokenizer != 'wordpiece':
    kind = config.tokenizer
    if kind == 'sentencepiece':
      kind = f'spm_{config.sentencepiece_model_type}{config.vocab_size}'
    dataset = re.sub(r'[^A-Za-z0-9_.-]', '_', config.name)
    suffix = 'json' if config.tokenizer == 'char' else 'model'
    cache_path = os.path.join(
        os.fspath(workdir), 'tokenizers', f"{dataset}_{'+'.join(fields)}_{kind}.{suffix}"
    )
  return cache_path


def load_tokenizer(
    data_config, workdir: str | os.PathLike, *, format: RowFormat
) -> tokenizers_lib.Tokenizer:  # pylint: disable=redefined-builtin
  """The tokenizer a run in `workdir` trained (or its WordPiece vocabulary), never training one.

  For reading a finished run without its data (`python -m lowrank_attn.translate`).
  Raises FileNotFoundError naming the file when the run has no such tokenizer.
  """
  config = as_data_config(data_config)
  path = _tokenizer_cache_path(config, _file_features(config, format), workdir)
  if path is not None and not files.exists(path):  # (a remote run's: gs://...)
    raise FileNotFoundError(
        f'no {config.tokenizer} tokenizer at {path} (the run trains it '
        'before its first step; set data.tokenizer_path if it is elsewhere)'
    )
  return tokenizers_lib.load_or_train(
      config.tokenizer,
      cache_path=path,
      training_texts=None,
      vocab_size=config.vocab_size,
      model_type=config.sentencepiece_model_type,
      vocab_path=config.vocab_path,
  )


def _load_tokenizer(
    config: DataConfig, fields, *, workdir, tfds_data_dir
) -> tokenizers_lib.Tokenizer:
  cache_path = _tokenizer_cache_path(config, fields, workdir)

  def training_texts() -> Iterator[str]:
    try:
      train_source = datasets.load_data_source(
          config.name, 'train', data_dir=config.data_dir, tfds_data_dir=tfds_data_dir
      )
    except ValueError as e:
      raise ValueError(
          f"The {config.tokenizer} tokenizer is trained on the 'train' split of "
          f'{config.name!r}, which is not available ({e}). Set data.tokenizer_path to an '
          "existing tokenizer file, or use data.tokenizer='wordpiece'."
      ) from e
    budget = config.tokenizer_max_corpus_chars
    chunk = 1024  # batched reads are ~2x faster than one record at a time
    for start in range(0, len(train_source), chunk):
      stop = min(start + chunk, len(train_source))
      for example in train_source.__getitems__(range(start, stop)):
        for field in fields:
          text = example[field].decode('utf-8')
          yield text
          budget -= len(text)
        if budget <= 0:
          return

  return tokenizers_lib.load_or_train(
      config.tokenizer,
      cache_path=cache_path,
      training_texts=training_texts() if config.tokenizer != 'wordpiece' else None,
      vocab_size=config.vocab_size,
      model_type=config.sentencepiece_model_type,
      vocab_path=config.vocab_path,
  )


class Pipeline:
  """An iterator of batches (dicts of numpy arrays) with a checkpointable position.

  Attributes:
    tokenizer: the `Tokenizer` (vocab_size, pad_id == 0, bos_id, eos_id, mask_id, ...).
    config: the `DataConfig`.
    format: the task's `RowFormat`; `task` is its name.
    split: the split read.
    train: True for the infinite, shuffled training stream.
    packed: rows hold several examples (the format's choice for data.packing and `train`).
    global_batch_size, batch_size: rows per step over all processes / on this process.
    element_spec: name -> ArraySpec(shape, dtype) of every batch (keys: the format's).
    data_source: random-access examples of the split (raw text as bytes), in file order.

  For evaluation (train=False) each `for` loop is one pass: once a pass has ended, `iter()`
  starts the next one from the beginning. `num_batches` gives its length.
  """

  def __init__(
      self,
      *,
      source,
      config: DataConfig,
      format: RowFormat,  # pylint: disable=redefined-builtin
      fields,
      tokenizer,
      split: str,
      seed: int,
      global_batch_size: int,
      train: bool,
      process_index: int,
      process_count: int,
      encoded: packing_lib.Encoded | None = None,
  ):
    """`encoded`: the split encoded by `format.encoder(..., truncate=False)`, for formats with
    `first_fit_packing` in training (None: encoded here)."""
    self.tokenizer = tokenizer
    self.config = config
    self.format = format
    self.task = format.name
    self.split = split
    self.train = train
    self.seed = seed
    self.global_batch_size = global_batch_size
    self.batch_size = global_batch_size // process_count
    self.max_length = config.max_length
    self.data_source = source
    self.process_index, self.process_count = process_index, process_count
    self.packed = format.packed(config, train=train)
    self._fields = fields
    self._train_filter = format.train_filter(config) if train else None
    if self._train_filter is not None:
      self._check_some_examples_fit()
    self._first_fit = format.first_fit_packing(config, train=train)
    if self._first_fit is None:
      self._dataset = self._build(source)
    else:
      self._dataset = self._build_packed(
          encoded or packing_lib.Encoded.encode(source, self._encoder(truncate=False))
      )
    self._iterator = None
    self._step = 0  # batches served in this pass (train: since the start)
    self._exhausted = False  # eval: the pass has ended
    self._num_batches: int | None = None

  # ------------------------------------------------------------------ the grain dataset

  def _encoder(self, truncate: bool):
    return self.format.encoder(self.tokenizer, self._fields, self.config, truncate=truncate)

  def _check_some_examples_fit(self, sample_size: int = 256) -> None:
    """Training drops examples longer than max_length; if all are, it would search forever."""
    encode = self._encoder(truncate=False)
    sample = [encode(self.data_source[i]) for i in range(min(sample_size, len(self.data_source)))]
    if sample and not any(self._train_filter(pair) for pair in sample):
      longest = sorted(max(len(v) for v in pair.values()) for pair in sample)
      raise ValueError(
          f'data.max_length={self.max_length}: none of the first {len(sample)} examples of '
          f'{self.config.name}/{self.split} fits (their longest sequence has a median of '
          f'{longest[len(longest) // 2]} tokens with EOS); training drops examples longer '
          'than max_length, so raise it.'
      )

  def _build_packed(self, encoded: packing_lib.Encoded) -> packing_lib.PackedDataset:
    """This process's examples that training keeps, packed (the rest of `_build`'s steps)."""
    ids = range(self.process_index, len(encoded), self.process_count)
    if self._train_filter is not None:
      ids = [i for i in ids if self._train_filter(encoded.example(i))]
    return packing_lib.PackedDataset(
        encoded,
        np.asarray(ids, np.int64),
        keys=self._first_fit.keys,
        max_length=self.max_length,
        batch_size=self.batch_size,
        seed=self.seed,
        finish=self._first_fit.finish,
        window=packing_lib.WINDOW,
    )

  def _build(self, source) -> grain.IterDataset:
    c = self.config
    ds = grain.MapDataset.source(source)[self.process_index :: self.process_count]
    if self.train:
      # Shuffle before repeat: grain folds the epoch into the seed, so every epoch is a new
      # permutation, the same for the same seed.
      ds = ds.seed(self.seed).shuffle().repeat(None)
    ds = ds.map(self._encoder(truncate=not self.train))
    if self._train_filter is not None:
      ds = ds.filter(self._train_filter)
    it = ds.to_iter_dataset(_READ_OPTIONS)
    it = self.format.rows(it, c, batch_size=self.batch_size, train=self.train)
    it = it.batch(self.batch_size, drop_remainder=self.train)
    if self.train and c.num_workers > 0:
      # Evaluation stays in-process: per-worker partial last batches would break the
      # "same number of batches on every process" guarantee.
      if not flags.FLAGS.is_parsed():
        # grain's workers read absl flags; outside an absl app (tests, notebooks) use defaults.
        flags.FLAGS.mark_as_parsed()
      it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=c.num_workers))
    return it

  # ------------------------------------------------------------------------- iteration

  @property
  def element_spec(self) -> dict[str, ArraySpec]:
    """Shape and dtype of every array of every batch: enough to compile the step before
    the first batch is read."""
    return self.format.element_spec(self.config, batch_size=self.batch_size, train=self.train)

  def __iter__(self) -> 'Pipeline':
    if self._exhausted:
      self.reset()
    return self

  def reset(self) -> None:
    """Back to the first batch (of the first epoch, for training)."""
    self.close()
    self._step, self._exhausted = 0, False

  def _current_iterator(self):
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
      batch = next(self._current_iterator())
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
    if batch is None:  # rows of padding only
      batch = {
          k: np.zeros((0, *v.shape), v.dtype)
          for k, v in self.format.row_spec(self.config, train=self.train).items()
      }
    rows = len(next(iter(batch.values())))
    if rows < self.batch_size:  # the last evaluation batch: pad with weight-0 rows
      batch = {
          k: np.concatenate([v, np.zeros((self.batch_size - rows,) + v.shape[1:], v.dtype)])
          for k, v in batch.items()
      }
    # The batch's random numbers (masked-LM corruption) follow from its position: resumable.
    rng = np.random.default_rng([self.seed, self.process_index, self._step])
    batch = self.format.finish_batch(batch, tokenizer=self.tokenizer, config=self.config, rng=rng)
    return {k: batch[k] for k in spec}

  @property
  def num_batches(self) -> int | None:
    """Batches in one evaluation pass, the same on every process (None for training)."""
    if self.train:
      return None
    if self._num_batches is None:
      self._num_batches = max(
          math.ceil(self._rows_of_process(p) / self.batch_size) for p in range(self.process_count)
      )
    return self._num_batches

  def _rows_of_process(self, process: int) -> int:
    shard = grain.MapDataset.source(self.data_source)[process :: self.process_count]
    return self.format.num_rows(shard, self._encoder(truncate=True), self.config)

  def padding_fraction(self, num_batches: int = 20) -> dict[str, float]:
    """Share of padding in the first `num_batches` batches (of a fresh pass), per token array.

    Keys: the format's `token_keys` ('inputs', and 'targets' for nmt); rows of padding that
    complete the last evaluation batch count as padding. Reads a new iterator: the pipeline's
    own position is unchanged.
    """
    token_keys = self.format.token_keys
    real = dict.fromkeys(token_keys.values(), 0)
    batches = 0
    iterator = iter(self._dataset)
    try:
      for batch in iterator:
        for key in real:
          real[key] += int(np.count_nonzero(batch[key]))
        batches += 1
        if batches == num_batches:
          break
    finally:
      if hasattr(iterator, 'close'):
        iterator.close()
    if not batches:
      raise ValueError(f'{self.config.name}/{self.split} yields no batches.')
    size = batches * self.batch_size * self.max_length
    return {name: 1.0 - real[key] / size for name, key in token_keys.items()}

  def close(self) -> None:
    """Stops grain worker processes, if any (also done on garbage collection)."""
    if self._iterator is not None and hasattr(self._iterator, 'close'):
      self._iterator.close()
    self._iterator = None

  # ------------------------------------------------------------------------------ state

  def _identity(self) -> dict[str, Any]:
    """What a state must have been taken with for the data order to continue."""
    return {
        'name': self.config.name,
        'split': self.split,
        'seed': self.seed,
        'process_index': self.process_index,
        'process_count': self.process_count,
        'num_workers': self.config.num_workers if self.train and self._first_fit is None else 0,
        'task': self.task,
        'max_length': self.max_length,
        'packing': self.config.packing,
        'batch_size': self.batch_size,
    }

  def get_state(self) -> dict[str, Any]:
    """JSON-serializable position; `set_state` on a pipeline built the same way resumes it."""
    return {
        'format': STATE_FORMAT,
        **self._identity(),
        'step': self._step,
        'exhausted': self._exhausted,
        self._iterator_kind: _to_json(self._current_iterator().get_state()),
    }

  @property
  def _iterator_kind(self) -> str:
    """The state key of the iterator's own position: grain's, or the packed stream's."""
    return 'grain' if self._first_fit is None else 'first_fit'

  def set_state(self, state: dict[str, Any]) -> None:
    if not isinstance(state, dict) or state.get('format') != STATE_FORMAT:
      raise ValueError(
          f'Not a pipeline state (expected format {STATE_FORMAT!r}): {str(state)[:200]}'
      )
    # States saved before a field was recorded do not have it; they are not refused for it.
    mismatched = {
        k: (state[k], v) for k, v in self._identity().items() if k in state and state[k] != v
    }
    if mismatched:
      details = ', '.join(f'{k}: state {a!r} vs pipeline {b!r}' for k, (a, b) in mismatched.items())
      raise ValueError(
          f'This state was taken from a different pipeline ({details}); the data order would '
          'not continue. Save and restore one state per process, with the same data config.'
      )
    if self._iterator_kind not in state:
      raise ValueError(
          f'This state holds no {self._iterator_kind!r} position (it has '
          f"{sorted(k for k in ('grain', 'first_fit') if k in state)}): it was saved by a "
          'pipeline that made its rows another way (before first-fit packing moved out of '
          'grain, say), so the data order would not continue.'
      )
    self._current_iterator().set_state(_from_json(state[self._iterator_kind]))
    self._step = int(state['step'])
    self._exhausted = bool(state['exhausted'])


# grain's iterator states hold tuples (packing slices) that must come back as tuples; JSON
# would turn them into lists, and restoring from lists silently resumes at the wrong token.
_TUPLE, _NONSTR_DICT, _BYTES = '__tuple__', '__dict_items__', '__bytes__'


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
