"""experiments/gpu_grid.sh on this CPU: the deadline stops the grid and what comes back is still
packed, run directories without their checkpoints."""

import os
import pathlib
import subprocess
import sys
import tarfile
import textwrap

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
    print('grid: start a', flush=True)
    time.sleep(600)
""")


def test_deadline_then_packing_without_checkpoints(tmp_path):
  (tmp_path / 'fake_experiment.py').write_text(FAKE_GRID)
  out, runs = tmp_path / 'out', tmp_path / 'runs'
  env = {
      **os.environ,
      'OUT': str(out),
      'RUNS': str(runs),
      'DEADLINE': '20',
      'WHEELS': str(tmp_path / 'no_wheels'),
      'PYTHONPATH': str(tmp_path),
      'PATH': f'{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ["PATH"]}',
  }
  done = subprocess.run(
      [
          'bash',
          'experiments/gpu_grid.sh',
          'experiments/bottleneck',
          'fake_experiment',
          '--parallel=3',
      ],
      cwd=REPO_ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert done.returncode == 0, done.stdout + done.stderr
  assert 'grid exit 124 after' in done.stdout  # timeout's code: the deadline stopped it
  assert 'stopped by SIGTERM' in (out / 'grid.log').read_text()
  assert 'grid exit 124' in (out / 'machine.txt').read_text()
  with tarfile.open(out / 'runs.tar.gz') as tar:
    names = sorted(n.removeprefix('./') for n in tar.getnames() if n != '.')
  assert names == ['a', 'a/metrics.jsonl', 'b', 'b/metrics.jsonl']
  with tarfile.open(out / 'experiment.tar.gz') as tar:
    assert 'experiments/bottleneck/convergence/results.json' in tar.getnames()
