"""Hard-concrete gates against an independent numpy version of Louizos et al. (2018).

The reference (`numpy_reference.py`) carries the constants of the papers' code, not the
library's, so a changed default temperature or stretch fails here.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_attn.attention import HardConcrete

LOG_ALPHAS = np.array([-3.0, -1.0, 0.0, 1.0, 2.5], np.float32)


def test_default_gate_is_the_one_of_voita_et_al(numpy_reference):
  gate = HardConcrete()
  log_alpha = np.linspace(-6, 6, 49).astype(np.float32)
  ref = numpy_reference
  np.testing.assert_allclose(
      gate.prob_open(log_alpha),
      ref.hard_concrete_prob_open(log_alpha, ref.VOITA_TEMPERATURE),
      rtol=1e-6,
      atol=1e-7,
  )
  np.testing.assert_allclose(
      gate.expected_l0(log_alpha),
      ref.hard_concrete_prob_open(log_alpha, ref.VOITA_TEMPERATURE).sum(),
      rtol=1e-6,
  )
  np.testing.assert_allclose(
      gate.deterministic(log_alpha), ref.hard_concrete_eval(log_alpha), rtol=1e-6, atol=1e-7
  )
  np.testing.assert_array_equal(gate.binary_mask(log_alpha), ref.hard_concrete_eval(log_alpha) > 0)


def test_eval_gates_open_exactly_above_log_11(numpy_reference):
  """sigmoid(a) * 1.2 - 0.1 >= 1 exactly when a >= log(11) (stretch (-0.1, 1.1))."""
  gate = HardConcrete()
  assert gate.deterministic(jnp.array(math.log(11) + 1e-3)) == 1.0
  assert gate.deterministic(jnp.array(math.log(11) - 1e-2)) < 1.0
  assert gate.deterministic(jnp.array(-math.log(11) - 1e-3)) == 0.0
  assert gate.deterministic(jnp.array(-math.log(11) + 1e-2)) > 0.0
  half_open = numpy_reference.hard_concrete_eval(np.array([-1.0, 0.0, 1.5]))
  np.testing.assert_allclose(gate.deterministic(jnp.array([-1.0, 0.0, 1.5])), half_open, rtol=1e-6)
  assert np.all((half_open > 0) & (half_open < 1))


@pytest.mark.parametrize('gate_name', ['default', 'louizos'])
def test_sampled_gates_follow_the_reference_distribution(gate_name, numpy_reference):
  ref = numpy_reference
  gate, temperature = {
      'default': (HardConcrete(), ref.VOITA_TEMPERATURE),
      'louizos': (HardConcrete(temperature=2 / 3), ref.LOUIZOS_TEMPERATURE),
  }[gate_name]
  n = 200_000
  draws = np.asarray(
      jax.jit(jax.vmap(lambda rng: gate.sample(rng, LOG_ALPHAS)))(
          jax.random.split(jax.random.key(0), n)
      )
  )
  assert draws.min() == 0.0 and draws.max() == 1.0
  # Binomial standard errors are <= 0.0012 at n = 200k: 4e-3 is over 3 of them.
  np.testing.assert_allclose(
      (draws == 0).mean(0), 1 - ref.hard_concrete_prob_open(LOG_ALPHAS, temperature), atol=4e-3
  )
  np.testing.assert_allclose(
      (draws == 1).mean(0), ref.hard_concrete_prob_one(LOG_ALPHAS, temperature), atol=4e-3
  )
  np.testing.assert_allclose(
      draws.mean(0), ref.hard_concrete_mean(LOG_ALPHAS, temperature), atol=4e-3
  )


def test_the_two_temperatures_are_distinguishable(numpy_reference):
  """The Monte-Carlo tolerance above (4e-3) is well below the gap between beta = 0.33 and 2/3."""
  ref = numpy_reference
  gap = np.abs(
      ref.hard_concrete_prob_open(LOG_ALPHAS, ref.VOITA_TEMPERATURE)
      - ref.hard_concrete_prob_open(LOG_ALPHAS, ref.LOUIZOS_TEMPERATURE)
  )
  assert gap.max() > 0.1
  gap_mean = np.abs(
      ref.hard_concrete_mean(LOG_ALPHAS, ref.VOITA_TEMPERATURE)
      - ref.hard_concrete_mean(LOG_ALPHAS, ref.LOUIZOS_TEMPERATURE)
  )
  assert gap_mean.max() > 0.015


def test_gradients_reach_log_alpha():
  gate = HardConcrete()
  grad_l0 = jax.grad(gate.expected_l0)(jnp.asarray(LOG_ALPHAS))
  assert np.all(grad_l0 > 0)  # the penalty always pushes towards closing
  grad_sample = jax.grad(lambda a: gate.sample(jax.random.key(3), a).sum())(jnp.zeros(64))
  assert np.all(np.isfinite(grad_sample)) and np.any(grad_sample > 0)
