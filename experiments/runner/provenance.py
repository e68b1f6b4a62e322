"""Where runs go and what ran them: the machine, the code (commit and edits), the runs root."""

import hashlib
import importlib.metadata
import json
import os
import pathlib
import platform
import subprocess
from typing import Any

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
RUNS_ENV = 'LOWRANK_ATTN_RUNS'  # root of run directories that outlive the work tree
# A copy of a checkout made without its .git (the tree sent to an accelerator machine) says
# what it was copied from: the commit and the git blob hash of each tracked file.
MANIFEST = '.code_manifest.json'


def machine() -> dict[str, Any]:
  """Where this process runs: platform, CPU model and count, Python and JAX versions."""
  info = {'platform': platform.platform(), 'cpu': _cpu_model(), 'cpu_count': os.cpu_count()}
  if hasattr(os, 'sched_getaffinity'):
    info['cpus_available'] = len(os.sched_getaffinity(0))
  info['python'] = platform.python_version()
  gpus = _gpus()
  if gpus:
    info['gpus'] = gpus
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
    return _copy_version(pathlib.Path(checkout))
  status = git('status', '--porcelain', '--untracked-files=no').stdout.splitlines()
  modified = sorted(path for path in (line[3:] for line in status) if path.endswith('.py'))
  if modified:
    # A copy sent with an older .git beside it (an accelerator machine's): the manifest, if it
    # accounts for every file, names the commit the code is.
    copy = _copy_version(pathlib.Path(checkout))
    if copy['commit'] and not copy['modified']:
      return copy
  return {'commit': head.stdout.strip(), 'modified': modified}


def write_manifest(checkout: str | os.PathLike) -> pathlib.Path:
  """Writes `<checkout>/.code_manifest.json` (`MANIFEST`, git-ignored): HEAD and the blob hash
  of every tracked file, for `code_version` in a copy of the checkout without .git (or with a
  stale one). The copy must carry it."""
  checkout = pathlib.Path(checkout)
  run = lambda *a: subprocess.run(
      ['git', '-C', str(checkout), *a], capture_output=True, text=True, check=True
  ).stdout
  blobs = {}
  for line in run('ls-files', '-s').splitlines():
    info, path = line.split('\t', 1)
    blobs[path] = info.split()[1]
  status = run('status', '--porcelain', '--untracked-files=no').splitlines()
  edited = sorted(line[3:] for line in status)
  record = {'commit': run('rev-parse', 'HEAD').strip(), 'edited_at_writing': edited, 'files': blobs}
  path = checkout / MANIFEST
  path.write_text(json.dumps(record, indent=0) + '\n')
  return path


def _copy_version(checkout: pathlib.Path) -> dict[str, Any]:
  """`code_version` of a directory outside git: {'commit': None} without a manifest; with one,
  its commit and the tracked Python files whose content differs from it (missing ones too)."""
  try:
    record = json.loads((checkout / MANIFEST).read_text())
  except FileNotFoundError:
    return {'commit': None, 'modified': []}
  modified = sorted(
      path
      for path, blob in record['files'].items()
      if path.endswith('.py') and _blob_hash(checkout / path) != blob
  )
  return {'commit': record['commit'], 'modified': modified, 'copy_of_checkout': True}


def _blob_hash(path: pathlib.Path) -> str | None:
  """git's object name of the file's content (`git hash-object`); None if it is missing."""
  try:
    data = path.read_bytes()
  except FileNotFoundError:
    return None
  return hashlib.sha1(b'blob %d\0' % len(data) + data).hexdigest()


def default_runs_dir(experiment: str) -> pathlib.Path:
  """`$LOWRANK_ATTN_RUNS/<experiment>` if set, else `runs/<experiment>` in the repository."""
  root = os.environ.get(RUNS_ENV)
  return pathlib.Path(root) / experiment if root else REPO_ROOT / 'runs' / experiment


def _gpus() -> list[str]:
  """The NVIDIA GPUs `nvidia-smi` lists ([] where there is none), without importing JAX: the
  grid's process starts no JAX threads."""
  try:
    done = subprocess.run(
        ['nvidia-smi', '--query-gpu=name', '--format=csv,noheader'],
        capture_output=True,
        text=True,
        timeout=30,
    )
  except (OSError, subprocess.TimeoutExpired):
    return []
  return (
      [line.strip() for line in done.stdout.splitlines() if line.strip()]
      if done.returncode == 0
      else []
  )


def _cpu_model() -> str:
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        if line.startswith('model name'):
          return line.split(':', 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()
