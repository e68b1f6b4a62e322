"""Hard-concrete head gates (Louizos et al. 2018), as used by Voita et al. 2019 to prune heads.

A gate g_i in [0, 1] multiplies head i's output. Training samples a stretched, clipped concrete
variable whose parameter `log_alpha` is learned; the expected L0 norm sum_i P(g_i != 0) is a
differentiable penalty that pushes gates to exactly 0. At evaluation the gate is deterministic.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class HardConcrete:
  """Hard-concrete distribution settings.

  Attributes:
    temperature: beta of the concrete distribution, > 0. We default to 0.33, the value of Voita
      et al.'s own code (`lib/layers/concrete_gate.py`): a lower temperature than Louizos et
      al.'s 2/3 makes samples closer to {0, 1}, so the train-time network is closer to the
      pruned network it becomes.
    stretch: (low, high) limits the sigmoid is stretched to before clipping to [0, 1]; low < 0
      and high > 1 give gates a non-zero probability of being exactly 0 or 1 (Louizos et al.
      use (-0.1, 1.1)).
  """

  temperature: float = 0.33
  stretch: tuple[float, float] = (-0.1, 1.1)

  def __post_init__(self):
    if not self.temperature > 0:
      raise ValueError(f'gate temperature={self.temperature!r} must be > 0.')
    low, high = self.stretch
    if not (low < 0 and high > 1):
      raise ValueError(
          f'gate stretch={self.stretch!r} must satisfy low < 0 and high > 1, '
          'otherwise gates can never be exactly closed/open and the L0 penalty is undefined.'
      )

  def _stretch_and_clip(self, s):
    low, high = self.stretch
    return jnp.clip(s * (high - low) + low, 0.0, 1.0)

  def sample(self, rng: jax.Array, log_alpha: jax.Array) -> jax.Array:
    """Training-time gates, reparametrized so gradients reach `log_alpha` (Louizos eq. 10)."""
    log_alpha = jnp.asarray(log_alpha, jnp.float32)
    # log(u) - log(1 - u) for u ~ U(0, 1) is a standard logistic sample.
    noise = jax.random.logistic(rng, log_alpha.shape, jnp.float32)
    return self._stretch_and_clip(jax.nn.sigmoid((noise + log_alpha) / self.temperature))

  def deterministic(self, log_alpha: jax.Array) -> jax.Array:
    """Evaluation-time gates in [0, 1] (Louizos eq. 13, also Voita et al.'s code)."""
    return self._stretch_and_clip(jax.nn.sigmoid(jnp.asarray(log_alpha, jnp.float32)))

  def prob_open(self, log_alpha: jax.Array) -> jax.Array:
    """P(g_i != 0) per gate: the CDF of the stretched concrete above 0 (Louizos eq. 12)."""
    low, high = self.stretch
    shift = self.temperature * math.log(-low / high)
    return jax.nn.sigmoid(jnp.asarray(log_alpha, jnp.float32) - shift)

  def expected_l0(self, log_alpha: jax.Array) -> jax.Array:
    """The L0 penalty sum_i P(g_i != 0): the expected number of open gates."""
    return jnp.sum(self.prob_open(log_alpha))

  def binary_mask(self, log_alpha: jax.Array) -> jax.Array:
    """The heads that survive pruning: those whose evaluation gate is not exactly 0.

    Gates trained with the L0 penalty end at 0 or 1 for almost all heads; where a kept head's
    evaluation gate is below 1, `deterministic` rather than this mask reproduces eval outputs.
    """
    return self.deterministic(log_alpha) > 0.0
