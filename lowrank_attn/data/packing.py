"""Packed training rows from examples encoded once: first fit on lengths, rows built by index.

Packing example by example through grain (tokenize, then first fit one element at a time)
ran at ~1,400 Multi30k pairs/s per process, far behind an accelerator. Here the split is
tokenized once (`Encoded`: one flat token array per key, cached in the run directory), each
epoch is a seeded permutation of the kept examples, cut into windows of `WINDOW` examples
that are packed on their lengths alone (`first_fit`), and a batch of rows is gathered from
the flat arrays with a few numpy calls (`gather_rows`). Its position is (epoch, window, row):
restoring it re-packs that window, which is a function of the seed, so resume is exact.

    encoded = Encoded.encode(source, encoder)                  # or load_or_encode(..., path)
    stream = PackedDataset(encoded, ids, keys=('inputs', 'targets'), max_length=64,
                           batch_size=64, seed=0, finish=format_finish)
    iterator = iter(stream); batch = next(iterator); state = iterator.get_state()
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import hashlib
import io
import os
import pickle

import numpy as np

# Examples packed together at most: bounds the stall when a window is packed and the memory
# of its packing; Multi30k's 29k pairs are 2 windows.
WINDOW = 16_384
# Examples per first-fit group (`first_fit`): a window's groups are packed side by side, one
# numpy step per example of a group; each group's last round may leave a few rows less full.
GROUP = 1024

Rows = dict[str, np.ndarray]


class Encoded:
  """Every example of a split encoded: per key, all tokens end to end and where each starts.

  Attributes:
    tokens: key -> int32 [total tokens of the key], example after example.
    starts: key -> int64 [num_examples + 1]; example i's tokens are tokens[starts[i]:starts[i+1]].
  """

  def __init__(self, tokens: dict[str, np.ndarray], starts: dict[str, np.ndarray]):
    if tokens.keys() != starts.keys():
      raise ValueError(f'tokens keys {sorted(tokens)} != starts keys {sorted(starts)}')
    self.tokens, self.starts = tokens, starts
    self._lengths = {k: np.diff(v) for k, v in starts.items()}

  def __len__(self) -> int:
    return len(next(iter(self.starts.values()))) - 1 if self.starts else 0  # no keys: empty

  def lengths(self, key: str) -> np.ndarray:
    return self._lengths[key]

  def example(self, i: int) -> dict[str, np.ndarray]:
    return {k: v[self.starts[k][i] : self.starts[k][i + 1]] for k, v in self.tokens.items()}

  @classmethod
  def encode(
      cls, source, encoder: Callable[[dict], dict[str, np.ndarray]], chunk: int = 1024
  ) -> Encoded:
    """`encoder(example)` of every example of `source` (random access, in order)."""
    pieces: dict[str, list[np.ndarray]] = {}
    for begin in range(0, len(source), chunk):  # batched reads are ~4x faster than single ones
      for example in source.__getitems__(range(begin, min(begin + chunk, len(source)))):
        for key, ids in encoder(example).items():
          pieces.setdefault(key, []).append(np.asarray(ids, np.int32))
    tokens, starts = {}, {}
    for key, arrays in pieces.items():
      tokens[key] = np.concatenate(arrays)
      starts[key] = np.concatenate([[0], np.cumsum([len(a) for a in arrays])]).astype(np.int64)
    return cls(tokens, starts)

  def to_bytes(self) -> bytes:
    buffer = io.BytesIO()
    np.savez(
        buffer,
        **{f'tokens/{k}': v for k, v in self.tokens.items()},
        **{f'starts/{k}': v for k, v in self.starts.items()},
    )
    return buffer.getvalue()

  @classmethod
  def from_file(cls, path: str | os.PathLike) -> Encoded:
    with np.load(path) as arrays:
      parts = {'tokens': {}, 'starts': {}}
      for name in arrays.files:
        kind, key = name.split('/', 1)
        parts[kind][key] = arrays[name]
    return cls(**parts)


def fingerprint(encoder, num_examples: int) -> str:
  """What the encoding depends on (the encoder's pickled state, tokenizer included, and the
  split's size): a cache file named by it is never read for another encoding. (A WordPiece
  tokenizer pickles as the path of its vocabulary: a file edited in place is not noticed.)"""
  return hashlib.sha256(pickle.dumps((encoder, num_examples), protocol=4)).hexdigest()[:16]


def load_or_encode(source, encoder, path: str | os.PathLike | None, write) -> Encoded:
  """The cached encoding at `path`, else `Encoded.encode` (then written by `write(path, bytes)`,
  an atomic write). `path` None: no cache."""
  if path is not None and os.path.exists(path):
    return Encoded.from_file(path)
  encoded = Encoded.encode(source, encoder)
  if path is not None:
    write(path, encoded.to_bytes())
  return encoded


def first_fit(
    lengths: np.ndarray, max_length: int, num_bins: int, group: int = GROUP
) -> tuple[np.ndarray, np.ndarray]:
  """First-fit packing of examples into rounds of `num_bins` rows, run on groups of `group`
  consecutive examples at once.

  Within a group, examples are taken in order; one goes into the first row of the open round
  where every one of its sequences fits (Flax's WMT example packs pairs the same way), and when
  it fits in none the round is closed and a new one opened. The groups are independent, so one
  numpy step places an example of every group: the Python loop runs `group` times, not once
  per example. All rows are non-empty.

  Args:
    lengths: [num_examples, num_keys] tokens of each sequence of each example (<= max_length).
    max_length: tokens per row and key.
    num_bins: rows of a round.
    group: examples per group (the last one may be shorter).

  Returns:
    rows: [num_examples] the row of each example; rows are numbered group by group, round by
      round, bin by bin, from 0 without gaps;
    offsets: [num_examples, num_keys] where in its row each sequence starts.
  """
  lengths = np.asarray(lengths, np.int64)
  if lengths.ndim != 2:
    raise ValueError(f'lengths has shape {lengths.shape}; expected [num_examples, num_keys]')
  for name, value in (('num_bins', num_bins), ('group', group)):
    if value < 1:
      raise ValueError(f'{name}={value}; must be >= 1')
  if lengths.size and (lengths.max() > max_length or lengths.min() < 0):
    raise ValueError(
        f'lengths range over [{lengths.min()}, {lengths.max()}]; every one must '
        f'be in [0, max_length={max_length}]'
    )
  n, k = lengths.shape
  group = max(1, min(group, n))
  num_groups = -(-n // group)
  # The last group is completed with empty examples: they fit the first row and change nothing.
  steps = np.zeros((num_groups * group, k), np.int64)
  steps[:n] = lengths
  steps = steps.reshape(num_groups, group, k).transpose(2, 1, 0).copy()  # [key, step, group]
  free = [np.full((num_groups, num_bins), max_length, np.int64) for _ in range(k)]
  flat_free = [f.reshape(-1) for f in free]  # views: row j of group g is g * num_bins + j
  base = np.zeros(num_groups, np.int64)  # first bin of each group's open round
  bins = np.empty((group, num_groups), np.int64)
  offsets = np.empty((k, group, num_groups), np.int64)
  first = np.arange(num_groups) * num_bins
  for t in range(group):
    fits = free[0] >= steps[0, t, :, None]
    for key in range(1, k):
      fits &= free[key] >= steps[key, t, :, None]
    j = fits.argmax(axis=1)
    closed = ~fits.reshape(-1)[first + j]  # fits in no open row: that group's round is done
    if closed.any():
      for f in free:
        f[closed] = max_length
      base[closed] += num_bins
      j[closed] = 0
    where = first + j
    for key in range(k):
      offsets[key, t] = max_length - flat_free[key][where]
      flat_free[key][where] -= steps[key, t]
    bins[t] = base + j
  bins, offsets = bins.T, offsets.transpose(2, 1, 0)
  every = np.arange(num_groups)
  key = (every[:, None] * (base.max() + num_bins) + bins).reshape(-1)[:n]
  _, rows = np.unique(key, return_inverse=True)  # skip the rows the last rounds left empty
  return rows.reshape(n), offsets.reshape(-1, k)[:n]


def gather_rows(
    encoded: Encoded,
    keys: Sequence[str],
    ids: np.ndarray,
    rows: np.ndarray,
    offsets: np.ndarray,
    segment_ids: np.ndarray,
    num_rows: int,
    max_length: int,
) -> Rows:
  """Rows [num_rows, max_length] per key from placed examples, by index (no per-token loop).

  Args:
    encoded: the examples.
    keys: the keys to place (offsets' columns).
    ids: [m] examples (indices of `encoded`).
    rows: [m] their rows, in [0, num_rows).
    offsets: [m, len(keys)] where each sequence starts in its row.
    segment_ids: [m] the segment id of each example (1, 2, ... within a row).

  Returns:
    Per key: `key` (tokens, 0 on padding), `key_segment_ids` (0 on padding), `key_positions`
    (0, 1, ... within a segment, 0 on padding), all int32 [num_rows, max_length].
  """
  out = {}
  for column, key in enumerate(keys):
    lengths = encoded.lengths(key)[ids]
    first = np.cumsum(lengths) - lengths  # where each example's tokens start in the gather
    within = np.arange(int(lengths.sum())) - np.repeat(first, lengths)
    source = np.repeat(encoded.starts[key][ids], lengths) + within
    target = np.repeat(rows * max_length + offsets[:, column], lengths) + within
    for name, values in (
        (key, encoded.tokens[key][source]),
        (f'{key}_segment_ids', np.repeat(segment_ids, lengths)),
        (f'{key}_positions', within),
    ):
      flat = np.zeros(num_rows * max_length, np.int32)
      flat[target] = values
      out[name] = flat.reshape(num_rows, max_length)
  return out


class _Window:
  """One packed window: its examples sorted by row (and order of arrival within a row)."""

  def __init__(self, encoded: Encoded, keys, ids: np.ndarray, max_length: int, num_bins: int):
    lengths = np.stack([encoded.lengths(k)[ids] for k in keys], axis=1)
    rows, offsets = first_fit(lengths, max_length, num_bins, GROUP)
    order = np.argsort(rows, kind='stable')
    self.ids, self.rows, self.offsets = ids[order], rows[order], offsets[order]
    self.num_rows = int(self.rows[-1]) + 1
    self.row_starts = np.searchsorted(self.rows, np.arange(self.num_rows + 1))
    self.segment_ids = np.arange(len(ids)) - self.row_starts[self.rows] + 1


class PackedDataset:
  """An infinite stream of packed batches over `ids`, reshuffled every epoch; `iter()` gives a
  fresh iterator at the start of the first epoch.

  Every epoch holds every example of `ids` exactly once; rows run on from one epoch into the
  next, so no example is dropped at an epoch's end.
  """

  def __init__(
      self,
      encoded: Encoded,
      ids: np.ndarray,
      *,
      keys: Sequence[str],
      max_length: int,
      batch_size: int,
      seed: int,
      finish: Callable[[Rows], Rows],
      window: int = WINDOW,
  ):
    if not len(ids):
      raise ValueError('No example to pack (every one was filtered out).')
    if window < 1:
      raise ValueError(f'window={window}; must be >= 1')
    self.encoded, self.ids, self.keys = encoded, np.asarray(ids, np.int64), tuple(keys)
    self.max_length, self.batch_size, self.seed = max_length, batch_size, seed
    self.finish, self.window = finish, window
    self.windows_per_epoch = -(-len(self.ids) // window)

  def epoch_order(self, epoch: int) -> np.ndarray:
    """The examples of `epoch`, in the seeded order of that epoch."""
    return np.random.default_rng([self.seed, epoch]).permutation(self.ids)

  def pack(self, epoch: int, window: int) -> _Window:
    ids = self.epoch_order(epoch)[window * self.window : (window + 1) * self.window]
    return _Window(self.encoded, self.keys, ids, self.max_length, self.batch_size)

  def __iter__(self) -> PackedIterator:
    return PackedIterator(self)


class PackedIterator:
  """Batches of `batch_size` rows from a `PackedDataset`; `get_state`/`set_state` (JSON)."""

  def __init__(self, dataset: PackedDataset):
    self.dataset = dataset
    self._epoch = self._window_index = self._row = 0
    self._window: _Window | None = None

  def __iter__(self):
    return self

  def _current(self) -> _Window:
    if self._window is None:
      self._window = self.dataset.pack(self._epoch, self._window_index)
    return self._window

  def __next__(self) -> Rows:
    d = self.dataset
    pieces = []
    needed = d.batch_size
    while needed:
      w = self._current()
      take = min(needed, w.num_rows - self._row)
      begin, end = w.row_starts[self._row], w.row_starts[self._row + take]
      pieces.append(
          gather_rows(
              d.encoded,
              d.keys,
              w.ids[begin:end],
              w.rows[begin:end] - self._row,
              w.offsets[begin:end],
              w.segment_ids[begin:end],
              take,
              d.max_length,
          )
      )
      needed -= take
      self._row += take
      if self._row == w.num_rows:  # on to the next window (of the next epoch, after the last)
        self._row, self._window = 0, None
        self._window_index += 1
        if self._window_index == d.windows_per_epoch:
          self._epoch, self._window_index = self._epoch + 1, 0
    rows = (
        pieces[0]
        if len(pieces) == 1
        else {k: np.concatenate([p[k] for p in pieces]) for k in pieces[0]}
    )
    return d.finish(rows)

  def get_state(self) -> dict[str, int]:
    return {'epoch': self._epoch, 'window': self._window_index, 'row': self._row}

  def set_state(self, state: dict[str, int]) -> None:
    epoch, window, row = (int(state[k]) for k in ('epoch', 'window', 'row'))
    if epoch < 0 or not 0 <= window < self.dataset.windows_per_epoch or row < 0:
      raise ValueError(
          f'Packed-stream state {state} is out of range (epoch >= 0, window in '
          f'[0, {self.dataset.windows_per_epoch}), row >= 0).'
      )
    self._epoch, self._window_index, self._row, self._window = epoch, window, row, None
    if row >= self._current().num_rows:
      raise ValueError(
          f'Packed-stream state {state}: that window has only ' f'{self._current().num_rows} rows.'
      )
