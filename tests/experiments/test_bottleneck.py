"""experiments/bottleneck: the sweep's grid and parameter matching, the expressivity inputs."""

import importlib.util
import math
import pathlib

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.bottleneck import expressivity, sweep
from lowrank_attn import models
from lowrank_attn.attention import AttentionSpec

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


def bottleneck_config(overrides):
  spec = importlib.util.spec_from_file_location('lm_config', REPO_ROOT / 'configs' / 'lm.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config('bottleneck')
  for key, value in overrides.items():
    *path, field = key.split('.')
    section = config
    for part in path:
      section = section[part]
    section[field] = value
  return config


def test_grid_has_every_point_once():
  runs = sweep.grid(REPO_ROOT / 'runs' / 'unused')
  names = [run.name for run in runs]
  assert len(names) == len(set(names)) == 38
  by_point = {(v.name, h, s): name for v, h, s, name, _ in sweep.points()}
  # fixed_head with d_p = D/h is concat's model (both are their formula there:
  # tests/attention/test_fixed_head.py, test_reference.py): the same run.
  assert by_point['fixed_64', 4, 0] == by_point['concat', 4, 0] == 'concat-h4-s0'
  assert by_point['fixed_128', 2, 1] == 'concat-h2-s1'
  assert by_point['fixed_128', 32, 1] == 'fixed_128-h32-s1'
  # The parameter-matched variant exists only where the MLP can absorb the attention's growth.
  assert sorted({h for v, h, *_ in sweep.points() if v.name == 'fixed_64_pm'}) == [1, 2, 4, 8]
  for run in runs:
    assert '--config=configs/lm.py:bottleneck' in run.command
    assert sum(arg.startswith('--config.seed=') for arg in run.command) == 1


@pytest.mark.parametrize('heads', [1, 2, 8])
def test_parameter_matched_variant_has_concats_parameter_count(heads):
  """Counted on the real models (nnx.eval_shape), not with the formula that sized the MLP."""
  variant = next(v for v in sweep.VARIANTS if v.parameter_matched)
  matched = sweep.model_size(bottleneck_config(variant.overrides(heads)), vocab_size=70)
  concat = sweep.model_size(bottleneck_config({sweep.NUM_HEADS: heads}), vocab_size=70)
  unmatched = sweep.model_size(
      bottleneck_config({sweep.NUM_HEADS: heads, sweep.KIND: 'fixed_head', sweep.HEAD_DIM: 64}),
      vocab_size=70,
  )
  layers = 2
  rounding = layers * (2 * sweep.EMB_DIM + 1) / 2  # the MLP width is an integer
  assert abs(matched['params'] - concat['params']) <= rounding
  if heads != 4:
    assert abs(unmatched['params'] - concat['params']) > 10 * rounding


def test_model_size_counts_flops_per_token():
  size = sweep.model_size(bottleneck_config({sweep.NUM_HEADS: 8}), vocab_size=70)
  n, d_model, mlp, layers = 128, 256, 1024, 2
  # 3 x forward: Q, K, V, O projections + logits + weighted sum + MLP, per token, + output.
  per_layer = 2 * 4 * d_model * d_model + 2 * 2 * n * d_model + 2 * 2 * d_model * mlp
  want = 3 * (layers * per_layer + 2 * d_model * 70)
  assert math.isclose(size['train_flops_per_token'], want, rel_tol=1e-6)
  assert size['train_flops'] == pytest.approx(want * 250 * 16 * 128)


def test_attention_inputs_are_what_the_heads_see():
  """The captured X reproduces every head's logits through the layer's own kernels."""
  cfg = models.TransformerConfig(
      vocab_size=20,
      emb_dim=32,
      mlp_dim=64,
      num_decoder_layers=2,
      decoder_attention=AttentionSpec(num_heads=4),
      max_length=16,
      dropout_rate=0.0,
  )
  model = models.DecoderLM(cfg, rngs=nnx.Rngs(1))
  tokens = jax.random.randint(jax.random.key(0), (3, 16), 5, 20)
  inputs, logits, weights = expressivity.attention_inputs(model, tokens)
  assert len(inputs) == len(logits) == 2
  for layer in range(2):
    np.testing.assert_allclose(
        expressivity.recomputed_logits(model, layer, inputs[layer]),
        logits[layer],
        rtol=1e-4,
        atol=1e-4,
    )
    np.testing.assert_allclose(weights[layer].sum(-1), 1.0, rtol=1e-5)
    assert float(jnp.abs(jnp.triu(weights[layer], 1)).max()) == 0.0  # causal
  # Layer 1's input is not layer 0's: the capture runs the layers in between.
  assert float(jnp.abs(inputs[1] - inputs[0]).max()) > 1e-2


@pytest.mark.slow
def test_fits_and_ranks_end_to_end_on_a_small_model(monkeypatch):
  """The script's wiring at n = 4: every problem kind, both starts, ranks <= d."""
  monkeypatch.setattr(expressivity, 'head_dims', lambda n: [1, n])  # fewer compilations
  cfg = models.TransformerConfig(
      vocab_size=20,
      emb_dim=expressivity.RANDOM_DIM,
      mlp_dim=16,
      num_decoder_layers=2,
      positions='sinusoidal',
      max_length=8,
      decoder_attention=AttentionSpec(num_heads=64),
      dropout_rate=0.0,
  )
  model = models.DecoderLM(cfg, rngs=nnx.Rngs(2))  # heads of d = 4
  windows = np.asarray(jax.random.randint(jax.random.key(3), (2, 8), 5, 20))
  rows = expressivity.run_fits(
      model, windows, seeds=1, steps=200, lengths=[4], rng=np.random.default_rng(0)
  )
  assert len(rows) == 3 * 2
  for row in rows:
    assert row['fitted_rank'] <= row['d']
    assert row['kl'] == min(row['kl_random'], row['kl_svd']) > -1e-5
    if row['d'] >= 4 and row['input_rank'] == 4:  # Theorem 1: exact at d >= n
      assert row['kl'] < 1e-4, row
  assert {row['problem'] for row in rows} == set(expressivity.PROBLEMS)
  ranks = expressivity.trained_ranks(model, windows)
  assert [r['numerical_rank_max'] for r in ranks] == [4, 4]  # a head of d = 4, n = 8


def test_sharp_targets_put_most_mass_on_a_permutation():
  p = expressivity.sharp_targets(np.random.default_rng(0), 64, 4)
  np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-5)
  assert 0.7 < float(p.max(-1).mean()) < 0.9
  for target in p:
    assert len(set(target.argmax(-1))) >= 60  # nearly every row peaks on its own column


def test_head_dims_reach_past_n():
  assert expressivity.head_dims(16) == [1, 2, 4, 8, 12, 16, 32]
  assert expressivity.head_dims(128) == [1, 2, 4, 16, 32, 64, 96, 128, 256]


@pytest.mark.slow
def test_sweep_smallest_points_run_end_to_end(tmp_path, monkeypatch):
  """`sweep.py --smoke`: concat and fixed_head at h = 1, through the runner and the CLI."""
  monkeypatch.setenv('XLA_FLAGS', '')  # the runs' own processes: one CPU device
  results = sweep.main(['--smoke', f'--runs_dir={tmp_path}'])
  assert not results['failed'] and not results['unfinished']
  rows = {row['run']: row for row in sweep.rows(results)}
  assert set(rows) == {'concat-h1-s0', 'fixed_64-h1-s0'}
  for row in rows.values():
    assert 0 < row['bits_per_char'] < 8  # log2 of the vocabulary bounds an untrained model
  # One head of d_p = 64 instead of d = 256: a quarter of the attention parameters.
  concat, fixed = rows['concat-h1-s0'], rows['fixed_64-h1-s0']
  assert fixed['attention_params'] < concat['attention_params'] / 3
  assert fixed['train_flops'] < concat['train_flops']
  assert (tmp_path / 'smoke' / 'results.json').exists()
