"""`python -m lowrank_attn.main`: bad input is one line and exit status 2, before any data work.

In-process: `main.parse` and `main.check` on flags of their own (what `tpu/launch.py` uses too);
one integration test runs the command line.
"""

import os
import pathlib
import subprocess
import sys

from absl import flags
import pytest

from lowrank_attn import main

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def in_the_repository(monkeypatch):
  monkeypatch.chdir(ROOT)  # where `--config=configs/...` is


def parsed(*args):
  """The config and workdir of `main ARGS`."""
  argv = ['lowrank_attn.main', *args]
  flag_values = flags.FlagValues()
  main.define_flags(flag_values, sys_argv=argv)
  main.parse(flag_values, argv)
  return flag_values.config, flag_values.workdir


def bad_input(*args) -> str:
  with pytest.raises(main.BadInput) as raised:
    parsed(*args)
  message = str(raised.value)
  assert '\n' not in message and 'Traceback' not in message, message
  return message


def test_a_good_command_line_parses():
  config, workdir = parsed('--config=configs/lm.py:tiny', '--workdir=/tmp/x', '--config.seed=3')
  assert config.seed == 3 and config.task == 'lm' and workdir == '/tmp/x'


def test_a_missing_config_file_lists_the_configs_there():
  message = bad_input('--config=configs/lmm.py:tiny', '--workdir=/tmp/x')
  assert message == (
      'Invalid --config: no config file configs/lmm.py (configs/ holds glue.py, '
      'lm.py, mlm.py, nmt.py).'
  )
  # An override touches the config that failed to load: the same line.
  assert bad_input('--config=configs/lmm.py', '--workdir=/tmp/x', '--config.seed=1') == message


def test_a_config_that_is_a_directory():
  message = bad_input('--config=configs', '--workdir=/tmp/x')
  assert message.startswith('Invalid --config: cannot read the config file: ')
  assert 'Is a directory' in message


def test_an_unknown_variant_lists_the_valid_ones():
  assert bad_input('--config=configs/lm.py:huge', '--workdir=/tmp/x') == (
      "Invalid --config=configs/lm.py:huge: configs/lm.py: unknown variant 'huge'; valid: base, "
      'tiny, bottleneck.'
  )


def test_an_unknown_override_and_a_missing_flag():
  assert 'unknown field sede Did you mean "seed"' in bad_input(
      '--config=configs/lm.py:tiny', '--workdir=/tmp/x', '--config.sede=1'
  )
  assert '--workdir must have a value' in bad_input('--config=configs/lm.py:tiny')


def test_check_says_which_value_is_bad(tmp_path):
  config, _ = parsed('--config=configs/lm.py:tiny', f'--workdir={tmp_path}')
  config.num_train_steps = 0
  with pytest.raises(main.BadInput, match=r'^Invalid config: config\.num_train_steps=0'):
    main.check(config, str(tmp_path))
  config.num_train_steps = 10
  config.mesh.tensor = 3  # 8 devices in the tests
  with pytest.raises(main.BadInput, match=r'do not divide the 8 available devices'):
    main.check(config, str(tmp_path))


@pytest.mark.integration
def test_the_command_line_exits_2_with_one_line_before_reading_data(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS='')  # one device
  cases = {
      'config file': (['--config=configs/nosuch.py'], 'no config file configs/nosuch.py'),
      'mesh': (
          ['--config=configs/lm.py:tiny', '--config.mesh.tensor=3'],
          'do not divide the 1 available devices',
      ),
  }
  for name, (args, says) in cases.items():
    workdir = tmp_path / name
    done = subprocess.run(
        [sys.executable, '-m', 'lowrank_attn.main', f'--workdir={workdir}', *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == main.BAD_INPUT == 2, (name, done.stderr)
    assert done.stderr.count('\n') == 1 and says in done.stderr, (name, done.stderr)
    assert not workdir.exists(), name  # nothing prepared
