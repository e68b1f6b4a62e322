"""Files of a run directory, local or remote: the one place that knows the difference.

A remote path is any `scheme://...` path (`gs://BUCKET/...` in practice); it goes through
`etils.epath` (imported on first use), which reads and writes gs:// with gcsfs (or TensorFlow,
where installed). Local paths go through `os` as they always did. What differs on GCS, and
what the functions here do about it:

  no rename     an object write is atomic (readers see the old object or the new, never half
                of one), so `write_atomic` writes the object directly; `move` is a copy, then a
                delete: not atomic (a kill in between leaves both copies; nothing is lost);
  no append     `train.metrics.MetricWriter` keeps a local mirror of metrics.jsonl and the
                TensorBoard files and uploads whole files (`upload`) at every flush;
  no flock      `train.checkpoints.WorkdirLock` keeps a heartbeat object instead;
  local disk    what is read as local files (TFDS's ArrayRecord files, the encoded rows, the
                metric mirror) goes to `local_dir(workdir)`: a directory on this machine.

The standard library only at the top (`runs` and `translate` check a directory without
importing JAX; epath is imported on the first remote call).
"""

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import uuid

# `$LOWRANK_ATTN_CACHE` or this: the root of the local directories of remote runs.
CACHE_ENV = 'LOWRANK_ATTN_CACHE'
DEFAULT_CACHE = os.path.join('~', '.cache', 'lowrank_attn')

_SCHEME = re.compile(r'[A-Za-z][A-Za-z0-9+.-]*://')


def is_remote(path: str | os.PathLike) -> bool:
  """Whether `path` is a `scheme://` path (gs://, s3://, ...), not a local one."""
  return bool(_SCHEME.match(os.fspath(path)))


def resolve(path: str | os.PathLike) -> str:
  """A run directory as the loop uses it: local paths made absolute (`os.path.abspath`, as
  before), remote ones unchanged but for a trailing '/'."""
  path = os.fspath(path)
  if is_remote(path):
    scheme, rest = path.split('://', 1)
    return f'{scheme}://{rest.rstrip("/")}'
  return os.path.abspath(path)


def _epath(path):
  from etils import epath  # pylint: disable=import-outside-toplevel

  return epath.Path(os.fspath(path))


def exists(path: str | os.PathLike) -> bool:
  return _epath(path).exists() if is_remote(path) else os.path.exists(path)


def isdir(path: str | os.PathLike) -> bool:
  """A directory; remote: a prefix holding objects (GCS has no directories)."""
  return _epath(path).is_dir() if is_remote(path) else os.path.isdir(path)


def isfile(path: str | os.PathLike) -> bool:
  if is_remote(path):
    p = _epath(path)
    return p.exists() and not p.is_dir()
  return os.path.isfile(path)


def makedirs(path: str | os.PathLike) -> None:
  """`os.makedirs(path, exist_ok=True)`; remote: epath's (on GCS nothing to make)."""
  if is_remote(path):
    _epath(path).mkdir(parents=True, exist_ok=True)
  else:
    os.makedirs(path, exist_ok=True)


def listdir(path: str | os.PathLike) -> list[str]:
  """The names in a directory (not paths)."""
  if is_remote(path):
    return [p.name for p in _epath(path).iterdir()]
  return os.listdir(path)


def read_bytes(path: str | os.PathLike) -> bytes:
  if is_remote(path):
    return _epath(path).read_bytes()
  with open(path, 'rb') as f:
    return f.read()


def read_text(path: str | os.PathLike) -> str:
  return read_bytes(path).decode('utf-8')


def remove(path: str | os.PathLike, missing_ok: bool = False) -> None:
  try:
    if is_remote(path):
      _epath(path).unlink()
    else:
      os.unlink(path)
  except FileNotFoundError:
    if not missing_ok:
      raise


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
  """Writes `data` (text as UTF-8) to `path`: readers see the old file or the new, never half.

  Local: written to a uniquely named temporary file in the same directory (same file system,
  so the rename is atomic; unique, so concurrent writers do not mix), flushed to disk, then
  renamed over `path`; the directory must exist. Remote: one object write, which GCS makes
  atomic by itself (a rename there would be a copy and a delete).
  """
  data = data.encode('utf-8') if isinstance(data, str) else data
  if is_remote(path):
    _epath(path).write_bytes(data)
    return
  path = os.fspath(path)
  directory, name = os.path.split(os.path.abspath(path))
  tmp = os.path.join(directory, f'.{name}.{uuid.uuid4().hex}.tmp')
  # os.open with mode 0o666 leaves permissions to the umask, as open() does (mkstemp: 0600).
  fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
  try:
    with os.fdopen(fd, 'wb') as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def upload(local_path: str | os.PathLike, path: str | os.PathLike) -> None:
  """Copies local file `local_path` to `path` (remote: one object write; local: atomic)."""
  with open(local_path, 'rb') as f:
    write_atomic(path, f.read())


def download(path: str | os.PathLike, local_path: str | os.PathLike) -> bool:
  """Copies `path` to local file `local_path` (written, then renamed); False, and nothing
  written, if `path` does not exist."""
  try:
    data = read_bytes(path)
  except FileNotFoundError:
    return False
  os.makedirs(os.path.dirname(os.path.abspath(local_path)), exist_ok=True)
  write_atomic(local_path, data)
  return True


def move(source: str | os.PathLike, target: str | os.PathLike) -> None:
  """Moves file or directory `source` to `target` (which must not exist).

  Local to local: `shutil.move` (a rename on one file system). Otherwise (GCS has no rename):
  every file is copied, then `source` is deleted: not atomic, a kill in between leaves both
  (the copy may be partial; `source` is still whole)."""
  if not is_remote(source) and not is_remote(target):
    shutil.move(os.fspath(source), os.fspath(target))
    return
  _copy_tree(os.fspath(source), os.fspath(target))
  if is_remote(source):
    p = _epath(source)
    if p.is_dir():
      p.rmtree()
    else:
      p.unlink()
  elif os.path.isdir(source):
    shutil.rmtree(source)
  else:
    os.unlink(source)


def _copy_tree(source: str, target: str) -> None:
  if isdir(source):
    makedirs(target)
    for name in listdir(source):
      _copy_tree(os.path.join(source, name), os.path.join(target, name))
  else:
    write_atomic(target, read_bytes(source))


def local_dir(workdir: str | os.PathLike) -> str:
  """Where a run keeps what must be on this machine's disk: the workdir itself when it is
  local; for a remote one, a directory of this machine named after it:
  `$LOWRANK_ATTN_CACHE/runs/<bucket_path>-<hash>` (default root `~/.cache/lowrank_attn`).

  Its default `tfds/` (prepared data), `encoded/` (encoded rows) and, for process 0, the
  mirror of the metric files live there. Workers of a TPU slice share no disk: each has its
  own, and a slice recreated after preemption starts with an empty one (it is a cache).
  """
  workdir = os.fspath(workdir)
  if not is_remote(workdir):
    return workdir
  workdir = resolve(workdir)
  readable = re.sub(r'[^A-Za-z0-9_.-]+', '_', workdir.split('://', 1)[1]).strip('_')[-80:]
  digest = hashlib.sha256(workdir.encode()).hexdigest()[:10]
  root = os.path.expanduser(os.environ.get(CACHE_ENV) or DEFAULT_CACHE)
  return os.path.join(os.path.abspath(root), 'runs', f'{readable}-{digest}')


@contextlib.contextmanager
def local_lock(directory: str | os.PathLike | None, name: str = '.prepare.lock'):
  """An exclusive `flock` on `<directory>/<name>` for the duration of the block (None, or a
  remote directory: no lock). Processes of one machine that share a directory take turns:
  the first prepares what goes there, the next ones wait and then find it prepared."""
  if directory is None or is_remote(directory):
    yield
    return
  os.makedirs(directory, exist_ok=True)
  fd = os.open(os.path.join(directory, name), os.O_RDWR | os.O_CREAT, 0o666)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)
    yield
  finally:
    os.close(fd)  # (releases the lock)
