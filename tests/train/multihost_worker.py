"""One process of a simulated 2-host run (2 CPU devices each), for test_multihost.py.

python tests/train/multihost_worker.py <process_id> <port> <workdir> <tfds_dir> <steps>
"""

import os
import sys

os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=2'

import jax  # pylint: disable=g-import-not-at-top

jax.config.update('jax_cpu_collectives_implementation', 'gloo')


def main():
  process_id, port, workdir, tfds_dir, steps = sys.argv[1:]
  jax.distributed.initialize(f'localhost:{port}', num_processes=2, process_id=int(process_id))
  sys.path.insert(0, os.path.dirname(__file__))
  import conftest  # pylint: disable=g-import-not-at-top
  from lowrank_attn.train import train  # pylint: disable=g-import-not-at-top

  config = conftest.override(
      conftest.load_config('lm', 'tiny'),
      {
          **conftest.SMALL_MODEL,
          'model.num_decoder_layers': 1,
          'model.dropout_rate': 0.1,
          'num_train_steps': int(steps),
          'checkpoint_every_steps': 6,
          'log_every_steps': 4,
          'data.tfds_data_dir': tfds_dir,
          'peak_flops_per_device': 1e11,
          'per_device_batch_size': 2,
          'mesh.data': 2,
          'mesh.fsdp': 2,
          # Independent of num_train_steps, so a 12-step run continues into the 18-step one.
          'lr_schedule': 'inverse_sqrt',
      },
  )
  result = train.train_and_evaluate(config, workdir)
  print('RESULT', jax.process_index(), result['step'], flush=True)


if __name__ == '__main__':
  main()
