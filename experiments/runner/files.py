"""What the runner keeps on disk, and the one way it reads and writes those files.

An experiment folder holds `results.json`; a run directory (`<runs_dir>/<name>/`) holds
`log.txt`, `attempts.jsonl`, `LOCK`, `DONE` and what its command writes (our training CLI:
`metrics.jsonl`, `config.json`; any command: `result.json`). Every whole file the runner
writes goes through `write_text`, so no reader ever sees half of one.
"""

from collections.abc import Iterator, Mapping
import contextlib
import fcntl
import json
import os
import pathlib
from typing import Any

from lowrank_attn import runs

RESULTS_FILE = 'results.json'
DONE_FILE = 'DONE'
LOG_FILE = 'log.txt'
LOCK_FILE = 'LOCK'
ATTEMPTS_FILE = 'attempts.jsonl'
METRICS_FILE = 'metrics.jsonl'  # written by lowrank_attn.train.metrics.MetricWriter
RESULT_FILE = 'result.json'  # optional: whatever a command wants to report itself


def read_json(path: pathlib.Path) -> Any:
  try:
    return json.loads(path.read_text())
  except FileNotFoundError:
    return None


def read_jsonl(path: pathlib.Path) -> list[dict]:
  if not path.exists():
    return []
  out = []
  for line in path.read_text().splitlines():
    try:
      out.append(json.loads(line))
    except ValueError:  # cut short by a kill
      pass
  return out


def append_jsonl(path: pathlib.Path, entry: Mapping[str, Any]) -> None:
  with open(path, 'a') as f:
    f.write(json.dumps(entry) + '\n')


@contextlib.contextmanager
def results_lock(path: pathlib.Path) -> Iterator[None]:
  """Held while results.json at `path` is read, merged and written again: the lock is on its
  folder, since the file itself is replaced."""
  lock = os.open(path.parent, os.O_RDONLY)
  try:
    fcntl.flock(lock, fcntl.LOCK_EX)
    yield
  finally:
    os.close(lock)


def write_json(path: pathlib.Path, data: Any) -> None:
  write_text(path, dumps(data) + '\n')


def write_text(path: pathlib.Path, text: str) -> None:
  """Whole or not at all: a reader (or a kill) never sees a half-written file."""
  runs.write_atomic(path, text)


def write_bytes(path: pathlib.Path, data: bytes) -> None:
  """`write_text` for any file (a plot): whole or not at all."""
  runs.write_atomic(path, data)


def dumps(value: Any, indent: int = 0, width: int = 100) -> str:
  """Indented JSON with each short or flat object or list (a metrics line) on one line."""
  flat = json.dumps(value)
  if not isinstance(value, (dict, list)) or len(flat) + indent <= width:
    return flat
  if not any(
      isinstance(v, (dict, list)) for v in (value.values() if isinstance(value, dict) else value)
  ):
    return flat
  pad = ' ' * (indent + 1)
  if isinstance(value, dict):
    items = [f'{pad}{json.dumps(k)}: {dumps(v, indent + 1, width)}' for k, v in value.items()]
    return '{\n' + ',\n'.join(items) + '\n' + ' ' * indent + '}'
  items = [pad + dumps(v, indent + 1, width) for v in value]
  return '[\n' + ',\n'.join(items) + '\n' + ' ' * indent + ']'
