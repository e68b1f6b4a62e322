"""grain pipelines on real data: batch contract, determinism, exact resume, eval passes."""

import collections
import gzip
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from lowrank_attn import tasks
from lowrank_attn import data
from lowrank_attn.data import datasets
from lowrank_attn.data import packing as packing_lib
from lowrank_attn.data import pipeline as pipeline_lib
from lowrank_attn.data import tokenizers

pytestmark = pytest.mark.filterwarnings('ignore::lowrank_attn.data.MissingSplitWarning')

TINY_LM = dict(name='tiny_shakespeare', task='lm', tokenizer='char', max_length=64)
TINY_MLM = dict(name='tiny_shakespeare', task='mlm', tokenizer='char', max_length=128)
MULTI30K_NMT = dict(
    name='multi30k',
    task='nmt',
    tokenizer='sentencepiece',
    vocab_size=8000,
    max_length=64,
    packing=False,
)
PACKED_NMT = dict(MULTI30K_NMT, packing=True)
UD_MLM = dict(name='ud_english_ewt', task='mlm', tokenizer='wordpiece', max_length=64)
PREPARE_WORKER = pathlib.Path(__file__).with_name('prepare_worker.py')


def _take(pipeline, n):
  return [next(pipeline) for _ in range(n)]


def _assert_same_batches(expected, actual):
  assert len(expected) == len(actual)
  for a, b in zip(expected, actual):
    assert a.keys() == b.keys()
    for key in a:
      np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def _real_rows(batches, key='inputs'):
  """Rows of real examples (weights not all zero), in order."""
  return [row for b in batches for row, w in zip(b[key], b['weights']) if w.any()]


@pytest.fixture
def pipeline(make_config, workdir):
  def make(config, *, split='train', seed=0, global_batch_size=8, train=True, **kwargs):
    return tasks.make_pipeline(
        make_config(**config),
        split=split,
        seed=seed,
        train=train,
        global_batch_size=global_batch_size,
        workdir=workdir,
        **kwargs,
    )

  return make


def test_lm_batches_follow_the_contract(pipeline, tfds_dir):
  p = pipeline(TINY_LM)
  assert p.task == 'lm' and p.tokenizer.pad_id == 0
  batch = next(p)
  assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {
      k: (s.shape, s.dtype) for k, s in p.element_spec.items()
  }
  assert batch['inputs'].shape == (8, 64)
  inputs, targets = batch['inputs'], batch['targets']
  segments, positions = batch['segment_ids'], batch['positions']
  np.testing.assert_array_equal(batch['weights'], (segments > 0).astype(np.float32))
  # Within a segment the target is the next input token; positions count up from 0.
  same = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)
  np.testing.assert_array_equal(targets[:, :-1][same], inputs[:, 1:][same])
  np.testing.assert_array_equal(positions[:, 1:][same], positions[:, :-1][same] + 1)
  assert (positions[:, 1:][~same & (segments[:, 1:] > 0)] == 0).all()
  # A segment that starts a document is bos + paragraph; its targets are paragraph + eos.
  train_text = '\n\n'.join(
      e['text'].decode()
      for e in data.load_data_source(
          'tiny_shakespeare', 'train', tfds_data_dir=tfds_dir
      ).__getitems__(range(6283))
  )
  for row in range(8):
    for segment in np.unique(segments[row][segments[row] > 0]):
      where = segments[row] == segment
      text = p.tokenizer.decode(targets[row][where])
      assert text in train_text
      if inputs[row][where][0] == p.tokenizer.bos_id and p.tokenizer.eos_id in targets[row][where]:
        assert f'\n\n{text}\n\n' in f'\n\n{train_text}\n\n'  # a whole paragraph


def test_same_seed_gives_the_same_batches_and_another_seed_others(pipeline):
  first = _take(pipeline(TINY_LM, seed=3), 4)
  _assert_same_batches(first, _take(pipeline(TINY_LM, seed=3), 4))
  other = _take(pipeline(TINY_LM, seed=4), 4)
  assert not np.array_equal(first[0]['inputs'], other[0]['inputs'])


@pytest.mark.parametrize(
    'config, split',
    [
        (TINY_LM, 'train'),
        (dict(TINY_LM, packing=False), 'train'),
        (TINY_MLM, 'train'),
        (MULTI30K_NMT, 'train'),
        (PACKED_NMT, 'train'),
        (UD_MLM, 'validation'),
    ],
)
@pytest.mark.parametrize('steps_before', [0, 7])
def test_restored_state_continues_with_exactly_the_next_batches(
    pipeline, config, split, steps_before
):
  original = pipeline(config, split=split)
  _take(original, steps_before)
  state = json.loads(json.dumps(original.get_state()))  # saved as JSON with the checkpoint
  expected = _take(original, 6)
  resumed = pipeline(config, split=split)
  resumed.set_state(state)
  _assert_same_batches(expected, _take(resumed, 6))


def test_each_epoch_is_a_new_permutation_of_every_example(pipeline):
  p = pipeline(MULTI30K_NMT, split='test', global_batch_size=100, seed=1)
  sources = sorted(e['en'].decode() for e in p.data_source.__getitems__(range(1000)))
  epochs = []
  for _ in range(2):
    rows = [p.tokenizer.decode(r) for b in _take(p, 10) for r in b['inputs']]
    assert sorted(rows) == sources
    epochs.append(rows)
  assert epochs[0] != epochs[1]


def test_eval_pass_yields_every_example_once_and_pads_the_last_batch(pipeline):
  p = pipeline(MULTI30K_NMT, split='validation', global_batch_size=64, train=False)
  batches = list(p)
  assert len(batches) == p.num_batches == 16  # 1,014 = 15 * 64 + 54
  last = batches[-1]
  assert last['weights'][:54].any(axis=1).all() and not last['weights'][54:].any()
  assert not last['inputs'][54:].any() and not last['targets'][54:].any()
  examples = p.data_source.__getitems__(range(1014))
  assert [p.tokenizer.decode(r) for r in _real_rows(batches)] == [
      e['en'].decode() for e in examples
  ]
  assert [p.tokenizer.decode(r) for r in _real_rows(batches, 'targets')] == [
      e['de'].decode() for e in examples
  ]
  for b in batches:  # weights: 1 on target tokens including EOS, 0 on padding
    np.testing.assert_array_equal(b['weights'], (b['targets'] != 0).astype(np.float32))
  _assert_same_batches(batches, list(p))  # the next `for` loop is a new, identical pass


def test_packed_eval_pass_counts_every_token_once(pipeline, tfds_dir):
  p = pipeline(dict(TINY_LM, max_length=128), split='validation', global_batch_size=16, train=False)
  batches = list(p)
  assert len(batches) == p.num_batches
  paragraphs = [e['text'].decode() for e in p.data_source.__getitems__(range(440))]
  assert sum(b['weights'].sum() for b in batches) == sum(len(t) + 1 for t in paragraphs)
  starts = [b['targets'][b['segment_ids'] > 0] for b in batches]
  assert p.tokenizer.decode(np.concatenate(starts)) == paragraphs[0]  # up to the first eos


def test_processes_read_disjoint_shards_and_eval_passes_have_equal_length(pipeline):
  index_of = collections.defaultdict(set)
  nmt = pipeline(MULTI30K_NMT, split='validation', train=False)
  for i, e in enumerate(nmt.data_source.__getitems__(range(1014))):
    index_of[e['en'].decode()].add(i)
  seen = collections.Counter()
  for process in range(3):
    p = pipeline(
        MULTI30K_NMT,
        split='validation',
        global_batch_size=48,
        train=False,
        process_index=process,
        process_count=3,
    )
    batches = list(p)
    assert len(batches) == p.num_batches == 22  # ceil(338 / 16): the same on every process
    assert all(b['inputs'].shape == (16, 64) for b in batches)
    for row in _real_rows(batches):
      sentence = p.tokenizer.decode(row)
      assert any(i % 3 == process for i in index_of[sentence])
      seen[sentence] += 1
  assert sum(seen.values()) == 1014 and all(
      seen[s] == len(indices) for s, indices in index_of.items()
  )
  # Training shards are disjoint too (and shuffled within each process).
  train_rows = [
      {p.tokenizer.decode(r) for b in _take(p, 5) for r in b['inputs']}
      for p in (
          pipeline(
              MULTI30K_NMT, split='test', global_batch_size=64, process_index=i, process_count=2
          )
          for i in range(2)
      )
  ]
  assert not train_rows[0] & train_rows[1]


def test_mlm_corrupts_15_percent_of_tokens_the_bert_way(pipeline):
  """Per row, round(0.15 n) of its n real non-special tokens (at least one) are predicted, at
  increasing positions listed in `masked_positions` (BERT's masked_lm_positions); 80% of them
  read [MASK], 10% a random token, 10% themselves; every other input is the original token."""
  p = pipeline(TINY_MLM, global_batch_size=16)
  batches = _take(p, 8)
  tok = p.tokenizer
  inputs, positions, targets, weights, segments = (
      np.concatenate([b[k] for b in batches])
      for k in ('inputs', 'masked_positions', 'targets', 'weights', 'segment_ids')
  )
  assert positions.shape == targets.shape == weights.shape == (128, 20)  # ceil(0.15 x 128)
  masked, unchanged, predicted = 0, 0, 0
  for row in range(len(inputs)):
    used = weights[row] > 0
    where, original = positions[row][used], inputs[row].copy()
    original[where] = targets[row][used]  # the row before corruption
    eligible = (segments[row] > 0) & (original != tok.bos_id) & (original != tok.eos_id)
    assert used.sum() == max(1, round(0.15 * eligible.sum()))
    assert not used[used.sum() :].any()  # the used slots come first
    assert (np.diff(where) > 0).all() and eligible[where].all()
    assert (positions[row][~used] == 0).all() and (targets[row][~used] == 0).all()
    others = np.ones(len(original), bool)
    others[where] = False
    np.testing.assert_array_equal(inputs[row][others], original[others])
    masked += (inputs[row][where] == tok.mask_id).sum()
    unchanged += (inputs[row][where] == original[where]).sum()
    predicted += used.sum()
  assert abs(masked / predicted - 0.8) < 0.04 and abs(unchanged / predicted - 0.1) < 0.03
  # The corruption is a function of (seed, step): a resumed run masks identically.
  _assert_same_batches(batches, _take(pipeline(TINY_MLM, global_batch_size=16), 8))


def test_sentencepiece_vocabulary_is_cached_in_the_workdir_and_reused(pipeline, workdir):
  first = pipeline(MULTI30K_NMT)
  cached = os.path.join(workdir, 'tokenizers', 'multi30k_en+de_spm_unigram8000.model')
  assert os.path.isfile(cached)
  modified = os.stat(cached).st_mtime_ns
  second = pipeline(MULTI30K_NMT, split='validation', train=False)
  assert os.stat(cached).st_mtime_ns == modified
  assert second.tokenizer.model_proto == first.tokenizer.model_proto


@pytest.mark.parametrize(
    'overrides, kwargs, message',
    [
        (
            dict(task='seq2seq'),
            {},
            r"task='seq2seq' is not one of \('glue', 'lm', 'mlm', 'nmt'\)",
        ),
        (dict(MULTI30K_NMT, target_lang='en'), {}, r"source_lang and target_lang are both 'en'"),
        (dict(MULTI30K_NMT, target_lang='fr'), {}, r"no feature 'fr'.*features: \['de', 'en'\]"),
        ({}, dict(global_batch_size=10, process_count=3), r'global_batch_size=10.*process_count=3'),
        (
            {},
            dict(split='dev'),
            r"split='dev' is not available.*valid: \['train', 'validation', 'test'\]",
        ),
        (dict(max_length=1), {}, r'config.data: max_length=1 must be an int >= 2'),
        (dict(max_len=32), {}, r"config.data has unknown fields \['max_len'\]"),
        (dict(MULTI30K_NMT, vocab_size=200), {}, r'vocab_size=200 is too small for SentencePiece'),
        (
            dict(MULTI30K_NMT, max_length=3),
            {},
            r'data.max_length=3: none of the first 256 examples',
        ),
    ],
)
def test_invalid_settings_are_named(pipeline, overrides, kwargs, message):
  with pytest.raises(ValueError, match=message):
    pipeline(dict(TINY_LM, **overrides), **kwargs)


def test_a_state_from_another_pipeline_is_refused(pipeline):
  state = pipeline(TINY_LM, seed=1).get_state()
  with pytest.raises(ValueError, match=r'seed: state 1 vs pipeline 2'):
    pipeline(TINY_LM, seed=2).set_state(state)


@pytest.mark.slow
@pytest.mark.parametrize('config', [TINY_LM, PACKED_NMT])
def test_worker_processes_resume_exactly(pipeline, config):
  config = dict(config, num_workers=2)
  original = pipeline(config)
  _take(original, 5)
  state = json.loads(json.dumps(original.get_state()))
  expected = _take(original, 4)
  original.close()
  resumed = pipeline(config)
  resumed.set_state(state)
  _assert_same_batches(expected, _take(resumed, 4))
  resumed.close()


# ------------------------------------------------------------------ packed translation pairs


def _segments(tokens, segment_ids):
  """The token arrays of the segments 1, 2, ... of one row."""
  return [tokens[segment_ids == k] for k in range(1, segment_ids.max() + 1)]


def test_packed_nmt_rows_hold_whole_pairs_with_aligned_segments(pipeline):
  p = pipeline(PACKED_NMT, split='test', global_batch_size=16, seed=1)
  tok = p.tokenizer
  examples = p.data_source.__getitems__(range(len(p.data_source)))
  pairs = collections.Counter((e['en'].decode(), e['de'].decode()) for e in examples)
  seen = collections.Counter()
  batches = _take(p, 5)
  for batch in batches:
    assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {
        k: (s.shape, s.dtype) for k, s in p.element_spec.items()
    }
    np.testing.assert_array_equal(
        batch['weights'], (batch['targets_segment_ids'] > 0).astype(np.float32)
    )
    for side in ('inputs', 'targets'):
      tokens, segments = batch[side], batch[f'{side}_segment_ids']
      positions = batch[f'{side}_positions']
      np.testing.assert_array_equal(tokens != 0, segments > 0)  # padding is segment 0
      assert (positions[segments == 0] == 0).all()
      for row in range(16):
        real = segments[row][segments[row] > 0]
        # Segments 1, 2, ..., n side by side from the start of the row, then padding.
        np.testing.assert_array_equal(segments[row][: len(real)], real)
        assert real[0] == 1 and set(np.diff(real)) <= {0, 1}
        for k in range(1, real.max() + 1):  # positions restart at 0; one EOS, at the end
          where = segments[row] == k
          np.testing.assert_array_equal(positions[row][where], np.arange(where.sum()))
          assert tokens[row][where][-1] == tok.eos_id
          assert (tokens[row][where][:-1] != tok.eos_id).all()
    for row in range(16):
      sources = _segments(batch['inputs'][row], batch['inputs_segment_ids'][row])
      targets = _segments(batch['targets'][row], batch['targets_segment_ids'][row])
      assert len(sources) == len(targets)  # segment k of inputs translates to segment k
      seen.update((tok.decode(s), tok.decode(t)) for s, t in zip(sources, targets))
  # Real pairs of the split, none twice (fewer pairs than one epoch), several per row.
  assert not seen - pairs
  assert seen.total() > 3 * 5 * 16


def _packed_pairs(p, batches):
  """The (source, target) text of every packed pair, row by row, segment by segment."""
  for batch in batches:
    for row in range(len(batch['inputs'])):
      sources = _segments(batch['inputs'][row], batch['inputs_segment_ids'][row])
      targets = _segments(batch['targets'][row], batch['targets_segment_ids'][row])
      assert len(sources) == len(targets)
      yield from ((p.tokenizer.decode(s), p.tokenizer.decode(t)) for s, t in zip(sources, targets))


@pytest.fixture
def small_windows(monkeypatch):
  """Epochs of several packing windows and groups, so that their edges are crossed often."""
  monkeypatch.setattr(packing_lib, 'WINDOW', 300)
  monkeypatch.setattr(packing_lib, 'GROUP', 64)


def test_packed_epochs_hold_every_pair_exactly_once(pipeline, small_windows):
  examples = None
  seen = collections.Counter()
  for process in range(2):
    p = pipeline(
        PACKED_NMT,
        split='test',
        global_batch_size=32,
        seed=5,
        process_index=process,
        process_count=2,
    )
    examples = examples or p.data_source.__getitems__(range(len(p.data_source)))
    shard = [(e['en'].decode(), e['de'].decode()) for e in examples[process::2]]
    # Every pair of the test split fits max_length (64 tokens a side), so none is dropped.
    assert all(len(p.tokenizer.encode(side)) < 64 for pair in shard for side in pair)
    pairs = []
    while len(pairs) < 2 * len(shard):  # rows run on from one epoch into the next
      pairs += _packed_pairs(p, [next(p)])
    first, second = pairs[: len(shard)], pairs[len(shard) : 2 * len(shard)]
    assert collections.Counter(first) == collections.Counter(second) == collections.Counter(shard)
    assert first != second  # reshuffled
    seen.update(first)
  assert seen == collections.Counter((e['en'].decode(), e['de'].decode()) for e in examples)


def test_packed_stream_resumes_exactly_from_every_batch(pipeline, small_windows):
  p = pipeline(PACKED_NMT, split='test', global_batch_size=16, seed=2)
  states, batches = [], []
  for _ in range(24):  # ~17 batches an epoch: crosses windows and the first epoch's end
    states.append(json.loads(json.dumps(p.get_state())))
    batches.append(next(p))
  assert states[-1]['first_fit']['epoch'] == 1
  for step in range(0, 22):
    resumed = pipeline(PACKED_NMT, split='test', global_batch_size=16, seed=2)
    resumed.set_state(states[step])
    _assert_same_batches(batches[step : step + 3], _take(resumed, 3))


def test_a_packed_pipeline_refuses_a_grain_position(pipeline):
  state = dict(pipeline(MULTI30K_NMT, split='test').get_state(), packing=True)
  with pytest.raises(ValueError, match=r"no 'first_fit' position \(it has \['grain'\]\)"):
    pipeline(PACKED_NMT, split='test').set_state(state)


def test_packed_training_encodes_the_split_once_into_the_workdir(pipeline, workdir):
  first = _take(pipeline(PACKED_NMT, split='test', seed=3), 2)
  (cached,) = pathlib.Path(workdir, 'encoded').glob('multi30k_test_nmt_*.npz')
  modified = cached.stat().st_mtime_ns
  _assert_same_batches(first, _take(pipeline(PACKED_NMT, split='test', seed=3), 2))
  assert cached.stat().st_mtime_ns == modified


def test_nmt_evaluation_stays_one_pair_per_row_with_packing_on(pipeline):
  packed = pipeline(PACKED_NMT, split='validation', train=False)
  assert not packed.packed
  assert tuple(packed.element_spec) == ('inputs', 'targets', 'weights')
  _assert_same_batches(
      _take(pipeline(MULTI30K_NMT, split='validation', train=False), 3), _take(packed, 3)
  )


@pytest.mark.parametrize(
    'config, train',
    [
        (TINY_LM, True),
        (TINY_MLM, True),
        (TINY_MLM, False),
        (MULTI30K_NMT, True),
        (PACKED_NMT, True),
        (PACKED_NMT, False),
    ],
)
def test_element_spec_describes_every_batch_before_it_is_read(pipeline, config, train):
  p = pipeline(config, train=train, split='train' if train else 'validation')
  spec = {k: (s.shape, s.dtype) for k, s in p.element_spec.items()}
  for batch in _take(p, 2):
    assert {k: (v.shape, v.dtype) for k, v in batch.items()} == spec


def test_padding_fraction_counts_the_batches_and_leaves_the_position(pipeline):
  padded = pipeline(MULTI30K_NMT, global_batch_size=16)
  first = next(padded)
  fraction = padded.padding_fraction(num_batches=4)
  expected = _take(pipeline(MULTI30K_NMT, global_batch_size=16), 4)
  for key in ('inputs', 'targets'):
    real = sum(np.count_nonzero(b[key]) for b in expected)
    assert fraction[key] == pytest.approx(1 - real / (4 * 16 * 64))
  _assert_same_batches([first, next(padded)], expected[:2])  # its own position is unchanged
  packed = pipeline(PACKED_NMT, global_batch_size=16).padding_fraction(num_batches=4)
  # Multi30k pairs average ~14 tokens per side: padded rows of 64 are ~3/4 padding.
  assert fraction['inputs'] > 0.6 and packed['inputs'] < 0.2 and packed['targets'] < 0.2


# -------------------------------------------------------------------------- local text files


def _write_lines(path, lines):
  text = ''.join(f'{line}\n' for line in lines).encode()
  path.write_bytes(gzip.compress(text) if path.suffix == '.gz' else text)
  return path


def test_text_files_evaluate_exactly_like_the_split_they_hold(pipeline, tmp_path, tfds_dir):
  test = data.load_data_source('multi30k', 'test', tfds_data_dir=tfds_dir)
  examples = test.__getitems__(range(len(test)))
  en = _write_lines(tmp_path / 'flickr.en', [e['en'].decode() for e in examples])
  de = _write_lines(tmp_path / 'flickr.de.gz', [e['de'].decode() for e in examples])
  (split,) = (
      data.DataConfig(**MULTI30K_NMT, extra_test_files=f'{en}:{de}')
      .extra_test_splits(num_files=2)
      .values()
  )
  from_files = pipeline(MULTI30K_NMT, split=split, global_batch_size=64, train=False)
  from_split = pipeline(MULTI30K_NMT, split='test', global_batch_size=64, train=False)
  assert from_files.tokenizer.model_proto == from_split.tokenizer.model_proto  # the run's
  assert from_files.num_batches == from_split.num_batches == 16
  _assert_same_batches(list(from_split), list(from_files))


def test_a_text_file_of_documents_feeds_a_language_model(pipeline, tmp_path):
  lines = ['First Citizen:', 'Before we proceed any further, hear me speak.', '']
  p = pipeline(TINY_LM, split=f'file:{_write_lines(tmp_path / "a.txt", lines)}', train=False)
  batches = list(p)
  assert sum(b['weights'].sum() for b in batches) == sum(len(line) + 1 for line in lines)
  assert p.tokenizer.decode(np.concatenate([b['targets'][0] for b in batches])) == lines[0]


@pytest.mark.parametrize(
    'case, error, message',
    [
        ('missing', FileNotFoundError, r"The 'de' text file '.*missing\.de' does not exist"),
        ('unequal', ValueError, r'equal numbers of lines.*a\.en \(en\) has 3.*a\.de \(de\) has 2'),
        ('empty', ValueError, r"The 'de' text file '.*empty\.de' is empty"),
        ('one_file', ValueError, r"task='nmt' reads text files as 'file:EN:DE'"),
    ],
)
def test_text_file_errors_name_the_files(pipeline, tmp_path, case, error, message):
  en = _write_lines(tmp_path / 'a.en', ['A dog.', 'Two cats.', 'A man.'])
  de = {
      'missing': tmp_path / 'missing.de',
      'unequal': _write_lines(tmp_path / 'a.de', ['Ein Hund.', 'Zwei Katzen.']),
      'empty': _write_lines(tmp_path / 'empty.de', []),
  }.get(case)
  split = f'file:{en}' if de is None else f'file:{en}:{de}'
  with pytest.raises(error, match=message):
    pipeline(MULTI30K_NMT, split=split, train=False)


# ------------------------------------------------------------------------ several processes


def _in_threads(target, indices, name):
  """`target(i)` for each index in a thread of its own named `name(i)`, started in that order;
  returns {index: result} and the exceptions raised."""
  results, errors = {}, []

  def run(i):
    try:
      results[i] = target(i)
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  threads = [threading.Thread(target=run, args=(i,), name=name(i)) for i in indices]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  return results, errors


def test_process_zero_prepares_while_the_others_wait_then_read(tmp_path, monkeypatch):
  """Simulated hosts (threads) on one fresh TFDS directory and workdir."""
  prepared_by, trained_by = [], []
  prepare, train = datasets._prepare, tokenizers.CharTokenizer.train.__func__

  def counting_prepare(*args):
    prepared_by.append(threading.current_thread().name)
    return prepare(*args)

  def counting_train(cls, texts):
    trained_by.append(threading.current_thread().name)
    return train(cls, texts)

  monkeypatch.setattr(datasets, '_prepare', counting_prepare)
  monkeypatch.setattr(tokenizers.CharTokenizer, 'train', classmethod(counting_train))
  config = data.default_data_config(**TINY_LM, tfds_data_dir=str(tmp_path / 'tfds'))
  barrier = threading.Barrier(2, timeout=120)
  make = lambda process_index: tasks.make_pipeline(
      config,
      split='train',
      seed=0,
      global_batch_size=8,
      train=True,
      workdir=tmp_path / 'run',
      process_index=process_index,
      process_count=2,
      barrier=lambda name: barrier.wait(),
  )
  # Process 1 first: it must still wait for process 0.
  pipelines, errors = _in_threads(make, (1, 0), lambda i: f'process {i}')
  assert not errors
  assert prepared_by == ['process 0'] and trained_by == ['process 0']
  assert pipelines[1].tokenizer.chars == pipelines[0].tokenizer.chars


def test_parallel_runs_sharing_a_tfds_dir_prepare_it_once(tmp_path, monkeypatch):
  """A grid's parallel runs (separate single-process runs, here threads) on one fresh TFDS
  directory: without a lock both prepare and collide on TFDS's final rename."""
  prepared_by = []
  prepare = datasets._prepare

  def slow_prepare(*args):
    prepared_by.append(threading.current_thread().name)
    time.sleep(1.0)  # time for the other run to find the directory unprepared too
    return prepare(*args)

  monkeypatch.setattr(datasets, '_prepare', slow_prepare)
  config = data.default_data_config(**TINY_LM, tfds_data_dir=str(tmp_path / 'tfds'))
  make = lambda i: tasks.make_pipeline(
      config, split='train', seed=0, global_batch_size=8, train=True, workdir=tmp_path / f'run{i}'
  )
  pipelines, errors = _in_threads(make, (0, 1), lambda i: f'run {i}')
  assert not errors
  assert len(prepared_by) == 1
  assert len(pipelines[0].data_source) == len(pipelines[1].data_source) > 0


def test_process_zero_reaches_the_barrier_even_when_it_fails():
  barrier = threading.Barrier(2, timeout=30)
  other = {}

  def process_one():
    other['result'] = pipeline_lib.process_zero_first(
        lambda: 'read',
        process_index=1,
        process_count=2,
        barrier=lambda name: barrier.wait(),
        name='x',
    )

  thread = threading.Thread(target=process_one)
  thread.start()

  def fail():
    raise FileNotFoundError('no data')

  with pytest.raises(FileNotFoundError, match='no data'):
    pipeline_lib.process_zero_first(
        fail, process_index=0, process_count=2, barrier=lambda name: barrier.wait(), name='x'
    )
  thread.join()
  assert other == {'result': 'read'}  # it went on (and meets its own error, if any)


@pytest.mark.slow
def test_two_jax_processes_prepare_once(tmp_path):
  """Real processes with jax.distributed: the default barrier is JAX's."""
  with socket.socket() as s:
    s.bind(('localhost', 0))
    port = str(s.getsockname()[1])
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  processes = [
      subprocess.Popen(
          [sys.executable, str(PREPARE_WORKER), str(i), port, str(tmp_path)],
          env=env,
          stdout=subprocess.PIPE,
          stderr=subprocess.STDOUT,
          text=True,
      )
      for i in range(2)
  ]
  outputs = [p.communicate(timeout=300)[0] for p in processes]
  for p, out in zip(processes, outputs):
    assert p.returncode == 0, out
  assert 'PREPARED' in outputs[0] and 'TRAINED' in outputs[0], outputs[0]
  assert 'PREPARED' not in outputs[1] and 'TRAINED' not in outputs[1], outputs[1]
  vocab = [re.search(r'VOCAB (\d+)', out).group(1) for out in outputs]
  assert vocab[0] == vocab[1]
