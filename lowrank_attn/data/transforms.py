"""Reusable per-example and per-batch steps that task formats (`RowFormat`) are built from.

Callable classes rather than closures: grain worker processes pickle them. Each returns numpy
arrays; the pad id is 0 for every tokenizer. Segment ids number the examples of a row 1, 2, ...
(0 = padding); positions restart at 0 in every segment.
"""

import math

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


def max_predictions(length: int, probability: float) -> int:
  """Masked positions per row of `length` tokens: ceil(length * probability), BERT's
  `max_predictions_per_seq` (20 at 128 tokens; BERT used 80 at 512, this gives 77). A row's
  round(n * probability) chosen tokens never exceed it, since n <= length."""
  return max(1, math.ceil(length * probability))


def mask_tokens(
    tokens: np.ndarray,
    segment_ids: np.ndarray,
    tokenizer,
    probability: float,
    rng: np.random.Generator,
) -> dict[str, np.ndarray]:
  """BERT masked-LM corruption (Devlin et al. 2019, sec. 3.1, as its create_pretraining_data
  draws it): in each row, round(n * probability) (at least one) of its n real, non-special
  tokens are chosen uniformly at random; a chosen token becomes [MASK] 80% of the time, a random
  regular token 10%, and stays unchanged 10%.

  Returns `inputs` `[rows, length]` (the corrupted tokens) and, `[rows, P]` with P =
  `max_predictions(length, probability)`, BERT's masked_lm_positions/ids/weights:
  `masked_positions` (the chosen positions in increasing order, then 0), `targets` (the
  original tokens there) and `weights` (1 on the chosen, 0 on unused slots). The model
  computes logits at those positions only.
  """
  rows, length = tokens.shape
  slots = max_predictions(length, probability)
  eligible = (segment_ids > 0) & (tokens != tokenizer.bos_id) & (tokens != tokenizer.eos_id)
  counts = eligible.sum(axis=1)
  chosen_count = np.where(counts > 0, np.maximum(1, np.rint(counts * probability)), 0)
  used = np.arange(slots)[None, :] < chosen_count[:, None]  # [rows, slots]
  # The eligible tokens with the smallest random keys are chosen: a uniform draw of each count.
  keys = np.where(eligible, rng.random(tokens.shape), np.inf)
  first = np.argsort(keys, axis=1, kind='stable')[:, :slots]
  positions = np.sort(np.where(used, first, length), axis=1)
  positions = np.where(used, positions, 0).astype(np.int32)
  row_index = np.broadcast_to(np.arange(rows)[:, None], positions.shape)
  targets = np.where(used, tokens[row_index, positions], 0).astype(np.int32)

  action = rng.random(positions.shape)
  replacement = np.where(
      action < 0.8,
      tokenizer.mask_id,
      np.where(
          action < 0.9,
          rng.integers(tokenizer.first_regular_id, tokenizer.vocab_size, size=positions.shape),
          targets,
      ),
  )
  inputs = tokens.astype(np.int32).copy()
  inputs[row_index[used], positions[used]] = replacement[used]
  return {
      'inputs': inputs,
      'masked_positions': positions,
      'targets': targets,
      'weights': used.astype(np.float32),
  }
