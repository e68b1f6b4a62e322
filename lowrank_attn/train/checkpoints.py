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
"""

from collections.abc import Mapping
import json
import os
import signal
import threading
from typing import Any

from absl import logging
import jax
from jax.experimental import multihost_utils
import numpy as np
import orbax.checkpoint as ocp

# The run directory's layout and file writer are `lowrank_attn.runs`' (stdlib only there).
from lowrank_attn.runs import CHECKPOINT_DIR, CONFIG_FILE, write_atomic


def _gather_data_states(state: Mapping[str, Any]) -> dict[str, Any]:
  """`{process_index: pipeline state}` for all processes (each process only knows its own)."""
  if jax.process_count() == 1:
    return {'0': dict(state)}
  encoded = np.frombuffer(json.dumps(state).encode(), np.uint8)
  length = int(np.max(multihost_utils.process_allgather(np.array(encoded.size))))
  padded = np.zeros(length, np.uint8)
  padded[:encoded.size] = encoded
  gathered = multihost_utils.process_allgather(padded)
  return {str(i): json.loads(bytes(row).rstrip(b'\0').decode()) for i, row in enumerate(gathered)}


class Checkpointer:
  """Saves and restores (train state, data position) with an Orbax `CheckpointManager`."""

  def __init__(self, workdir: str, *, keep: int = 3, async_save: bool = True):
    if keep < 1:
      raise ValueError(f'config.keep_checkpoints={keep} must be >= 1.')
    self.directory = os.path.join(os.path.abspath(workdir), CHECKPOINT_DIR)
    options = ocp.CheckpointManagerOptions(
        preservation_policy=ocp.checkpoint_managers.LatestN(keep),
        enable_async_checkpointing=async_save,
        # Leftovers of a save interrupted by a kill are deleted, never restored.
        cleanup_tmp_directories=True,
        create=True)
    self._manager = ocp.CheckpointManager(
        self.directory, item_names=('state', 'data'), options=options)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state: Any, data_state: Mapping[str, Any]) -> bool:
    """Starts saving `state` at `step` (asynchronously); False if that step already exists.

    Returns once the arrays are copied off the devices, so the caller may donate `state`.
    """
    if step in self._manager.all_steps():
      return False
    return self._manager.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                data=ocp.args.JsonSave(_gather_data_states(data_state))),
        force=True)

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
    """The state at `step`, laid out as `abstract_state`'s shardings (any mesh), and this
    process's data position."""
    restored = self._manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                      data=ocp.args.JsonRestore()))
    data = restored['data']
    key = str(jax.process_index())
    if len(data) != jax.process_count() or key not in data:
      raise ValueError(
          f'checkpoint step {step} holds input positions of {len(data)} processes, but this run '
          f'has {jax.process_count()}: resume with the same number of hosts.')
    return restored['state'], data[key]

  def wait(self) -> None:
    """Blocks until pending asynchronous saves are committed."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def load_state(workdir: str, step: int | None = None) -> tuple[int, Any]:
  """`(step, state)` of a run's checkpoint (default: the latest) as host numpy arrays.

  For analysis and tests: no model, mesh or config needed.
  """
  directory = os.path.join(os.path.abspath(workdir), CHECKPOINT_DIR)
  handlers = {'state': ocp.StandardCheckpointHandler(), 'data': ocp.JsonCheckpointHandler()}
  with ocp.CheckpointManager(directory, item_handlers=handlers,
                             options=ocp.CheckpointManagerOptions(create=False)) as manager:
    step = manager.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f'no checkpoint in {directory}')
    metadata = manager.item_metadata(step)['state']
    # A numpy target: restored on the host, whatever mesh wrote it.
    target = jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), metadata)
    restored = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target)))
  return step, _int_keys(jax.tree.map(np.asarray, restored['state']))


def restore_params(workdir: str, step: int, abstract_params: Any) -> Any:
  """Only the parameters of a run's checkpoint (no optimizer state is read), laid out as
  `abstract_params`' shardings (ShapeDtypeStructs with shardings: any mesh)."""
  directory = os.path.join(os.path.abspath(workdir), CHECKPOINT_DIR)
  target = {'params': abstract_params}
  with ocp.CheckpointManager(directory, item_names=('state',),
                             options=ocp.CheckpointManagerOptions(create=False)) as manager:
    restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
        partial_restore=True)))
  return restored['state']['params']


def _int_keys(tree):
  """Orbax stores dict keys as strings; layer indices come back as the ints NNX uses."""
  if isinstance(tree, dict):
    return {int(k) if isinstance(k, str) and k.isdigit() else k: _int_keys(v)
            for k, v in tree.items()}
  return tree


def save_config(workdir: str, config_dict: Mapping[str, Any]) -> str:
  """Writes the run's config as JSON next to the checkpoints (primary process only)."""
  path = os.path.join(workdir, CONFIG_FILE)
  if jax.process_index() == 0:
    write_atomic(path, json.dumps(config_dict, indent=2, sort_keys=True, default=str))
  return path


class PreemptionWatcher:
  """Turns SIGTERM (TPU / Kubernetes preemption notice) into "save at the next step".

  Multi-host: every host must agree on the step, so JAX's distributed preemption sync point is
  used (it also listens for SIGTERM); single host: a local flag set by the signal handler.
  """

  def __init__(self):
    self._event = threading.Event()
    self._previous = None
    self._installed = False
    if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._handle)
      self._installed = True

  def _handle(self, signum, frame):
    del signum, frame
    logging.warning('SIGTERM received: saving a checkpoint after the current step, then exiting.')
    self._event.set()

  def reached(self, step: int) -> bool:
    if jax.process_count() > 1:
      return multihost_utils.reached_preemption_sync_point(step)
    return self._event.is_set()

  def close(self) -> None:
    if self._installed:
      signal.signal(signal.SIGTERM, self._previous or signal.SIG_DFL)
      self._installed = False
