"""grain pipelines on real data: batch contract, determinism, exact resume, eval passes."""

import collections
import json
import os

import numpy as np
import pytest

from lowrank_attn import data

pytestmark = pytest.mark.filterwarnings("ignore::lowrank_attn.data.MissingSplitWarning")

TINY_LM = dict(name="tiny_shakespeare", task="lm", tokenizer="char", max_length=64)
TINY_MLM = dict(name="tiny_shakespeare", task="mlm", tokenizer="char", max_length=128)
MULTI30K_NMT = dict(name="multi30k", task="nmt", tokenizer="sentencepiece", vocab_size=8000,
                    max_length=64, packing=False)
UD_MLM = dict(name="ud_english_ewt", task="mlm", tokenizer="wordpiece", max_length=64)


def _take(pipeline, n):
  return [next(pipeline) for _ in range(n)]


def _assert_same_batches(expected, actual):
  assert len(expected) == len(actual)
  for a, b in zip(expected, actual):
    assert a.keys() == b.keys()
    for key in a:
      np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def _real_rows(batches, key="inputs"):
  """Rows of real examples (weights not all zero), in order."""
  return [row for b in batches for row, w in zip(b[key], b["weights"]) if w.any()]


@pytest.fixture
def pipeline(make_config, workdir):
  def make(config, *, split="train", seed=0, global_batch_size=8, train=True, **kwargs):
    return data.make_pipeline(make_config(**config), split=split, seed=seed, train=train,
                              global_batch_size=global_batch_size, workdir=workdir, **kwargs)
  return make


def test_lm_batches_follow_the_contract(pipeline, tfds_dir):
  p = pipeline(TINY_LM)
  assert p.task == "lm" and p.tokenizer.pad_id == 0
  batch = next(p)
  assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {
      k: (s.shape, s.dtype) for k, s in p.element_spec.items()}
  assert batch["inputs"].shape == (8, 64)
  inputs, targets = batch["inputs"], batch["targets"]
  segments, positions = batch["segment_ids"], batch["positions"]
  np.testing.assert_array_equal(batch["weights"], (segments > 0).astype(np.float32))
  # Within a segment the target is the next input token; positions count up from 0.
  same = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)
  np.testing.assert_array_equal(targets[:, :-1][same], inputs[:, 1:][same])
  np.testing.assert_array_equal(positions[:, 1:][same], positions[:, :-1][same] + 1)
  assert (positions[:, 1:][~same & (segments[:, 1:] > 0)] == 0).all()
  # A segment that starts a document is bos + paragraph; its targets are paragraph + eos.
  train_text = "\n\n".join(
      e["text"].decode() for e in data.load_data_source(
          "tiny_shakespeare", "train", tfds_data_dir=tfds_dir).__getitems__(range(6283)))
  for row in range(8):
    for segment in np.unique(segments[row][segments[row] > 0]):
      where = segments[row] == segment
      text = p.tokenizer.decode(targets[row][where])
      assert text in train_text
      if inputs[row][where][0] == p.tokenizer.bos_id and p.tokenizer.eos_id in targets[row][where]:
        assert f"\n\n{text}\n\n" in f"\n\n{train_text}\n\n"  # a whole paragraph


def test_same_seed_gives_the_same_batches_and_another_seed_others(pipeline):
  first = _take(pipeline(TINY_LM, seed=3), 4)
  _assert_same_batches(first, _take(pipeline(TINY_LM, seed=3), 4))
  other = _take(pipeline(TINY_LM, seed=4), 4)
  assert not np.array_equal(first[0]["inputs"], other[0]["inputs"])


@pytest.mark.parametrize("config, split", [
    (TINY_LM, "train"),
    (dict(TINY_LM, packing=False), "train"),
    (TINY_MLM, "train"),
    (MULTI30K_NMT, "train"),
    (UD_MLM, "validation"),
])
@pytest.mark.parametrize("steps_before", [0, 7])
def test_restored_state_continues_with_exactly_the_next_batches(pipeline, config, split,
                                                                 steps_before):
  original = pipeline(config, split=split)
  _take(original, steps_before)
  state = json.loads(json.dumps(original.get_state()))  # saved as JSON with the checkpoint
  expected = _take(original, 6)
  resumed = pipeline(config, split=split)
  resumed.set_state(state)
  _assert_same_batches(expected, _take(resumed, 6))


def test_each_epoch_is_a_new_permutation_of_every_example(pipeline):
  p = pipeline(MULTI30K_NMT, split="test", global_batch_size=100, seed=1)
  sources = sorted(e["en"].decode() for e in p.data_source.__getitems__(range(1000)))
  epochs = []
  for _ in range(2):
    rows = [p.tokenizer.decode(r) for b in _take(p, 10) for r in b["inputs"]]
    assert sorted(rows) == sources
    epochs.append(rows)
  assert epochs[0] != epochs[1]


def test_eval_pass_yields_every_example_once_and_pads_the_last_batch(pipeline):
  p = pipeline(MULTI30K_NMT, split="validation", global_batch_size=64, train=False)
  batches = list(p)
  assert len(batches) == p.num_batches == 16  # 1,014 = 15 * 64 + 54
  last = batches[-1]
  assert last["weights"][:54].any(axis=1).all() and not last["weights"][54:].any()
  assert not last["inputs"][54:].any() and not last["targets"][54:].any()
  examples = p.data_source.__getitems__(range(1014))
  assert [p.tokenizer.decode(r) for r in _real_rows(batches)] == [
      e["en"].decode() for e in examples]
  assert [p.tokenizer.decode(r) for r in _real_rows(batches, "targets")] == [
      e["de"].decode() for e in examples]
  for b in batches:  # weights: 1 on target tokens including EOS, 0 on padding
    np.testing.assert_array_equal(b["weights"], (b["targets"] != 0).astype(np.float32))
  _assert_same_batches(batches, list(p))  # the next `for` loop is a new, identical pass


def test_packed_eval_pass_counts_every_token_once(pipeline, tfds_dir):
  p = pipeline(dict(TINY_LM, max_length=128), split="validation", global_batch_size=16,
               train=False)
  batches = list(p)
  assert len(batches) == p.num_batches
  paragraphs = [e["text"].decode() for e in p.data_source.__getitems__(range(440))]
  assert sum(b["weights"].sum() for b in batches) == sum(len(t) + 1 for t in paragraphs)
  starts = [b["targets"][b["segment_ids"] > 0] for b in batches]
  assert p.tokenizer.decode(np.concatenate(starts)) == paragraphs[0]  # up to the first eos


def test_processes_read_disjoint_shards_and_eval_passes_have_equal_length(pipeline):
  index_of = collections.defaultdict(set)
  nmt = pipeline(MULTI30K_NMT, split="validation", train=False)
  for i, e in enumerate(nmt.data_source.__getitems__(range(1014))):
    index_of[e["en"].decode()].add(i)
  seen = collections.Counter()
  for process in range(3):
    p = pipeline(MULTI30K_NMT, split="validation", global_batch_size=48, train=False,
                 process_index=process, process_count=3)
    batches = list(p)
    assert len(batches) == p.num_batches == 22  # ceil(338 / 16): the same on every process
    assert all(b["inputs"].shape == (16, 64) for b in batches)
    for row in _real_rows(batches):
      sentence = p.tokenizer.decode(row)
      assert any(i % 3 == process for i in index_of[sentence])
      seen[sentence] += 1
  assert sum(seen.values()) == 1014 and all(
      seen[s] == len(indices) for s, indices in index_of.items())
  # Training shards are disjoint too (and shuffled within each process).
  train_rows = [
      {p.tokenizer.decode(r) for b in _take(p, 5) for r in b["inputs"]}
      for p in (pipeline(MULTI30K_NMT, split="test", global_batch_size=64, process_index=i,
                         process_count=2) for i in range(2))]
  assert not train_rows[0] & train_rows[1]


def test_mlm_corrupts_15_percent_of_tokens_the_bert_way(pipeline):
  p = pipeline(TINY_MLM, global_batch_size=16)
  batches = _take(p, 8)
  tok = p.tokenizer
  inputs, targets, weights, segments = (
      np.stack([b[k] for b in batches]) for k in ("inputs", "targets", "weights", "segment_ids"))
  eligible = (segments > 0) & (targets != tok.bos_id) & (targets != tok.eos_id)
  chosen = weights > 0
  assert not (chosen & ~eligible).any()
  assert abs(chosen.sum() / eligible.sum() - 0.15) < 0.015
  np.testing.assert_array_equal(inputs[~chosen], targets[~chosen])
  masked = (inputs == tok.mask_id)[chosen].mean()
  unchanged = (inputs == targets)[chosen].mean()
  assert abs(masked - 0.8) < 0.04 and abs(unchanged - 0.1) < 0.03  # random: the other ~10%
  # The corruption is a function of (seed, step): a resumed run masks identically.
  _assert_same_batches(batches, _take(pipeline(TINY_MLM, global_batch_size=16), 8))


def test_sentencepiece_vocabulary_is_cached_in_the_workdir_and_reused(pipeline, workdir):
  first = pipeline(MULTI30K_NMT)
  cached = os.path.join(workdir, "tokenizers", "multi30k_en+de_spm_unigram8000.model")
  assert os.path.isfile(cached)
  modified = os.stat(cached).st_mtime_ns
  second = pipeline(MULTI30K_NMT, split="validation", train=False)
  assert os.stat(cached).st_mtime_ns == modified
  assert second.tokenizer.model_proto == first.tokenizer.model_proto


@pytest.mark.parametrize("overrides, kwargs, message", [
    (dict(task="seq2seq"), {}, r"data.task='seq2seq'; valid: \('lm', 'mlm', 'nmt'\)"),
    (dict(MULTI30K_NMT, packing=True), {}, r"data.packing=True with data.task='nmt'"),
    (dict(MULTI30K_NMT, target_lang="fr"), {}, r"no feature 'fr'.*features: \['de', 'en'\]"),
    ({}, dict(global_batch_size=10, process_count=3), r"global_batch_size=10.*process_count=3"),
    ({}, dict(split="dev"),
     r"split='dev' is not available.*valid: \['train', 'validation', 'test'\]"),
    (dict(max_length=1), {}, r"data.max_length=1"),
    (dict(MULTI30K_NMT, max_length=3), {}, r"data.max_length=3: none of the first 256 pairs"),
])
def test_invalid_settings_are_named(pipeline, overrides, kwargs, message):
  with pytest.raises(ValueError, match=message):
    pipeline(dict(TINY_LM, **overrides), **kwargs)


def test_a_state_from_another_pipeline_is_refused(pipeline):
  state = pipeline(TINY_LM, seed=1).get_state()
  with pytest.raises(ValueError, match=r"seed: state 1 vs pipeline 2"):
    pipeline(TINY_LM, seed=2).set_state(state)


def test_unknown_config_fields_are_reported(pipeline, make_config, workdir):
  config = make_config(**TINY_LM)
  config.unlock()
  config.max_len = 32
  with pytest.warns(UserWarning, match=r"ignores data config fields \['max_len'\]"):
    data.make_pipeline(config, split="train", seed=0, global_batch_size=8, train=True,
                       workdir=workdir)


@pytest.mark.slow
def test_worker_processes_resume_exactly(pipeline):
  config = dict(TINY_LM, num_workers=2)
  original = pipeline(config)
  _take(original, 5)
  state = json.loads(json.dumps(original.get_state()))
  expected = _take(original, 4)
  original.close()
  resumed = pipeline(config)
  resumed.set_state(state)
  _assert_same_batches(expected, _take(resumed, 4))
  resumed.close()
