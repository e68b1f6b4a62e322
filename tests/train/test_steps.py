"""The loss and the training step's randomness: hand-computed cross entropy, dropout keys."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_attn import train
from lowrank_attn.train import cross_entropy

# Two tokens, vocabulary 3. Logits log(1, 2, 5) and log(6, 1, 1): probabilities (1, 2, 5) / 8
# and (6, 1, 1) / 8. Token 0's target 1 is not the argmax (2); token 1's target 0 is.
LOGITS = np.log(np.array([[[1.0, 2.0, 5.0], [6.0, 1.0, 1.0]]], np.float32))
TARGETS = np.array([[1, 0]], np.int32)
WEIGHTS = np.array([[0.5, 2.0]], np.float32)


def test_cross_entropy_by_hand():
  sums = cross_entropy(LOGITS, TARGETS, WEIGHTS)
  # -log p(target): log(8/2) and log(8/6), weighted 0.5 and 2.
  nll = 0.5 * math.log(4) + 2.0 * math.log(4 / 3)  # = 1.2685113
  np.testing.assert_allclose(sums['nll'], nll, rtol=1e-6)
  np.testing.assert_allclose(sums['objective'], nll, rtol=1e-6)  # no smoothing
  # Only token 1 is right: correct = its weight, 2 (not 1, the unweighted count).
  np.testing.assert_allclose(sums['correct'], 2.0, rtol=1e-6)
  np.testing.assert_allclose(sums['weight'], 2.5, rtol=1e-6)
  np.testing.assert_allclose(sums['correct'] / sums['weight'], 0.8, rtol=1e-6)


def test_label_smoothing_by_hand():
  """Szegedy et al. (2016): (1 - e) (-log p_target) + e mean_v(-log p_v), here e = 0.1."""
  sums = cross_entropy(LOGITS, TARGETS, WEIGHTS, label_smoothing=0.1)
  token0 = 0.9 * math.log(4) + 0.1 * (math.log(8) + math.log(4) + math.log(8 / 5)) / 3
  token1 = 0.9 * math.log(4 / 3) + 0.1 * (math.log(8 / 6) + math.log(8) + math.log(8)) / 3
  objective = 0.5 * token0 + 2.0 * token1  # = 1.3825139
  np.testing.assert_allclose(sums['objective'], objective, rtol=1e-6)
  # The reported nll stays the plain one (perplexity is never smoothed).
  np.testing.assert_allclose(sums['nll'], 0.5 * math.log(4) + 2.0 * math.log(4 / 3), rtol=1e-6)
  np.testing.assert_allclose(sums['correct'], 2.0, rtol=1e-6)


def test_zero_weight_tokens_count_for_nothing():
  weights = np.array([[0.0, 1.0]], np.float32)
  sums = cross_entropy(LOGITS, TARGETS, weights, label_smoothing=0.1)
  alone = cross_entropy(LOGITS[:, 1:], TARGETS[:, 1:], weights[:, 1:], label_smoothing=0.1)
  for name in ('nll', 'objective', 'correct', 'weight'):
    np.testing.assert_allclose(sums[name], alone[name], rtol=1e-6)


# ------------------------------------------------------------------ the dropout key of a step


@pytest.fixture(scope='module')
def step_losses(helpers):
  """`losses(dropout, step, key)`: loss and gradient norm of one train step of a tiny LM.

  The state comes from the library's own setup; only its `step` entry is changed between calls.
  """
  cache = {}

  def losses(dropout_rate, step, seed=0):
    if dropout_rate not in cache:
      config = helpers.override(
          helpers.load_config('lm', 'tiny'),
          {**helpers.small_model, 'model.dropout_rate': dropout_rate},
      )
      config.mesh.data = 1
      s = train.setup(config, vocab_size=64, bos_id=1, devices=jax.devices()[:1])
      state = train.create_state(s)
      fn = jax.jit(
          functools.partial(train.train_step, options=s.options, tx=s.tx, schedule=s.schedule)
      )
      cache[dropout_rate] = (state, fn)
    state, fn = cache[dropout_rate]
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 64, (4, 17)).astype(np.int32)
    batch = {
        'inputs': tokens[:, :-1],
        'targets': tokens[:, 1:],
        'weights': np.ones((4, 16), np.float32),
        'segment_ids': np.ones((4, 16), np.int32),
        'positions': np.broadcast_to(np.arange(16, dtype=np.int32), (4, 16)),
    }
    at_step = {**state, 'step': jnp.asarray(step, state['step'].dtype)}
    _, metrics = fn(at_step, batch, jax.random.key(seed))
    return float(metrics['loss']), float(metrics['grad_norm'])

  return losses


def test_each_step_draws_a_new_dropout_mask(step_losses):
  """Same parameters, batch and key, steps 0 and 1: the key is folded with the step."""
  assert step_losses(0.3, step=0) != step_losses(0.3, step=1)
  assert step_losses(0.3, step=0) != step_losses(0.3, step=0, seed=1)


def test_without_dropout_the_step_number_changes_nothing(step_losses):
  assert step_losses(0.0, step=0) == step_losses(0.0, step=1)


# ------------------------------------------------------- the loss normalisation with padding


def test_padded_batches_are_normalised_by_their_real_tokens(helpers):
  """Loss and gradient of a step on a batch with padding (zero-weight tokens, a row of
  padding only) against the hand-normalised loss sum_i w_i (-log p_i) / sum_i w_i, with and
  without gradient accumulation (micro-batches of different weights)."""
  import dataclasses
  from flax import nnx

  config = helpers.override(
      helpers.load_config('lm', 'tiny'),
      {
          **helpers.small_model,
          'model.dropout_rate': 0.0,
          'model.num_decoder_layers': 1,
          'model.emb_dim': 16,
          'model.mlp_dim': 16,
      },
  )  # one layer compiles 3 steps quickly
  config.mesh.data = 1
  s = train.setup(config, vocab_size=64, bos_id=1, devices=jax.devices()[:1])
  state = train.create_state(s)
  rng = np.random.default_rng(1)
  tokens = rng.integers(1, 64, (4, 17)).astype(np.int32)
  lengths = np.array([16, 9, 3, 0])  # row 3 is all padding
  real = np.arange(16)[None, :] < lengths[:, None]
  batch = {
      'inputs': tokens[:, :-1] * real,
      'targets': tokens[:, 1:] * real,
      'weights': real.astype(np.float32),
      'segment_ids': real.astype(np.int32),
      'positions': np.where(real, np.arange(16), 0).astype(np.int32),
  }

  def hand_loss(params):
    model = nnx.merge(s.options.graphdef, params)
    logits, _ = model(
        jnp.asarray(batch['inputs']),
        positions=jnp.asarray(batch['positions']),
        segment_ids=jnp.asarray(batch['segment_ids']),
        deterministic=True,
    )
    log_p = jax.nn.log_softmax(logits.astype(jnp.float32))
    nll = -jnp.take_along_axis(log_p, jnp.asarray(batch['targets'])[..., None], -1)[..., 0]
    return jnp.sum(nll * batch['weights']) / np.sum(batch['weights'])

  want_loss, want_grads = jax.value_and_grad(hand_loss)(state['params'])
  want_norm = float(
      np.sqrt(
          sum(np.sum(np.square(np.asarray(g, np.float64))) for g in jax.tree.leaves(want_grads))
      )
  )
  for k in (1, 2):  # k = 2: rows 0, 2 (19 tokens) and rows 1, 3 (9 tokens)
    options = dataclasses.replace(s.options, grad_accum_steps=k)
    fn = jax.jit(functools.partial(train.train_step, options=options, tx=s.tx, schedule=s.schedule))
    _, metrics = fn(state, batch, jax.random.key(0))
    # float32 sums over 28 tokens of a 64-way softmax: a few ulp of the loss.
    np.testing.assert_allclose(metrics['loss'], want_loss, rtol=1e-5, err_msg=f'k={k}')
    np.testing.assert_allclose(metrics['grad_norm'], want_norm, rtol=1e-4, err_msg=f'k={k}')
    assert int(metrics['tokens']) == lengths.sum()


def test_row_sums_score_each_row_alone(helpers):
  """`row_sums`: each row's sum_i w_i (-log p_i) and sum_i w_i, by hand from the model's logits
  (float64 log-softmax), a row of padding only scoring 0 over 0 tokens; over the rows they add up
  to `eval_step`'s sums."""
  from flax import nnx

  config = helpers.override(
      helpers.load_config('lm', 'tiny'),
      {
          **helpers.small_model,
          'model.num_decoder_layers': 1,
          'model.emb_dim': 16,
          'model.mlp_dim': 16,
      },
  )
  config.mesh.data = 1
  s = train.setup(config, vocab_size=64, bos_id=1, devices=jax.devices()[:1])
  params = train.create_state(s)['params']
  rng = np.random.default_rng(2)
  tokens = rng.integers(1, 64, (4, 17)).astype(np.int32)
  lengths = np.array([16, 9, 0, 3])
  real = np.arange(16)[None, :] < lengths[:, None]
  batch = {
      'inputs': tokens[:, :-1] * real,
      'targets': tokens[:, 1:] * real,
      'weights': real.astype(np.float32) * rng.uniform(0.5, 2.0, (4, 16)).astype(np.float32),
      'segment_ids': real.astype(np.int32),
      'positions': np.where(real, np.arange(16), 0).astype(np.int32),
  }
  rows = jax.jit(functools.partial(train.steps.row_sums, options=s.options))(params, batch)
  sums = jax.jit(functools.partial(train.eval_step, options=s.options))(params, batch)

  logits, _ = nnx.merge(s.options.graphdef, params)(
      jnp.asarray(batch['inputs']),
      positions=jnp.asarray(batch['positions']),
      segment_ids=jnp.asarray(batch['segment_ids']),
      deterministic=True,
  )
  shifted = np.asarray(logits, np.float64) - np.max(logits, -1, keepdims=True)
  log_p = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  nll = -np.take_along_axis(log_p, batch['targets'][..., None], -1)[..., 0]
  want = (nll * batch['weights']).sum(1)
  assert rows['nll'].shape == rows['weight'].shape == (4,)
  # float32 logits and sums over <= 16 tokens of a 64-way softmax: a few ulp of each row's sum.
  np.testing.assert_allclose(rows['nll'], want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(rows['weight'], batch['weights'].sum(1), rtol=1e-6)
  assert rows['nll'][2] == rows['weight'][2] == 0
  np.testing.assert_allclose(np.sum(rows['nll']), sums['nll'], rtol=1e-5)
  np.testing.assert_allclose(np.sum(rows['weight']), sums['weight'], rtol=1e-6)
