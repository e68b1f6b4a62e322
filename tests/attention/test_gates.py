"""Hard-concrete gate statistics against Monte-Carlo estimates and exact quadrature."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_attn.attention import HardConcrete

LOG_ALPHAS = jnp.array([-3.0, -1.0, 0.0, 1.0, 2.5])


@pytest.mark.parametrize('gate', [HardConcrete(), HardConcrete(temperature=2 / 3)])
def test_expected_l0_and_sample_mean_agree_with_monte_carlo(gate):
  draws = jax.vmap(lambda rng: gate.sample(rng, LOG_ALPHAS))(
      jax.random.split(jax.random.key(0), 200_000))
  # P(g != 0): closed form (Louizos eq. 12) vs the fraction of non-zero draws.
  np.testing.assert_allclose((draws > 0).mean(0), gate.prob_open(LOG_ALPHAS), atol=4e-3)
  np.testing.assert_allclose(gate.expected_l0(LOG_ALPHAS), (draws > 0).mean(0).sum(), atol=1e-2)
  # E[g]: the sample mean vs the integral over u ~ U(0, 1) by the midpoint rule.
  u = (np.arange(1_000_000) + 0.5) / 1_000_000
  logistic = np.log(u) - np.log1p(-u)
  low, high = gate.stretch
  for i, log_alpha in enumerate(np.asarray(LOG_ALPHAS)):
    s = 1 / (1 + np.exp(-(logistic + log_alpha) / gate.temperature))
    expected_gate = np.clip(s * (high - low) + low, 0, 1).mean()
    assert abs(float(draws[:, i].mean()) - expected_gate) < 4e-3


def test_samples_lie_in_the_unit_interval_with_mass_at_both_ends():
  draws = jax.vmap(lambda rng: HardConcrete().sample(rng, jnp.zeros(3)))(
      jax.random.split(jax.random.key(1), 20_000))
  assert draws.min() == 0.0 and draws.max() == 1.0
  assert 0.1 < (draws == 0).mean() < 0.9 and 0.1 < (draws == 1).mean() < 0.9


def test_eval_gates_are_deterministic_and_in_unit_interval():
  gate = HardConcrete()
  log_alpha = jnp.linspace(-8, 8, 33)
  values = gate.deterministic(log_alpha)
  np.testing.assert_array_equal(values, gate.deterministic(log_alpha))
  assert values.min() == 0.0 and values.max() == 1.0
  assert np.all(np.diff(np.asarray(values)) >= 0)
  # sigmoid(a) * 1.2 - 0.1 >= 1 exactly when a >= log(11): such gates are fully open.
  assert gate.deterministic(jnp.array(math.log(11) + 1e-3)) == 1.0
  assert gate.deterministic(jnp.array(math.log(11) - 1e-2)) < 1.0
  np.testing.assert_array_equal(gate.binary_mask(log_alpha), values > 0)


def test_gradients_reach_log_alpha():
  gate = HardConcrete()
  grad_l0 = jax.grad(gate.expected_l0)(LOG_ALPHAS)
  assert np.all(grad_l0 > 0)  # the penalty always pushes towards closing
  grad_sample = jax.grad(lambda a: gate.sample(jax.random.key(3), a).sum())(jnp.zeros(64))
  assert np.all(np.isfinite(grad_sample)) and np.any(grad_sample > 0)
