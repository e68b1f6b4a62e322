"""Command line: `python -m lowrank_attn.main --config=configs/nmt.py:tiny --workdir=/tmp/run`.

Overrides: `--config.model.encoder_attention.kind=collaborative --config.num_train_steps=500`.
Rerunning the same command resumes from the latest checkpoint in --workdir. Exit status: 0
done, 1 invalid config or NaN/inf, 143 preempted (SIGTERM) after saving a checkpoint.
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

flags.DEFINE_string('workdir', None, 'Directory for checkpoints, metrics and config.json.')
config_flags.DEFINE_config_file('config', None, 'Task config file, e.g. configs/lm.py:tiny.',
                                lock_config=True)
flags.mark_flags_as_required(['config', 'workdir'])
FLAGS = flags.FLAGS


def parse_flags(argv):
  """absl's parsing, plus a one-line error for an unknown `--config.<field>` override.

  ml_collections raises AttributeError/KeyError (with a "did you mean" hint) for fields that
  do not exist; without this they would surface as a traceback.
  """
  try:
    return FLAGS(argv)
  except flags.Error as e:
    sys.exit(f'FATAL Flags parsing error: {e}\nPass --helpshort or --helpfull to see help.')
  except (AttributeError, KeyError) as e:
    # ml_collections nests the KeyError's repr; keep its words ("'x' Did you mean 'y'?").
    words = str(e).replace('\\n', ' ').replace('\\', '').replace("'", '').split()
    sys.exit(f'Invalid config override: unknown field {" ".join(words)}')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not FLAGS['verbosity'].present:  # library INFO logs (Orbax, grain) drown the progress
    logging.set_verbosity(logging.WARNING)
  # Imported here so that --help and flag errors do not pay for importing JAX.
  from lowrank_attn.train import config as config_lib, train

  config = FLAGS.config
  try:
    config_lib.validate(config)  # before any data is read or device touched
  except ValueError as e:
    sys.exit(f'Invalid config: {e}')
  logging.info('Config:\n%s', config)
  try:
    train.train_and_evaluate(config, FLAGS.workdir)
  except train.NonFiniteError as e:
    sys.exit(f'Stopped: {e}')
  except train.Preempted as e:
    logging.warning('%s', e)
    print(e, flush=True)
    sys.exit(143)


if __name__ == '__main__':
  app.run(main, flags_parser=parse_flags)
