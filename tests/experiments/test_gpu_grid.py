"""experiments/gpu_grid.sh on this CPU: the deadline stops the grid and what comes back is still
packed, run directories without their checkpoints."""

import os
import pathlib
import subprocess
import sys
import tarfile
import textwrap

import numpy as np
import pytest

pytestmark = pytest.mark.integration  # starts the script and its Python processes

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]

# A stand-in experiment: two run directories (one with a checkpoint), then it waits to be
# stopped and says how it was.
FAKE_GRID = textwrap.dedent("""
    import argparse, pathlib, signal, sys, time
    parser = argparse.ArgumentParser()
    parser.add_argument('--runs_dir')
    parser.add_argument('--parallel')
    args = parser.parse_args()
    runs = pathlib.Path(args.runs_dir)
    for name in ('a', 'b'):
      (runs / name / 'checkpoints' / '100').mkdir(parents=True)
      (runs / name / 'checkpoints' / '100' / 'state').write_bytes(b'x' * 1000)
      (runs / name / 'metrics.jsonl').write_text('{"step": 100}\\n')
    signal.signal(signal.SIGTERM, lambda *a: (print('stopped by SIGTERM', flush=True), sys.exit(143)))
    import os
    print('data:', os.environ.get('LOWRANK_ATTN_DATA'), flush=True)
    print('compilation cache:', os.environ.get('JAX_COMPILATION_CACHE_DIR'), flush=True)
    print('grid: start a', flush=True)
    time.sleep(600)
""")


def checkout(path: pathlib.Path) -> pathlib.Path:
  """A copy of the checkout as a call gets it, without the carried folders this one may hold
  (.gpu_data, .gpu_minilm, .gpu_runs made here for a device call): this repo's experiments/."""
  path.mkdir()
  (path / 'experiments').symlink_to(REPO_ROOT / 'experiments')
  return path


def gpu_grid(tmp_path, *args, deadline, cwd=None, **env):
  """Runs experiments/gpu_grid.sh ARGS with the fake experiment importable, this venv's python
  first on PATH, no wheels, and OUT, RUNS and PREPARED under tmp_path; from `cwd`, by default a
  checkout without carried folders."""
  (tmp_path / 'fake_experiment.py').write_text(FAKE_GRID)
  if cwd is None:
    cwd = checkout(tmp_path / 'checkout')
  env = {
      **{  # (the machine's own: the script picks these where they are unset)
          k: v
          for k, v in os.environ.items()
          if k not in ('LOWRANK_ATTN_DATA', 'JAX_COMPILATION_CACHE_DIR')
      },
      'OUT': str(tmp_path / 'out'),
      'RUNS': str(tmp_path / 'runs'),
      'DEADLINE': str(deadline),
      'WHEELS': str(tmp_path / 'no_wheels'),
      'PREPARED': str(tmp_path / 'prepared'),
      'PYTHONPATH': str(tmp_path),
      'PATH': f'{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ["PATH"]}',
      **env,
  }
  done = subprocess.run(
      ['bash', str(REPO_ROOT / 'experiments' / 'gpu_grid.sh'), *args],
      cwd=cwd,
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert done.returncode == 0, done.stdout + done.stderr
  return done


def test_deadline_then_packing_without_checkpoints(tmp_path):
  out = tmp_path / 'out'
  done = gpu_grid(
      tmp_path, 'experiments/bottleneck', 'fake_experiment', '--parallel=3', deadline=20
  )
  assert 'grid exit 124 after' in done.stdout  # timeout's code: the deadline stopped it
  assert 'stopped by SIGTERM' in (out / 'grid.log').read_text()
  # JAX's compilation cache under PREPARED, which a second call on the same machine finds.
  assert (
      f'compilation cache: {tmp_path / "prepared" / "jax_cache"}' in (out / 'grid.log').read_text()
  )
  assert 'grid exit 124' in (out / 'machine.txt').read_text()
  with tarfile.open(out / 'runs.tar.gz') as tar:
    names = sorted(n.removeprefix('./') for n in tar.getnames() if n != '.')
  assert names == ['a', 'a/metrics.jsonl', 'b', 'b/metrics.jsonl']
  with tarfile.open(out / 'experiment.tar.gz') as tar:
    assert 'experiments/bottleneck/convergence/results.json' in tar.getnames()


def test_a_first_call_prepares_what_the_second_finds(tmp_path):
  """PREPARE_ONLY=1 copies the carried data under $PREPARED and stops; the next call, which
  carries no data, reads it from there."""
  first = tmp_path / 'first_call'
  (first / '.gpu_data' / 'glue').mkdir(parents=True)
  (first / '.gpu_data' / 'glue' / 'x.tsv').write_text('a\tb\n')
  prepared = tmp_path / 'prepared'
  done = gpu_grid(tmp_path, deadline=15, cwd=first, PREPARE_ONLY='1')
  assert 'prepared in' in done.stdout
  assert (prepared / 'data' / 'glue' / 'x.tsv').read_text() == 'a\tb\n'

  # The second call from a checkout without .gpu_data (this one may have one, from a device
  # call), its experiments/ this repo's.
  gpu_grid(tmp_path, 'experiments/bottleneck', 'fake_experiment', deadline=5)
  assert f'data: {prepared / "data"}' in (tmp_path / 'out' / 'grid.log').read_text()


FAKE_MPS_CONTROL = """#!/bin/bash
echo "args: $* stdin: $([ "$1" = -d ] || cat)" >> "$MPS_LOG"
"""


def fake_mps_control(tmp_path) -> dict:
  """A stand-in nvidia-cuda-mps-control on PATH that logs how it was called."""
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir()
  (bin_dir / 'nvidia-cuda-mps-control').write_text(FAKE_MPS_CONTROL)
  (bin_dir / 'nvidia-cuda-mps-control').chmod(0o755)
  path = (
      f'{pathlib.Path(sys.executable).parent}{os.pathsep}{bin_dir}{os.pathsep}{os.environ["PATH"]}'
  )
  return {'PATH': path, 'MPS_LOG': str(tmp_path / 'mps.log')}


def test_mps_that_gives_jax_no_gpu_is_stopped_again(tmp_path):
  """On this CPU the daemon starts but JAX finds no GPU behind it: the script must stop the
  daemon (an MPS server without clients would hold the GPU of a real machine) and say so."""
  env = fake_mps_control(tmp_path)
  gpu_grid(tmp_path, 'experiments/bottleneck', 'fake_experiment', deadline=5, **env)
  assert (tmp_path / 'mps.log').read_text().splitlines() == [
      'args: -d stdin: ',
      'args:  stdin: quit',
  ]
  assert (
      'CUDA MPS: off (with the daemon up, JAX found no GPU)'
      in (tmp_path / 'out' / 'machine.txt').read_text()
  )


def test_mps_0_leaves_the_daemon_alone(tmp_path):
  env = fake_mps_control(tmp_path)
  gpu_grid(tmp_path, 'experiments/bottleneck', 'fake_experiment', deadline=5, MPS='0', **env)
  assert not (tmp_path / 'mps.log').exists()
  assert 'CUDA MPS: off' in (tmp_path / 'out' / 'machine.txt').read_text()


def test_carried_model_and_runs_stay_for_the_calls_after(tmp_path):
  """A PREPARE_ONLY call carrying .gpu_minilm and .gpu_runs leaves the model (and its stand-in
  package) under $PREPARED and the runs, finished, in $RUNS; a later call carrying neither
  finds the model."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import safetensors.numpy  # pylint: disable=g-import-not-at-top

  from experiments import gpu_minilm, gpu_runs  # pylint: disable=g-import-not-at-top
  from lowrank_attn.train import checkpoints  # pylint: disable=g-import-not-at-top

  first = checkout(tmp_path / 'first_call')
  minilm = first / '.gpu_minilm'
  (minilm / 'site' / gpu_minilm.PACKAGE).mkdir(parents=True)
  (minilm / 'site' / gpu_minilm.PACKAGE / '__init__.py').write_text(gpu_minilm.STAND_IN)
  (minilm / 'vocab.txt').write_text('[PAD]\n')
  safetensors.numpy.save_file({'w': np.full(3, 0.1, np.float16)}, str(minilm / gpu_minilm.ROUNDED))
  run = tmp_path / 'here' / 'original-s0'  # a finished run of this CPU
  run.mkdir(parents=True)
  (run / 'config.json').write_text('{}')
  (run / 'DONE').write_text('{"name": "original-s0"}')
  checkpointer = checkpoints.Checkpointer(str(run), keep=1, async_save=False)
  params = {'w': np.full(3, 0.1, np.float32)}
  checkpointer.save(5, {'step': jnp.asarray(5, jnp.int32), 'params': params}, {})
  checkpointer.close()
  gpu_runs.pack(first / '.gpu_runs', [run])

  done = gpu_grid(tmp_path, deadline=15, cwd=first, PREPARE_ONLY='1')
  assert 'minilm/; runs in' in done.stdout, done.stdout
  prepared, runs = tmp_path / 'prepared', tmp_path / 'runs'
  weights = safetensors.numpy.load_file(str(prepared / 'minilm' / 'model.safetensors'))
  np.testing.assert_array_equal(weights['w'], np.float32(np.float16(0.1)))
  assert (prepared / 'minilm' / 'vocab.txt').read_text() == '[PAD]\n'
  assert (runs / 'original-s0' / 'DONE').read_text() == '{"name": "original-s0"}'
  assert (runs / 'original-s0' / 'config.json').read_text() == '{}'

  gpu_grid(tmp_path, 'experiments/bottleneck', 'fake_experiment', deadline=5)
  assert (
      f'all-MiniLM-L6-v2 (float16-rounded) from {prepared / "minilm"}'
      in (tmp_path / 'out' / 'machine.txt').read_text()
  )
