"""The vectorised first-fit packer and row gathering against plain per-example references."""

import numpy as np
import pytest

from lowrank_attn.data import packing
from lowrank_attn.data import tokenizers
from lowrank_attn.tasks import lm


def reference_first_fit(lengths, max_length, num_bins, group):
  """First fit one example at a time, in Python lists, on each group of `group` examples.

  Returns the rows as lists of example indices (in order of arrival), group by group, round by
  round, bin by bin, and the offsets of every example."""
  lengths = [list(map(int, x)) for x in lengths]
  rows, offsets = [], [None] * len(lengths)
  for begin in range(0, len(lengths), group):
    rounds = []
    for i in range(begin, min(begin + group, len(lengths))):
      need = lengths[i]
      if not rounds:
        rounds.append([[] for _ in range(num_bins)])
      open_round = rounds[-1]

      def used(b):
        return [sum(lengths[e][key] for e in b) for key in range(len(need))]

      target = next(
          (b for b in open_round if all(u + x <= max_length for u, x in zip(used(b), need))), None
      )
      if target is None:
        rounds.append([[] for _ in range(num_bins)])
        target = rounds[-1][0]
      offsets[i] = used(target)
      target.append(i)
    rows += [b for r in rounds for b in r if b]
  return rows, offsets


@pytest.mark.parametrize(
    'num_examples, num_keys, max_length, num_bins, group',
    [
        (500, 2, 64, 8, 1024),  # one group
        (500, 2, 64, 8, 97),  # several groups, the last one short
        (300, 1, 16, 3, 50),
        (200, 3, 20, 1, 64),  # one row per round
        (64, 2, 10, 64, 64),  # more rows than examples fill
    ],
)
def test_first_fit_matches_a_plain_reference(num_examples, num_keys, max_length, num_bins, group):
  rng = np.random.default_rng(num_examples + num_keys)
  lengths = rng.integers(1, max_length + 1, (num_examples, num_keys))
  lengths[::7] = max_length  # exactly full rows
  rows, offsets = packing.first_fit(lengths, max_length, num_bins, group)
  expected_rows, expected_offsets = reference_first_fit(lengths, max_length, num_bins, group)
  assert [list(np.flatnonzero(rows == r)) for r in range(rows.max() + 1)] == expected_rows
  np.testing.assert_array_equal(offsets, np.asarray(expected_offsets))
  # No row overflows; every sequence starts where the previous one of its row ended.
  for members in expected_rows:
    placed = lengths[members]
    np.testing.assert_array_equal(offsets[members], np.cumsum(placed, 0) - placed)
    assert (placed.sum(0) <= max_length).all()


def test_first_fit_refuses_sequences_longer_than_a_row():
  with pytest.raises(ValueError, match=r'lengths range over \[1, 9\].*max_length=8'):
    packing.first_fit(np.array([[1, 9]]), 8, 4)
  with pytest.raises(ValueError, match=r'num_bins=0'):
    packing.first_fit(np.array([[1, 2]]), 8, 0)


def _encoded(sequences):
  """`Encoded` of examples given as dicts of token lists."""
  keys = sequences[0].keys()
  return packing.Encoded(
      {k: np.asarray([t for s in sequences for t in s[k]], np.int32) for k in keys},
      {k: np.concatenate([[0], np.cumsum([len(s[k]) for s in sequences])]) for k in keys},
  )


def test_gather_rows_places_tokens_segments_and_positions():
  rng = np.random.default_rng(0)
  max_length = 12
  sequences = [
      {k: list(rng.integers(1, 100, rng.integers(1, 5))) for k in ('a', 'b')} for _ in range(40)
  ]
  encoded = _encoded(sequences)
  ids = rng.permutation(40)[:30]
  lengths = np.stack([encoded.lengths(k)[ids] for k in ('a', 'b')], 1)
  rows, offsets = packing.first_fit(lengths, max_length, 4)
  order = np.argsort(rows, kind='stable')
  ids, rows, offsets = ids[order], rows[order], offsets[order]
  segments = np.array([sum(rows[:i] == rows[i]) + 1 for i in range(len(rows))])
  num_rows = rows.max() + 1
  out = packing.gather_rows(encoded, ('a', 'b'), ids, rows, offsets, segments, num_rows, max_length)
  for column, key in enumerate(('a', 'b')):
    expected = {
        name: np.zeros((num_rows, max_length), np.int32)
        for name in (key, f'{key}_segment_ids', f'{key}_positions')
    }
    for e, r, o, s in zip(ids, rows, offsets[:, column], segments):
      tokens = sequences[e][key]
      expected[key][r, o : o + len(tokens)] = tokens
      expected[f'{key}_segment_ids'][r, o : o + len(tokens)] = s
      expected[f'{key}_positions'][r, o : o + len(tokens)] = np.arange(len(tokens))
    for name, value in expected.items():
      np.testing.assert_array_equal(out[name], value, err_msg=name)
      assert out[name].dtype == np.int32


def test_encoded_examples_round_trip_through_bytes(tmp_path):
  sequences = [{'x': [3, 4, 5]}, {'x': []}, {'x': [7]}]
  encoded = _encoded(sequences)
  path = tmp_path / 'e.npz'
  path.write_bytes(encoded.to_bytes())
  loaded = packing.Encoded.from_file(path)
  assert len(loaded) == 3
  for i, s in enumerate(sequences):
    np.testing.assert_array_equal(loaded.example(i)['x'], s['x'])


def test_the_cache_fingerprint_follows_the_tokenizer_and_the_split_size():
  def encoder(chars):  # built afresh each time: equal state, equal fingerprint
    return lm.EncodeLM(tokenizers.CharTokenizer(chars), 'text', None)

  assert packing.fingerprint(encoder('abc'), 10) == packing.fingerprint(encoder('abc'), 10)
  assert packing.fingerprint(encoder('abc'), 10) != packing.fingerprint(encoder('abd'), 10)
  assert packing.fingerprint(encoder('abc'), 10) != packing.fingerprint(encoder('abc'), 11)
