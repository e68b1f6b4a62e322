"""Per-example and per-batch steps of the pipelines: encode, filter, pad, finish packed rows, mask.

Callable classes rather than closures: grain worker processes pickle them. Each returns
numpy arrays; the pad id is 0 for every tokenizer.

Batch keys (all `[batch, max_length]`; weights float32, the rest int32):
  lm         inputs, targets, weights, segment_ids, positions
  mlm        inputs, targets, weights (1 on the tokens to predict), segment_ids, positions
  nmt        inputs, targets, weights (1 on real target tokens)
  nmt packed the nmt keys and inputs_segment_ids, inputs_positions, targets_segment_ids,
             targets_positions (segment ids 1, 2, ... per row, 0 = padding; positions restart
             at 0 in every segment)
"""

import numpy as np

LM_KEYS = ('inputs', 'targets', 'weights', 'segment_ids', 'positions')
NMT_KEYS = ('inputs', 'targets', 'weights')
PACKED_NMT_KEYS = NMT_KEYS + (
    'inputs_segment_ids',
    'inputs_positions',
    'targets_segment_ids',
    'targets_positions',
)


def batch_keys(task: str, packed_pairs: bool) -> tuple[str, ...]:
  """The keys of a batch of `task` (`packed_pairs`: nmt training with packing)."""
  if task == 'nmt':
    return PACKED_NMT_KEYS if packed_pairs else NMT_KEYS
  return LM_KEYS


class EncodeLM:
  """Document -> {'inputs': [bos, t1..tn], 'targets': [t1..tn, eos]}, truncated if unpacked."""

  def __init__(self, tokenizer, field: str, truncate_to: int | None):
    self.tokenizer, self.field, self.truncate_to = tokenizer, field, truncate_to

  def __call__(self, example):
    ids = self.tokenizer.encode(example[self.field].decode('utf-8'))
    tokens = np.asarray([self.tokenizer.bos_id, *ids, self.tokenizer.eos_id], np.int32)
    inputs, targets = tokens[:-1], tokens[1:]
    if self.truncate_to is not None:
      inputs, targets = inputs[: self.truncate_to], targets[: self.truncate_to]
    return {'inputs': inputs, 'targets': targets}


class EncodeMLM:
  """Document -> {'tokens': [bos, t1..tn, eos]} (BERT's [CLS] ... [SEP]), truncated if unpacked."""

  def __init__(self, tokenizer, field: str, truncate_to: int | None):
    self.tokenizer, self.field, self.truncate_to = tokenizer, field, truncate_to

  def __call__(self, example):
    ids = self.tokenizer.encode(example[self.field].decode('utf-8'))
    if self.truncate_to is not None:
      ids = ids[: self.truncate_to - 2]
    return {'tokens': np.asarray([self.tokenizer.bos_id, *ids, self.tokenizer.eos_id], np.int32)}


class EncodeNMT:
  """Pair -> {'inputs': source + [eos], 'targets': target + [eos]}; truncated when evaluating."""

  def __init__(self, tokenizer, fields: tuple[str, str], max_length: int, truncate: bool):
    self.tokenizer, self.fields = tokenizer, fields
    self.max_length, self.truncate = max_length, truncate

  def __call__(self, example):
    out = {}
    for key, field in zip(('inputs', 'targets'), self.fields):
      ids = self.tokenizer.encode(example[field].decode('utf-8'))
      if self.truncate:
        ids = ids[: self.max_length - 1]
      out[key] = np.asarray([*ids, self.tokenizer.eos_id], np.int32)
    return out


class FitsLength:
  """True when every sequence of the element has at most `max_length` tokens."""

  def __init__(self, max_length: int):
    self.max_length = max_length

  def __call__(self, element) -> bool:
    return all(len(v) <= self.max_length for v in element.values())


def _pad(x, max_length: int) -> np.ndarray:
  out = np.zeros(max_length, np.int32)
  out[: len(x)] = x
  return out


class PadRow:
  """Variable-length sequences -> fixed-length rows with the batch keys of the task."""

  def __init__(self, task: str, max_length: int):
    self.task, self.max_length = task, max_length

  def __call__(self, element):
    if self.task == 'nmt':
      targets = _pad(element['targets'], self.max_length)
      return {
          'inputs': _pad(element['inputs'], self.max_length),
          'targets': targets,
          'weights': (targets != 0).astype(np.float32),
      }
    key = 'inputs' if self.task == 'lm' else 'tokens'
    n = len(element[key])
    segment_ids = np.zeros(self.max_length, np.int32)
    segment_ids[:n] = 1
    positions = np.zeros(self.max_length, np.int32)
    positions[:n] = np.arange(n)
    row = {k: _pad(v, self.max_length) for k, v in element.items()}
    return _finish_row(self.task, row, segment_ids, positions)


class FinishPackedRow:
  """Renames the outputs of grain's concat-then-split packing (lm, mlm) to the batch keys."""

  def __init__(self, task: str):
    self.task = task

  def __call__(self, packed):
    key = 'inputs' if self.task == 'lm' else 'tokens'
    row = {k: packed[k] for k in (('inputs', 'targets') if self.task == 'lm' else ('tokens',))}
    return _finish_row(self.task, row, packed[f'{key}_segment_ids'], packed[f'{key}_positions'])


class FinishPackedPair:
  """A row of grain's first-fit packing of nmt pairs -> the packed nmt batch keys.

  grain puts a pair in the first row where both its sides fit and gives both sides the same
  segment id, so segment k of `inputs` translates to segment k of `targets`.
  """

  def __call__(self, packed):
    return {
        'inputs': packed['inputs'],
        'targets': packed['targets'],
        'weights': (packed['targets_segment_ids'] > 0).astype(np.float32),
        **{k: packed[k].astype(np.int32) for k in PACKED_NMT_KEYS[3:]},
    }


def _finish_row(task, row, segment_ids, positions):
  if task == 'lm':
    return {
        'inputs': row['inputs'],
        'targets': row['targets'],
        'weights': (segment_ids > 0).astype(np.float32),
        'segment_ids': segment_ids,
        'positions': positions,
    }
  # mlm: inputs/targets/weights are filled in by the masking step after batching.
  return {'tokens': row['tokens'], 'segment_ids': segment_ids, 'positions': positions}


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
