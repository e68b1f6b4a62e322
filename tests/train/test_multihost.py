"""Two processes (simulated hosts, 2 CPU devices each) on one machine: per-process input,
global batches, Orbax checkpoints with every process's data position, exact resume."""

import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from lowrank_attn import tasks
from lowrank_attn import data
from lowrank_attn.train import checkpoints

WORKER = pathlib.Path(__file__).with_name('multihost_worker.py')


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def run_two_processes(workdir, tfds_dir, steps):
  port = str(free_port())
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  processes = [
      subprocess.Popen(
          [sys.executable, str(WORKER), str(i), port, str(workdir), tfds_dir, str(steps)],
          env=env,
          stdout=subprocess.PIPE,
          stderr=subprocess.STDOUT,
          text=True,
      )
      for i in range(2)
  ]
  outputs = [p.communicate(timeout=300)[0] for p in processes]
  for p, out in zip(processes, outputs):
    assert p.returncode == 0, out
  return outputs


def prepare(helpers, workdir, tfds_dir):
  """Builds the data set and tokenizer once, so the two processes only read them."""
  config = helpers.load_config('lm', 'tiny')
  config.data.tfds_data_dir = tfds_dir
  tasks.make_pipeline(
      config.data, split='train', seed=0, global_batch_size=4, train=True, workdir=str(workdir)
  )


@pytest.mark.slow
def test_two_process_run_resumes_exactly(helpers, tfds_dir, tmp_path):
  straight, resumed = tmp_path / 'straight', tmp_path / 'resumed'
  for workdir in (straight, resumed):
    prepare(helpers, workdir, tfds_dir)
  outputs = run_two_processes(straight, tfds_dir, 18)
  assert 'RESULT 0 18' in outputs[0] and 'RESULT 1 18' in outputs[1]
  run_two_processes(resumed, tfds_dir, 12)
  outputs = run_two_processes(resumed, tfds_dir, 18)
  assert 'resumed from step 12' in outputs[0]
  _, a = checkpoints.load_state(str(straight))
  _, b = checkpoints.load_state(str(resumed))
  for x, y in zip(jax.tree.leaves(a['params']), jax.tree.leaves(b['params'])):
    assert np.array_equal(x, y)
