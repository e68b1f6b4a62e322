"""A trained run pruned into a new run directory: it computes what the masked source computes,
and the training command line trains it (warm start) and checkpoints it."""

import json
import pathlib

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_attn import pruning, train
from lowrank_attn.runs import RunDir, with_overrides
from lowrank_attn.train import config as config_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
KEEP = {
    'encoder': np.array([[1, 0, 1, 1], [0, 0, 0, 0]], bool),
    'cross': np.array([[1, 1, 1, 1], [0, 1, 0, 0]], bool),
}


def tiny_config(steps: int):
  config = config_lib.load(f'{ROOT}/configs/nmt.py:tiny')
  config.num_train_steps = steps
  config.checkpoint_every_steps = 1
  config.num_eval_steps = 1
  config.decode.num_examples = 0
  config.peak_flops_per_device = 1e11  # no matmul measurement
  return config


@pytest.mark.slow
def test_pruned_run_equals_masked_source_and_trains(tmp_path):
  source, pruned_dir, tuned = (str(tmp_path / name) for name in ('source', 'pruned', 'tuned'))
  train.train_and_evaluate(tiny_config(2), source)

  overrides = pruning.prune_run(source, KEEP, pruned_dir)
  assert overrides['model.encoder_attention.num_heads'] == (3, 0)
  assert json.loads((tmp_path / 'pruned' / 'pruning.json').read_text())['keep']['cross'] == [
      [1, 1, 1, 1],
      [0, 1, 0, 0],
  ]
  original, pruned = RunDir(source).model(), RunDir(pruned_dir).model()
  rng = np.random.default_rng(0)
  inputs = jnp.asarray(rng.integers(5, 100, (2, 9)), jnp.int32)
  targets = jnp.asarray(rng.integers(5, 100, (2, 7)), jnp.int32)
  masks = {t: jnp.asarray(k, jnp.float32) for t, k in KEEP.items()}
  np.testing.assert_allclose(
      nnx.jit(lambda m: m(inputs, targets)[0])(pruned),
      original(inputs, targets, head_masks=masks)[0],
      atol=1e-5,
  )

  # The normal training path: the source's config plus the returned overrides. (Each
  # translation run ends by translating its validation and test splits: one run only.)
  config = with_overrides(tiny_config(2), overrides)
  result = train.train_and_evaluate(config, tuned)
  assert result['step'] == 2 and np.isfinite(result['train']['loss'])
  restored = RunDir(tuned)  # the pruned model's own checkpoint, restored
  assert restored.latest_step() == 2
  assert pruning.head_counts(restored.model()) == {
      'encoder': (3, 0),
      'decoder': (4, 4),
      'cross': (4, 1),
  }
  trained = nnx.jit(lambda m: m(inputs, targets)[0])(restored.model())
  assert np.isfinite(trained).all()
  assert not np.allclose(trained, nnx.jit(lambda m: m(inputs, targets)[0])(pruned))


def test_gate_run_with_every_gate_closed_prunes_to_a_buildable_run(tmp_path):
  # A gate fine-tune trains only 'gate_log_alpha'; when every gate closes, the pruned model has
  # no gate left and the pruned run must not keep a `trainable` pattern that matches nothing.
  config = tiny_config(1)
  config.model.encoder_attention.gated = True
  config.trainable = 'gate_log_alpha'
  config.decode.beam_size = 1
  source, pruned_dir = str(tmp_path / 'source'), str(tmp_path / 'pruned')
  train.train_and_evaluate(config, source, devices=jax.devices()[:1])  # (not about meshes)

  no_encoder = {'encoder': np.zeros((2, 4), bool)}
  overrides = pruning.prune_run(source, no_encoder, pruned_dir)
  assert overrides['trainable'] is None
  written = json.loads((tmp_path / 'pruned' / 'config.json').read_text())
  assert written['trainable'] is None
  rebuilt = config_lib.from_dict(written)  # what evaluation and fine-tuning build from
  train.state.setup(rebuilt, vocab_size=RunDir(pruned_dir).tokenizer.vocab_size, bos_id=1)
  assert pruning.head_counts(RunDir(pruned_dir).model())['encoder'] == (0, 0)
