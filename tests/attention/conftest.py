import jax.numpy as jnp
import numpy as np
import pytest


def random_params(spec, seed=0, dtype=jnp.float32):
  """Every parameter random (biases and gates included), so no term is trivially zero.

  numpy draws them: eager jax.random would compile once per new shape.
  """
  rng = np.random.default_rng(seed)
  params = {}
  for name, shape in sorted(spec.param_shapes().items()):
    if name == 'gate_log_alpha':
      value = rng.uniform(-2.0, 4.0, shape)
    elif name.endswith('softmax_mixing'):
      value = np.eye(shape[0]) + 0.3 * rng.standard_normal(shape)
    else:
      fan_in = shape[0] if len(shape) > 1 else 1
      value = rng.standard_normal(shape) / np.sqrt(fan_in)
    params[name] = jnp.asarray(value, dtype)
  return params


@pytest.fixture
def make_params():
  return random_params
