"""Command line: `python -m lowrank_attn.main --config=configs/nmt.py:tiny --workdir=/tmp/run`.

Overrides: `--config.model.encoder_attention.kind=collaborative --config.num_train_steps=500`.
Rerunning the same command resumes from the latest intact checkpoint in --workdir (a finished
run says so and exits). Exit status: 0 done (or already finished), 1 NaN/inf, a failed
checkpoint save or no restorable checkpoint, 2 bad input (a flag, the config file or variant, a
config value, the data set, the mesh on these devices, extra_test_files, the workdir: one line,
before any data is read) or the workdir in use by another run, 143 preempted (SIGTERM) and 130
interrupted (SIGINT, Ctrl-C), each after committing a checkpoint of the current step; a second
signal exits at once (143 / 130) without saving.
"""

import os
import re
import sys

from absl import app, flags, logging
from ml_collections import config_flags

BAD_INPUT = 2  # exit status


def define_flags(flag_values: flags.FlagValues, sys_argv: list[str] | None = None) -> None:
  """The command's flags: on absl's FLAGS when this module is imported; `tpu/launch.py` checks
  the training command it will start on FlagValues of its own (`sys_argv`: that command)."""
  flags.DEFINE_string(
      'workdir',
      None,
      'Directory for checkpoints, metrics and config.json: local, or remote '
      '(gs://BUCKET/run, with gcsfs installed).',
      flag_values=flag_values,
  )
  config_flags.DEFINE_config_file(
      'config',
      None,
      'Task config file, e.g. configs/lm.py:tiny.',
      flag_values=flag_values,
      lock_config=True,
      sys_argv=sys_argv,
  )
  flags.mark_flags_as_required(['config', 'workdir'], flag_values=flag_values)


define_flags(flags.FLAGS)
FLAGS = flags.FLAGS


class BadInput(Exception):
  """A problem with the command's input: one line on stderr, exit status 2 (BAD_INPUT)."""


def parse(flag_values: flags.FlagValues, argv: list[str], *, known_only: bool = False) -> list[str]:
  """absl's parsing of `argv` into `flag_values`; every error is one BadInput line.

  Without this, ml_collections' errors are tracebacks: an unknown `--config.<field>`
  (AttributeError/KeyError with a "did you mean" hint), an exception of the config file's
  `get_config` such as an unknown variant (its traceback inside a flags error), and a config
  file that cannot be read (an OSError deferred to the config's first use).
  """
  try:
    rest = flag_values(argv, known_only=known_only)
    flag_values.config.get('task')  # raises the deferred OSError of an unreadable file
    return rest
  except flags.Error as e:
    raise BadInput(_flag_error(e)) from None
  except (AttributeError, KeyError) as e:
    # ml_collections nests the KeyError's repr; keep its words ("'x' Did you mean 'y'?").
    words = str(e).replace('\\n', ' ').replace('\\', '').replace("'", '').split()
    raise BadInput(f'Invalid config override: unknown field {" ".join(words)}') from None
  except OSError as e:
    raise BadInput(_config_file_error(e)) from None


def _flag_error(e: flags.Error) -> str:
  text = str(e)
  if 'Traceback (most recent call last)' in text:  # get_config raised: keep its last line
    flag = text.split(': Error whilst parsing config file:')[0].removeprefix('flag ')
    last = [line for line in text.splitlines() if line.strip()][-1]
    message = re.sub(r'^[A-Za-z_][\w.]*: ', '', last)  # 'ValueError: configs/lm.py: ...'
    return f'Invalid {flag}: {message}'
  return f'Flags parsing error: {" ".join(text.split())} (--helpshort lists the flags)'


def _config_file_error(e: OSError) -> str:
  reason = [line.strip() for line in str(e).splitlines() if line.strip()][-1]
  missing = re.fullmatch(r"\[Errno 2\] No such file or directory: '(.+)'", reason)
  if not missing:
    return f'Invalid --config: cannot read the config file: {reason}'
  path = missing.group(1)
  folder = os.path.dirname(path) or '.'
  found = []
  if os.path.isdir(folder):
    found = sorted(f for f in os.listdir(folder) if f.endswith('.py'))
  there = f' ({folder}/ holds {", ".join(found)})' if found else ''
  return f'Invalid --config: no config file {path}{there}.'


def check(
    config, workdir: str, *, num_devices: int | None = None, local_paths: bool = True
) -> None:
  """`config.validate`, then the pre-flight (`train.preflight.check`, whose arguments these
  are): everything that is bad input, before any data is read; BadInput if not."""
  from lowrank_attn.train import config as config_lib, preflight

  try:
    config_lib.validate(config)
  except ValueError as e:
    raise BadInput(f'Invalid config: {e}') from None
  try:
    preflight.check(config, workdir, num_devices=num_devices, local_paths=local_paths)
  except preflight.PreflightError as e:
    raise BadInput(str(e)) from None


def _refuse(message) -> None:
  print(message, file=sys.stderr, flush=True)
  sys.exit(BAD_INPUT)


def parse_flags(argv):
  try:
    return parse(FLAGS, argv)
  except BadInput as e:
    _refuse(e)


def main(argv):
  if len(argv) > 1:
    _refuse(
        f'Unexpected arguments: {argv[1:]} (flags are --config=FILE[:VARIANT], '
        '--workdir=DIR and --config.<field>=VALUE).'
    )
  if not FLAGS['verbosity'].present:  # library INFO logs (Orbax, grain) drown the progress
    logging.set_verbosity(logging.WARNING)
  # Imported here so that --help and flag errors do not pay for importing JAX.
  from lowrank_attn.train import train

  config = FLAGS.config
  try:
    check(config, FLAGS.workdir)  # before any data is read
  except BadInput as e:
    _refuse(e)
  logging.info('Config:\n%s', config)
  from lowrank_attn.train import checkpoints

  try:
    train.train_and_evaluate(config, FLAGS.workdir)
  except (train.NonFiniteError, checkpoints.CheckpointError) as e:
    sys.exit(f'Stopped: {e}')
  except checkpoints.WorkdirBusyError as e:
    _refuse(f'Refused: {e}')
  except train.Preempted as e:
    # Everything is committed and closed (train_and_evaluate's `finally`): skip the interpreter's
    # shutdown (data-loading threads, XLA), which took 16 s under load after the save.
    print(e, flush=True)
    _exit_now(e.exit_status)
  except KeyboardInterrupt:  # Ctrl-C outside the training loop (data preparation, compiling)
    print(
        'Interrupted (Ctrl-C) before training started or after it ended: no step was lost.',
        file=sys.stderr,
        flush=True,
    )
    _exit_now(130)


def _exit_now(status: int) -> None:
  logging.flush()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(status)  # pylint: disable=protected-access


if __name__ == '__main__':
  app.run(main, flags_parser=parse_flags)
