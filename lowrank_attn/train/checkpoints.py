"""Checkpoints: the only module that imports Orbax.

Layout: `<workdir>/checkpoints/<step>/{state,data}` plus `<workdir>/config.json`.
  state  the train state pytree (step, parameters, optimizer state), sharded arrays;
  data   every process's input-pipeline position (JSON), so a resumed run reads exactly the
         batches the interrupted run would have read next.

Why a resumed run is exact: a step directory only appears under its final name once Orbax has
finished writing it (it writes to `<step>.orbax-checkpoint-tmp-*` and renames on commit), so a
run killed mid-save leaves a temporary directory that is ignored and deleted at the next start
(`cleanup_tmp_directories`). The state and the data position are committed together in one step
directory, and dropout keys are `fold_in(seed, step)`, so nothing else needs saving.

Faults:
  a damaged step directory (a truncated array file, an empty directory, garbage JSON) is
    skipped at restore: the newest checkpoint that restores is used, and the damaged ones newer
    than it are moved, never deleted, to `<workdir>/damaged_checkpoints/<step>`, so that later
    saves of those steps do not collide with them (`Checkpointer.restore_latest`); a restore
    that fails is tried twice more first (RESTORE_RETRY_SECS), so a read error that goes away
    is not taken for damage;
  a failed save (disk full) stops the run at that save with one line naming it and the last
    good checkpoint (`CheckpointError`); old checkpoints are deleted only after a newer save
    has committed, so a failed save never costs the last good one (`Checkpointer.check`);
  two runs on one workdir: the first holds `<workdir>/lock` (`WorkdirLock`), the second stops.

A remote workdir (gs://...): Orbax writes it itself (epath, and TensorStore's GCS driver for
the arrays), committing a step by a `commit_success.txt` in it instead of a rename; the rest
(config.json, moving damaged steps aside, the lock) goes through `lowrank_attn.files`.
"""

from collections.abc import Mapping
import datetime
import errno
import fcntl
import json
import logging as std_logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any
import uuid

from absl import logging
import jax
from jax.experimental import multihost_utils
import numpy as np
import orbax.checkpoint as ocp

from lowrank_attn import files

# The run directory's layout and file writer are `lowrank_attn.runs`' (stdlib only there).
from lowrank_attn.runs import CHECKPOINT_DIR, CONFIG_FILE, write_atomic

DAMAGED_DIR = 'damaged_checkpoints'  # <workdir>/damaged_checkpoints/<step>: moved aside
# A checkpoint that fails to restore is tried again after each of these waits before it counts
# as damaged: a read error that goes away (EIO from a flaky disk, a GCS 503 past the client's own
# retries) must not cost the newest checkpoint. Damage fails every time, so this only delays it:
# 10 s for each step that does not restore (a checkpoint of another config, a garbled file).
RESTORE_RETRY_SECS = (2.0, 8.0)
LOCK_FILE = 'lock'  # <workdir>/lock: who runs in this workdir (`WorkdirLock`)


class CheckpointError(RuntimeError):
  """A save failed (the run stops at it), or no checkpoint of the run could be restored."""


class CheckpointMismatchError(ValueError):
  """The checkpoint is intact but does not fit this run (e.g. another number of hosts)."""


def _one_line(error: BaseException) -> str:
  """`Type: first line of the message`, at most 300 characters (Orbax and TensorStore errors
  run to many lines)."""
  text = str(error).strip().splitlines()
  text = text[0] if text else ''
  if isinstance(error, OSError) and error.errno is not None and error.strerror:
    text = f'[Errno {error.errno}] {error.strerror}' + (
        f': {error.filename!r}' if error.filename else ''
    )
  return f'{type(error).__name__}: {text[:300]}'


class _QuietBackgroundSaveErrors(std_logging.Filter):
  """Drops Orbax's own error logs (tracebacks) of a failed background save: `Checkpointer`
  reports the failure itself, in one line, when it stops the run."""

  def filter(self, record):
    if record.levelno < std_logging.ERROR or 'orbax' not in (record.pathname or ''):
      return True
    message = str(record.msg)
    return not (
        'Handler Commit operations' in message
        or 'Save Finalize thread' in message
        or 'Checkpointer failed' in message
    )


def _gather_data_states(state: Mapping[str, Any]) -> dict[str, Any]:
  """`{process_index: pipeline state}` for all processes (each process only knows its own)."""
  if jax.process_count() == 1:
    return {'0': dict(state)}
  encoded = np.frombuffer(json.dumps(state).encode(), np.uint8)
  length = int(np.max(multihost_utils.process_allgather(np.array(encoded.size))))
  padded = np.zeros(length, np.uint8)
  padded[: encoded.size] = encoded
  gathered = multihost_utils.process_allgather(padded)
  return {str(i): json.loads(bytes(row).rstrip(b'\0').decode()) for i, row in enumerate(gathered)}


class Checkpointer:
  """Saves and restores (train state, data position) with an Orbax `CheckpointManager`.

  Keeps the newest `keep` committed checkpoints. Orbax's own garbage collection is off: it
  deletes old steps when a save starts, before that save is known to have committed, so a
  failed save could leave none. Here old steps go only once a newer one has committed.
  """

  def __init__(self, workdir: str, *, keep: int = 3, async_save: bool = True):
    if keep < 1:
      raise ValueError(f'config.keep_checkpoints={keep} must be >= 1.')
    self.workdir = files.resolve(workdir)  # local: absolute; remote (gs://): as given
    self.directory = os.path.join(self.workdir, CHECKPOINT_DIR)
    self.keep = keep
    options = ocp.CheckpointManagerOptions(
        preservation_policy=ocp.checkpoint_managers.preservation_policy.PreserveAll(),
        enable_async_checkpointing=async_save,
        # Leftovers of a save interrupted by a kill are deleted, never restored.
        cleanup_tmp_directories=True,
        create=True,
    )
    self._manager = ocp.CheckpointManager(
        self.directory, item_names=('state', 'data'), options=options
    )
    self._pending: int | None = None  # the step of a save not yet known to have committed
    self.last_good: int | None = self._manager.latest_step()
    self._quiet = _QuietBackgroundSaveErrors()
    std_logging.getLogger('absl').addFilter(self._quiet)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state: Any, data_state: Mapping[str, Any]) -> bool:
    """Starts saving `state` at `step` (asynchronously); False if that step already exists.

    Returns once the arrays are copied off the devices, so the caller may donate `state`.
    Raises CheckpointError if this save, or the previous one, failed.
    """
    self._settle()  # Orbax waits for the previous save anyway; a failure of it stops here
    if step in self._manager.all_steps():
      return False
    try:
      started = self._manager.save(
          step,
          args=ocp.args.Composite(
              state=ocp.args.StandardSave(state),
              data=ocp.args.JsonSave(_gather_data_states(data_state)),
          ),
          force=True,
      )
    except Exception as e:  # the synchronous part (a synchronous save: all of it)
      raise CheckpointError(self._failed(step, e)) from e
    self._pending = step
    return started

  def check(self) -> None:
    """Raises CheckpointError if the save in flight has failed; never waits for one.

    Called between steps, so that a failed background save (disk full) stops the run at once,
    not at the next save."""
    if self._pending is not None and not self._manager.is_saving_in_progress():
      self._settle()

  def _settle(self) -> None:
    """Waits for the save in flight; on success deletes the steps beyond the newest `keep`."""
    if self._pending is None:
      return
    step, self._pending = self._pending, None
    try:
      self._manager.wait_until_finished()
    except Exception as e:
      raise CheckpointError(self._failed(step, e)) from e
    self.last_good = step
    for old in sorted(self._manager.all_steps())[: -self.keep]:
      self._manager.delete(old)

  def _failed(self, step: int, error: BaseException) -> str:
    last = (
        f'the last good checkpoint is step {self.last_good}'
        if self.last_good is not None
        else 'no checkpoint was committed'
    )
    hint = (
        ' (disk full: free space, then rerun to resume)'
        if (
            isinstance(error, OSError)
            and error.errno == errno.ENOSPC
            or 'No space left' in str(error)
        )
        else ''
    )
    return (
        f'saving checkpoint step {step} to {self.directory} failed: {_one_line(error)}'
        f'{hint}; {last}.'
    )

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
    """The state at `step`, laid out as `abstract_state`'s shardings (any mesh), and this
    process's data position."""
    restored = self._manager.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()
        ),
    )
    data = restored['data']
    key = str(jax.process_index())
    if not isinstance(data, Mapping) or any(not isinstance(v, Mapping) for v in data.values()):
      raise ValueError(f'the input positions are not a mapping of processes: {data!r:.100}')
    if len(data) != jax.process_count() or key not in data:
      raise CheckpointMismatchError(
          f'checkpoint step {step} holds input positions of {len(data)} processes, but this run '
          f'has {jax.process_count()}: resume with the same number of hosts.'
      )
    return restored['state'], data[key]

  def restore_latest(
      self, abstract_state: Any
  ) -> tuple[int | None, Any, dict[str, Any] | None, list[str]]:
    """`(step, state, data position, skipped)` of the newest checkpoint that restores; `(None,
    None, None, [])` if there is none.

    A checkpoint that fails to restore (damaged: a truncated array file, an empty or half-copied
    step directory, garbage JSON) is skipped, and once an older one has restored, every skipped
    one is moved to `<workdir>/damaged_checkpoints/<step>` (never deleted): a later save of that
    step must not collide with it, nor garbage collection remove it. `skipped` says, one line
    each, which step was skipped, why, and where it went. If no checkpoint restores (e.g. the
    config changed), nothing is moved and CheckpointError names each step's error.
    """
    failures = []
    for step in sorted(self._manager.all_steps(), reverse=True):
      try:
        state, data_state = self._restore_retrying(step, abstract_state)
        error = None
      except CheckpointMismatchError:
        raise
      except Exception as e:  # pylint: disable=broad-except  (damage of any kind)
        error = e
      if jax.process_count() > 1:  # every host read its own shards: all must have succeeded
        ok = multihost_utils.process_allgather(np.array(error is None))
        if error is None and not np.all(ok):
          error = RuntimeError('another host could not read its part')
      if error is None:
        skipped = [
            f'checkpoint step {s} is damaged ({reason}); skipped it and moved it to '
            f'{self._move_aside(s)}'
            for s, reason in failures
        ]
        if failures:
          if jax.process_count() > 1:
            multihost_utils.sync_global_devices('checkpoints: damaged moved aside')
          self._manager.reload()
        self.last_good = step
        return step, state, data_state, skipped
      failures.append((step, _one_line(error)))
    if failures:
      raise CheckpointError(
          f'no checkpoint in {self.directory} could be restored (if the config changed since '
          'they were written, rerun with the old config or use a new --workdir): '
          + '; '.join(f'step {s}: {reason}' for s, reason in failures)
      )
    return None, None, None, []

  def _restore_retrying(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
    """`restore`, tried again after each of RESTORE_RETRY_SECS; the last try's error is raised."""
    for wait in RESTORE_RETRY_SECS:
      try:
        return self.restore(step, abstract_state)
      except CheckpointMismatchError:
        raise
      except Exception as e:  # pylint: disable=broad-except  (transient or damage: tried again)
        logging.warning(
            'restoring checkpoint step %d failed (%s); trying again in %g s',
            step,
            _one_line(e),
            wait,
        )
        time.sleep(wait)
    return self.restore(step, abstract_state)

  def _move_aside(self, step: int) -> str:
    """Moves step directory `step` to `<workdir>/damaged_checkpoints/<step>[.<n>]` (process 0).

    Remote (GCS has no rename): copied, then deleted (`files.move`)."""
    base = os.path.join(self.workdir, DAMAGED_DIR, str(step))
    target, n = base, 1
    while files.exists(target):
      target, n = f'{base}.{n}', n + 1
    if jax.process_index() == 0:
      files.makedirs(os.path.dirname(target))
      files.move(os.path.join(self.directory, str(step)), target)
    return target

  def wait(self) -> None:
    """Blocks until pending asynchronous saves are committed (CheckpointError if one failed)."""
    self._settle()

  def close(self) -> None:
    """Waits for the save in flight (CheckpointError if it failed), then closes."""
    try:
      self._settle()
    finally:
      try:
        self._manager.close()
      except Exception:  # pylint: disable=broad-except  (the failure was reported above)
        pass
      std_logging.getLogger('absl').removeFilter(self._quiet)


def load_state(workdir: str, step: int | None = None) -> tuple[int, Any]:
  """`(step, state)` of a run's checkpoint (default: the latest) as host numpy arrays.

  For analysis and tests: no model, mesh or config needed.
  """
  directory = os.path.join(files.resolve(workdir), CHECKPOINT_DIR)
  handlers = {'state': ocp.StandardCheckpointHandler(), 'data': ocp.JsonCheckpointHandler()}
  with ocp.CheckpointManager(
      directory, item_handlers=handlers, options=ocp.CheckpointManagerOptions(create=False)
  ) as manager:
    step = manager.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f'no checkpoint in {directory}')
    metadata = manager.item_metadata(step)['state']
    # A numpy target: restored on the host, whatever mesh wrote it.
    target = jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), metadata)
    restored = manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))
    )
  return step, _int_keys(jax.tree.map(np.asarray, restored['state']))


def restore_params(workdir: str, step: int, abstract_params: Any) -> Any:
  """Only the parameters of a run's checkpoint (no optimizer state is read), laid out as
  `abstract_params`' shardings (ShapeDtypeStructs with shardings: any mesh)."""
  directory = os.path.join(files.resolve(workdir), CHECKPOINT_DIR)
  target = {'params': abstract_params}
  with ocp.CheckpointManager(
      directory, item_names=('state',), options=ocp.CheckpointManagerOptions(create=False)
  ) as manager:
    restored = manager.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(
                item=target,
                restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                partial_restore=True,
            )
        ),
    )
  return restored['state']['params']


def _int_keys(tree):
  """Orbax stores dict keys as strings; layer indices come back as the ints NNX uses."""
  if isinstance(tree, dict):
    return {
        int(k) if isinstance(k, str) and k.isdigit() else k: _int_keys(v) for k, v in tree.items()
    }
  return tree


def save_config(workdir: str, config_dict: Mapping[str, Any]) -> str:
  """Writes the run's config as JSON next to the checkpoints (primary process only)."""
  path = os.path.join(workdir, CONFIG_FILE)
  if jax.process_index() == 0:
    write_atomic(path, json.dumps(config_dict, indent=2, sort_keys=True, default=str))
  return path


class PreemptionWatcher:
  """Turns SIGTERM (TPU / Kubernetes preemption notice) and SIGINT (Ctrl-C) into "stop at the
  next safe point": between training steps (`reached`: the loop saves the state first), between
  evaluation batches (`requested`, polled by the evaluators through `EvalContext.check_stop`).
  A second signal exits at once, without waiting for anything (exit 128 + its number).

  Single host: a local flag set by the signal handler.

  Multi-host: every host must stop at the same safe point (each step and each evaluation batch
  is a collective), so JAX's distributed preemption sync point is used: JAX catches SIGTERM
  itself (on any host) and the hosts agree, through the coordination service, on a sync point
  one past the furthest call any of them has made. Its calls are numbered by a counter of safe
  points kept here, advanced at every `reached` and every `requested` call: every host makes
  the same calls in the same order (the steps, then each evaluation's batches), so the counter
  names the same safe point on every host, and an evaluation stops at the same batch on every
  host. Once the sync point is reached, every later call answers True without asking again
  (JAX's answers True only at the sync point itself). Ctrl-C on a host is passed on as a
  SIGTERM to its own process, so that JAX's service stops every host at one safe point too
  (exit 143 there); a second Ctrl-C exits that process at once.
  """

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.signum: int | None = None  # the first signal received (single host)
    self._previous = {}
    self._multihost = jax.process_count() > 1
    self._safe_points = 0  # multi-host: the calls of `reached` and `requested` so far
    self._synced = False  # multi-host: the preemption sync point was reached
    self._interrupted = False  # multi-host: a Ctrl-C was passed on as SIGTERM
    if threading.current_thread() is not threading.main_thread():
      return
    if not self._multihost:
      for signum in self.SIGNALS:
        self._previous[signum] = signal.signal(signum, self._handle)
    else:  # JAX's preemption service holds SIGTERM; only Ctrl-C is ours
      self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._interrupt_as_sigterm)

  def _interrupt_as_sigterm(self, signum, frame):
    """Multi-host Ctrl-C: a SIGTERM to this process, which JAX's preemption service turns into
    a stop of every host at one safe point."""
    del frame
    if self._interrupted:
      print('SIGINT again: exiting now, without saving.', file=sys.stderr, flush=True)
      os._exit(128 + signum)  # pylint: disable=protected-access
    self._interrupted = True
    logging.warning(
        'SIGINT received: passed on to the preemption service as SIGTERM: every host saves at '
        'the next safe point, then exits. Send it again to exit at once.'
    )
    os.kill(os.getpid(), signal.SIGTERM)

  def _handle(self, signum, frame):
    del frame
    name = signal.Signals(signum).name
    if self.signum is not None:
      print(f'{name} again: exiting now, without saving.', file=sys.stderr, flush=True)
      os._exit(128 + signum)  # pylint: disable=protected-access
    self.signum = signum
    logging.warning(
        '%s received: saving a checkpoint at the next step boundary (or stopping '
        'the evaluation), then exiting. Send it again to exit at once.',
        name,
    )

  @property
  def exit_status(self) -> int:
    """128 + the signal: 143 for SIGTERM, 130 for SIGINT (Ctrl-C). Multi-host: 143 (only
    SIGTERM is caught; JAX's service does not say which signal, so `signum` stays None)."""
    return 128 + (self.signum or signal.SIGTERM)

  def _sync_point(self) -> bool:
    """Multi-host: one more safe point; whether the hosts' preemption sync point is reached."""
    if not self._synced:
      self._safe_points += 1
      self._synced = multihost_utils.reached_preemption_sync_point(self._safe_points)
      if self._synced:
        logging.warning(
            'preemption notice (SIGTERM on a host): all hosts stop at this safe point (%d).',
            self._safe_points,
        )
    return self._synced

  def requested(self) -> bool:
    """Whether to stop the evaluation now, before its next batch (a safe point; multi-host:
    every host must call it at the same points)."""
    if self._multihost:
      return self._sync_point()
    return self.signum is not None

  def reached(self, step: int) -> bool:
    """Whether to stop before training step `step` (a safe point; multi-host: every host must
    call it at every step). Multi-host, `step` is not what is synced: the safe points are
    counted here (the evaluations' batches between steps are safe points too)."""
    del step
    if self._multihost:
      return self._sync_point()
    return self.signum is not None

  def close(self) -> None:
    for signum, previous in self._previous.items():
      signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
    self._previous = {}


class WorkdirBusyError(RuntimeError):
  """Another process runs in this workdir."""


class WorkdirLock:
  """One run per workdir, held by process 0 in `<workdir>/lock`, which names the holder's host,
  pid and start time.

  Local workdir: an exclusive `flock` on the file. The kernel releases it when the process ends
  however it ends (a crash, SIGKILL), so a stale file never blocks a later run.

  Remote workdir (gs://: no `flock`, and epath has no create-if-absent): a heartbeat object.
  The lock object (JSON: holder, a token, the holder's clock at its last heartbeat) is
  rewritten every `HEARTBEAT_SECS` by a thread of the holder and deleted on release. A start
  finding one whose heartbeat is less than `STALE_SECS` old refuses, as locally; an older one
  (its run was killed without releasing it: SIGKILL, a lost VM) is taken over, with a line
  saying so. After writing its own, a start waits `SETTLE_SECS` and reads the object back:
  if another start wrote over it meanwhile, the earlier writer refuses (GCS reads see the
  latest write). Not race-free: two starts whose write and read-back interleave within a
  write's latency could both go on, and the heartbeats compare two machines' clocks (NTP keeps
  them within a second or so). A run killed without releasing blocks the workdir for up to
  `STALE_SECS` (or delete the lock object).
  """

  HEARTBEAT_SECS = 60.0
  STALE_SECS = 300.0
  SETTLE_SECS = 2.0

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, LOCK_FILE)
    self._fd = None
    self._token = None  # remote: ours, in the lock object
    self._stop = threading.Event()
    self._heartbeat = None
    if jax.process_index() != 0:
      return
    now = datetime.datetime.now().astimezone().isoformat(timespec='seconds')
    holder = f'pid {os.getpid()} on host {socket.gethostname()}, started {now}'
    if files.is_remote(workdir):
      self._acquire_remote(workdir, holder)
      return
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
        os.close(fd)
        raise
      found = os.pread(fd, 1000, 0).decode(errors='replace').strip() or 'a process'
      os.close(fd)
      raise self._busy(workdir, found) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f'{holder}\n'.encode(), 0)
    self._fd = fd

  def _busy(self, workdir: str, holder: str) -> WorkdirBusyError:
    return WorkdirBusyError(
        f'{workdir} is in use by another run ({holder}, lock {self.path}); wait for it to '
        'end, stop it, or pass another --workdir.'
    )

  # ------------------------------------------------------------------------------ remote

  def _read(self) -> dict[str, Any] | None:
    """The lock object; None if there is none; {} if it is not one of ours (garbage)."""
    try:
      record = json.loads(files.read_text(self.path))
    except FileNotFoundError:
      return None
    except (ValueError, UnicodeDecodeError):
      return {}
    if not isinstance(record, dict) or not isinstance(record.get('heartbeat'), (int, float)):
      return {}
    return record

  def _write(self, holder: str) -> None:
    record = {'holder': holder, 'token': self._token, 'heartbeat': time.time()}
    files.write_atomic(self.path, json.dumps(record) + '\n')

  def _acquire_remote(self, workdir: str, holder: str) -> None:
    found = self._read()
    if found:
      age = time.time() - found['heartbeat']
      if age < self.STALE_SECS:
        raise self._busy(workdir, self._describe(found, age))
    if found is not None:
      what = self._describe(found, age) if found else 'unreadable'
      print(f'taking over the stale lock {self.path} ({what})', flush=True)
    self._token = uuid.uuid4().hex
    self._write(holder)
    self._after_write()
    again = self._read()
    if not again or again.get('token') != self._token:  # another start wrote after us
      self._token = None
      age = time.time() - again['heartbeat'] if again else 0.0
      raise self._busy(workdir, self._describe(again, age) if again else 'another start')
    self._heartbeat = threading.Thread(
        target=self._beat, args=(holder,), name='workdir lock heartbeat', daemon=True
    )
    self._heartbeat.start()

  def _after_write(self) -> None:
    """Gives a concurrent start time to write over the lock object (then read back)."""
    time.sleep(self.SETTLE_SECS)

  def _describe(self, record: dict[str, Any], age: float) -> str:
    return (
        f'{record.get("holder", "a process")}; last heartbeat {age:.0f} s ago, taken over '
        f'after {self.STALE_SECS:.0f} s'
    )

  def _beat(self, holder: str) -> None:
    while not self._stop.wait(self.HEARTBEAT_SECS):
      try:
        found = self._read()
        if found is not None and found.get('token') != self._token:
          logging.warning(
              'the lock %s was taken over by another run (%s): two runs may now share this '
              'workdir; stop one of them.',
              self.path,
              (found or {}).get('holder', 'unreadable'),
          )
          return
        self._write(holder)
      except Exception as e:  # pylint: disable=broad-except  (retried at the next beat)
        logging.warning('the lock heartbeat to %s failed: %s', self.path, _one_line(e))

  def release(self) -> None:
    """Unlocks. Local: the file stays (deleting it would race with a run opening it). Remote:
    the heartbeat stops and the lock object is deleted if it is still ours."""
    if self._fd is not None:
      fcntl.flock(self._fd, fcntl.LOCK_UN)
      os.close(self._fd)
      self._fd = None
    if self._token is not None:
      self._stop.set()
      if self._heartbeat is not None:
        self._heartbeat.join()
      try:
        found = self._read()
        if found and found.get('token') == self._token:
          files.remove(self.path, missing_ok=True)
      except Exception as e:  # pylint: disable=broad-except  (stale in STALE_SECS anyway)
        logging.warning('could not delete the lock %s: %s', self.path, _one_line(e))
      self._token = None
