"""Checks of a training command that need more than its config, made before any data is read.

`python -m lowrank_attn.main` runs `check(config, workdir)` after `config.validate(config)` and
before `train.train_and_evaluate`; `tpu/launch.py` runs the same checks on the laptop before
it creates a (paid) slice, with the slice's device count. Each failure is a `PreflightError`:
one line naming the setting, its value and what would be valid (the command exits with status
2). Without these checks each case failed later, most after data preparation, as a traceback:

  - data.name must be a data set the data package can find (not TFDS's 250-name list);
  - every data.extra_test_files file must exist;
  - the mesh must fit the devices (`sharding.mesh_shape`);
  - the workdir must be a directory, or one that can be made, and writable; a remote one
    (gs://...) must be a path epath can write: an object is written there and deleted;
  - num_train_steps must not be below the workdir's newest checkpoint (nothing would train).

The standard library only at the top: the workdir checks import nothing heavy.
"""

import os
import tempfile
import uuid

from lowrank_attn import files
from lowrank_attn.runs import CHECKPOINT_DIR


class PreflightError(ValueError):
  """A problem with the command's input that the user fixes: one line, exit status 2."""


def check(
    config, workdir: str, *, num_devices: int | None = None, local_paths: bool = True
) -> None:
  """All the checks, cheapest first; raises PreflightError at the first failure.

  Args:
    config: a config that `config.validate` accepted.
    workdir: the run directory (`--workdir`).
    num_devices: the devices the run will have; None: `jax.device_count()` here, except in a
      multi-process run (`config.jax_distributed`), whose devices are known only once the
      training loop has called `jax.distributed.initialize()` (which must come before any
      other JAX call): its mesh is not checked.
    local_paths: False where the run's paths are not this machine's (a launcher): the workdir
      and extra_test_files are not looked at.
  """
  if num_devices is None and not config.jax_distributed:
    import jax  # pylint: disable=import-outside-toplevel

    num_devices = jax.device_count()
  if num_devices is not None:
    check_mesh(config, num_devices)
  if local_paths:
    check_extra_test_files(config)
    check_workdir(workdir)
    check_checkpoint_steps(config, workdir)
  check_data_name(config, workdir)


def check_mesh(config, num_devices: int) -> None:
  from lowrank_attn import sharding  # pylint: disable=import-outside-toplevel

  try:
    sharding.mesh_shape(config.mesh.to_dict(), num_devices)
  except ValueError as e:
    raise PreflightError(str(e)) from None


def check_extra_test_files(
    config, base_dir: str | None = None, relative_only: bool = False
) -> None:
  """Every file of data.extra_test_files exists (relative paths: from `base_dir`, default the
  working directory, as the pipeline reads them; `relative_only`: absolute ones not looked at)."""
  from lowrank_attn.data import config as data_config  # pylint: disable=import-outside-toplevel

  splits = data_config.as_data_config(config.data).extra_test_splits(num_files=None)
  for name, split in splits.items():
    for path in split.removeprefix(data_config.FILE_SPLIT_PREFIX).split(':'):
      path = os.path.expanduser(path)
      if relative_only and os.path.isabs(path):
        continue
      full = os.path.join(base_dir or '', path)
      if not os.path.isfile(full):
        what = 'is a directory, not a file' if os.path.isdir(full) else 'does not exist'
        raise PreflightError(
            f'config.data.extra_test_files: {path!r} (test set {name!r}) ' f'{what}.'
        )


def check_checkpoint_steps(config, workdir: str) -> None:
  """num_train_steps is at least the newest checkpoint's step (a committed step directory under
  `<workdir>/checkpoints`); below it the run would train nothing and never evaluate."""
  directory = os.path.join(workdir, CHECKPOINT_DIR)
  if not files.isdir(directory):
    return
  steps = [int(name) for name in files.listdir(directory) if name.isdigit()]
  if steps and max(steps) > config.num_train_steps:
    raise PreflightError(
        f'num_train_steps={config.num_train_steps} is below the checkpoint at step '
        f'{max(steps)} in {directory}: rerun with num_train_steps >= {max(steps)}, or use a '
        'new --workdir.'
    )


def check_workdir(workdir: str) -> None:
  """The workdir is a directory or can be made one, and a file can be written in it.

  Written, not asked (`os.access`): root passes every permission check, yet not a read-only
  file system. A remote workdir (gs://...): `check_remote_workdir`.
  """
  if files.is_remote(workdir):
    check_remote_workdir(workdir)
    return
  path = os.path.abspath(workdir)
  if os.path.exists(path) and not os.path.isdir(path):
    raise PreflightError(f'--workdir={workdir} is a file, not a directory.')
  existing = path
  while not os.path.exists(existing):  # the directory the run would create its workdir in
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise PreflightError(f'--workdir={workdir} cannot be made: {existing} is a file.')
  try:
    fd, probe = tempfile.mkstemp(prefix='.write_test_', dir=existing)
    os.close(fd)
    os.unlink(probe)
  except OSError as e:
    where = '' if existing == path else f' (cannot create it in {existing})'
    raise PreflightError(f'--workdir={workdir} is not writable{where}: {e.strerror}.') from None


def check_remote_workdir(workdir: str) -> None:
  """A remote workdir: not an object (a file), and a probe object can be written in it and
  deleted, through epath as the run will write it. This reaches the bucket: it checks the
  scheme, that its file system package is installed (gs://: gcsfs, or TensorFlow), the
  credentials and the write permission. The local checks (a read-only disk, a parent that is
  a file) do not apply; what is not checked: the space left, or that the bucket is near the
  slice (cost and speed).
  """
  path = files.resolve(workdir)
  probe = os.path.join(path, f'.write_test_{uuid.uuid4().hex}')
  try:
    if files.isfile(path):
      raise PreflightError(f'--workdir={workdir} is an object (a file), not a directory.')
    files.write_atomic(probe, b'')
    files.remove(probe, missing_ok=True)
  except PreflightError:
    raise
  except Exception as e:  # pylint: disable=broad-except  (any file system's error, one line)
    reason = (str(e).strip().splitlines() or [''])[0][:300]
    hint = (
        ' (gs:// paths need gcsfs: pip install gcsfs)'
        if isinstance(e, ImportError) or 'gcsfs' in reason
        else ''
    )
    raise PreflightError(
        f'--workdir={workdir} is not writable: {type(e).__name__}: {reason}{hint}.'
    ) from None


def check_data_name(config, workdir: str) -> None:
  """data.name is one of ours, an official TFDS data set, or one prepared in tfds_data_dir."""
  from lowrank_attn.data import datasets  # pylint: disable=import-outside-toplevel

  tfds_data_dir = config.data.tfds_data_dir or datasets.default_tfds_data_dir(workdir)
  try:
    datasets.check_name(config.data.name, tfds_data_dir)
  except ValueError as e:
    raise PreflightError(str(e)) from None
