"""Reusable per-example and per-batch steps that task formats (`RowFormat`) are built from.

Callable classes rather than closures: grain worker processes pickle them. Each returns numpy
arrays; the pad id is 0 for every tokenizer. Segment ids number the examples of a row 1, 2, ...
(0 = padding); positions restart at 0 in every segment.
"""

from grain.experimental import ConcatThenSplitIterDataset
import numpy as np


class FitsLength:
  """True when every sequence of the element has at most `max_length` tokens."""

  def __init__(self, max_length: int):
    self.max_length = max_length

  def __call__(self, element) -> bool:
    return all(len(v) <= self.max_length for v in element.values())


def pad(x, max_length: int, dtype=np.int32) -> np.ndarray:
  """`x` followed by zeros up to `max_length`."""
  out = np.zeros(max_length, dtype)
  out[: len(x)] = x
  return out


class PadDocument:
  """One document per row: every sequence padded to `max_length`, plus `segment_ids` (1 on
  the document) and `positions`, both measured on `length_key`."""

  def __init__(self, max_length: int, length_key: str):
    self.max_length, self.length_key = max_length, length_key

  def __call__(self, element):
    n = len(element[self.length_key])
    segment_ids = np.zeros(self.max_length, np.int32)
    segment_ids[:n] = 1
    positions = np.zeros(self.max_length, np.int32)
    positions[:n] = np.arange(n)
    row = {k: pad(v, self.max_length) for k, v in element.items()}
    return {**row, 'segment_ids': segment_ids, 'positions': positions}


class RenamePacked:
  """grain's concat-then-split output -> `segment_ids`/`positions` of `length_key`."""

  def __init__(self, keys: tuple[str, ...], length_key: str):
    self.keys, self.length_key = keys, length_key

  def __call__(self, packed):
    return {
        **{k: packed[k] for k in self.keys},
        'segment_ids': packed[f'{self.length_key}_segment_ids'],
        'positions': packed[f'{self.length_key}_positions'],
    }


def concat_then_split(it, lengths: dict[str, int], length_key: str):
  """Documents concatenated and cut into full rows (the last one padded): no padding inside a
  stream, documents may straddle rows. Rows carry the keys of `lengths`, segment_ids and
  positions (of `length_key`)."""
  it = ConcatThenSplitIterDataset(it, length_struct=lengths)
  return it.map(RenamePacked(tuple(lengths), length_key))


def mask_tokens(
    tokens: np.ndarray,
    segment_ids: np.ndarray,
    tokenizer,
    probability: float,
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
      tokenizer.first_regular_id, tokenizer.vocab_size, size=int(randomized.sum())
  )
  return {
      'inputs': inputs.astype(np.int32),
      'targets': tokens.astype(np.int32),
      'weights': chosen.astype(np.float32),
  }
