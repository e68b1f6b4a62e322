"""Where runs go and what ran them: the machine, the code (commit and edits), the runs root."""

import importlib.metadata
import os
import pathlib
import platform
import subprocess
from typing import Any

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
RUNS_ENV = 'LOWRANK_ATTN_RUNS'  # root of run directories that outlive the work tree


def machine() -> dict[str, Any]:
  """Where this process runs: platform, CPU model and count, Python and JAX versions."""
  info = {'platform': platform.platform(), 'cpu': _cpu_model(), 'cpu_count': os.cpu_count()}
  if hasattr(os, 'sched_getaffinity'):
    info['cpus_available'] = len(os.sched_getaffinity(0))
  info['python'] = platform.python_version()
  for package in ('jax', 'jaxlib', 'flax'):
    try:
      info[package] = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
      pass
  return info


def code_version(checkout: str | os.PathLike) -> dict[str, Any]:
  """The code a command started in `checkout` runs: `commit` (None outside git) and
  `modified`, the tracked Python files that differ from it (not the results, READMEs and plots
  that grids write, nor untracked files)."""

  def git(*args):
    return subprocess.run(['git', '-C', str(checkout), *args], capture_output=True, text=True)

  head = git('rev-parse', 'HEAD')
  if head.returncode != 0:
    return {'commit': None, 'modified': []}
  status = git('status', '--porcelain', '--untracked-files=no').stdout.splitlines()
  modified = sorted(path for path in (line[3:] for line in status) if path.endswith('.py'))
  return {'commit': head.stdout.strip(), 'modified': modified}


def default_runs_dir(experiment: str) -> pathlib.Path:
  """`$LOWRANK_ATTN_RUNS/<experiment>` if set, else `runs/<experiment>` in the repository."""
  root = os.environ.get(RUNS_ENV)
  return pathlib.Path(root) / experiment if root else REPO_ROOT / 'runs' / experiment


def _cpu_model() -> str:
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        if line.startswith('model name'):
          return line.split(':', 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()
