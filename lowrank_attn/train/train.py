"""`train_and_evaluate(config, workdir)`: the sharded training loop.

The steps are pure functions (`lowrank_attn.train.steps`), compiled before the loop from the
pipelines' `element_spec` with explicit shardings (`lowrank_attn.train.state`).

Exactness of resume rests on: the dropout key of step s is `fold_in(key(seed + 1), s)`; the
input position is checkpointed with the state; a NaN/inf step is detected before any
checkpoint after it is written (metrics are checked before every save).

Stopping: SIGTERM (preemption) or SIGINT (Ctrl-C) is honoured in every phase: between training
steps the state is saved; during an evaluation (periodic or final) the evaluators stop between
batches, the state of that step is saved (if it is not already) and the evaluation reruns when
the run resumes. A run is finished when its final evaluation is recorded
(`final_eval/<num_train_steps>/metrics.json`); started again, it says so and does nothing.

The workdir may be remote (`gs://BUCKET/run`): every file of it is read and written through
`lowrank_attn.files` (epath), the metric files through a local mirror (`metrics.MetricWriter`),
the lock is a heartbeat object (`checkpoints.WorkdirLock`), and what must be on local disk
(prepared data, encoded rows) goes to a directory of each machine (`files.local_dir`).
"""

import dataclasses
import json
import math
import os
from typing import Any, Sequence

from absl import logging
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import ml_collections
import numpy as np

from lowrank_attn import data as data_lib
from lowrank_attn import files, sharding, tasks as tasks_lib
from lowrank_attn.tasks.base import EvalStopped
from lowrank_attn.train import checkpoints, config as config_lib, metrics as metrics_lib
from lowrank_attn.train import state as state_lib

PyTree = Any


class NonFiniteError(FloatingPointError):
  """The loss, the gradient norm or (before a save) a parameter became NaN/inf; the run stopped
  without saving that state."""


class Preempted(Exception):
  """SIGTERM (preemption) or SIGINT (Ctrl-C): the checkpoint of `step` is committed and the run
  stopped; `exit_status` is 128 + the signal (143 or 130)."""

  def __init__(
      self,
      step: int,
      directory: str,
      *,
      during: str = '',
      exit_status: int = 143,
      saved: bool = True,
  ):
    what = 'interrupted' if exit_status == 130 else 'preempted'
    where = f' ({during})' if during else ''
    if saved:
      message = (
          f'{what}: saved step {step} to {directory}{where}; rerun the same command ' 'to resume.'
      )
    else:
      message = f'{what} before the first step{where}: nothing to save.'
    super().__init__(message)
    self.step = step
    self.exit_status = exit_status


@dataclasses.dataclass(frozen=True)
class Due:
  """What happens after a step."""

  log: bool  # train metrics to TensorBoard / metrics.jsonl
  show: bool  # the console progress line
  save: bool  # a checkpoint
  eval: bool  # evaluation (and BLEU)

  @classmethod
  def after(cls, config, done: int, first: bool, show: bool) -> 'Due':
    every = lambda n: bool(n) and done % n == 0
    last = done == config.num_train_steps
    return cls(
        log=every(config.log_every_steps) or last or first,
        show=show or last or first,
        save=every(config.checkpoint_every_steps) or last,
        eval=every(config.eval_every_steps) or last,
    )

  @property
  def anything(self) -> bool:
    return self.log or self.show or self.save or self.eval


def _initialize_distributed(config) -> None:
  """`jax.distributed.initialize()` with the config's cluster, or auto-detected."""
  if not config.jax_distributed:
    return
  explicit = {
      name: config[name]
      for name in ('coordinator_address', 'num_processes', 'process_id')
      if config[name] is not None
  }
  try:
    jax.distributed.initialize(**explicit)
  except (ValueError, RuntimeError) as e:
    if explicit:  # a cluster was named: running without it would be wrong
      raise
    # Nothing to detect (a workstation): a single host is fine.
    logging.warning('jax.distributed.initialize() failed (%s); continuing as a single host.', e)


def _peak_flops(config, dtype, num_devices: int) -> metrics_lib.PeakFlops | None:
  """Peak FLOP/s of the run's `num_devices` devices, saying where the per-device figure came
  from: the config or the device's published peak (`metrics.peak_flops_per_device`); None
  without either."""
  per_device = config.peak_flops_per_device
  if per_device is None:
    per_device = metrics_lib.peak_flops_per_device(dtype)
    if per_device is None:  # CPU: achieved FLOP/s only, no MFU
      return None
  else:
    per_device = metrics_lib.PeakFlops(per_device, 'config.peak_flops_per_device')
  return metrics_lib.PeakFlops(
      per_device * num_devices,
      f'{num_devices} x {per_device / 1e9:,.0f} GFLOP/s, ' f'{per_device.source}',
  )


def _host_metrics(
    pending: list[tuple[int, dict[str, jax.Array]]], directory: str, last_saved: int | None
) -> list[tuple[int, dict[str, float]]]:
  """Fetches queued step metrics; raises NonFiniteError at the first NaN/inf step."""
  fetched = jax.device_get(pending)
  pending.clear()
  out = []
  for step, values in fetched:
    values = {k: float(v) for k, v in values.items()}
    bad = {k: values[k] for k in ('loss', 'objective', 'grad_norm') if not math.isfinite(values[k])}
    if bad:
      saved = _last_good(last_saved, directory)
      raise NonFiniteError(
          f'step {step}: non-finite {", ".join(f"{k}={v}" for k, v in bad.items())}; stopping '
          f'the run ({saved}). Lower the learning rate, raise warmup_steps or enable '
          'grad_clip_norm.'
      )
    out.append((step, values))
  return out


def _last_good(step: int | None, directory: str) -> str:
  if step is None:
    return 'no checkpoint was written'
  return f'the last good checkpoint is step {step} in {directory}'


@jax.jit
def _all_finite(tree) -> jax.Array:
  return jax.tree.reduce(lambda ok, x: ok & jnp.all(jnp.isfinite(x)), tree, jnp.bool_(True))


def _check_before_saving(state, step: int, checkpointer: checkpoints.Checkpointer) -> None:
  """NonFiniteError if `state`'s parameters are not all finite. The step metrics see the
  parameters before each update; an update can still make them inf/NaN (a learning rate that
  overflows float32, adam_eps=0 on a zero gradient), and that state must not become the newest
  checkpoint, which resumes and garbage collection trust."""
  if bool(_all_finite(state['params'])):
    return
  checkpointer.wait()  # a save in flight (of parameters checked before it) commits first
  saved = _last_good(checkpointer.last_good, checkpointer.directory)
  raise NonFiniteError(
      f'step {step}: non-finite parameters after the update; stopping the run without saving '
      f'them ({saved}). Lower the learning rate, check adam_eps > 0, or enable grad_clip_norm.'
  )


def _summarise(host: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
  """Mean of each metric over steps, tokens summed."""
  summary = {k: float(np.mean([v[k] for _, v in host])) for k in host[0][1]}
  summary['tokens'] = float(np.sum([v['tokens'] for _, v in host]))
  return summary


def train_and_evaluate(
    config: ml_collections.ConfigDict, workdir: str, *, devices: Sequence[Any] | None = None
) -> dict[str, Any]:
  """Trains (resuming from the newest intact checkpoint in `<workdir>/checkpoints`) and
  evaluates; one run per workdir (`checkpoints.WorkdirLock`).

  Returns `{'step', 'train': last train metrics, 'eval': last eval metrics, 'throughput':
  steps/s, tokens/s and MFU of the timed steps, 'vocab_size', 'final': {split name: metrics}}`.
  'final' is the evaluation at num_train_steps (`_evaluate_final`): the task's final splits
  (`Task.final_splits`: validation and test for translation, validation for GLUE) and every
  `data.extra_test_files` entry (each under its name, also in metrics.jsonl as that split).
  A finished run (its final evaluation recorded) returns at once `{'step', 'final',
  'already_finished': True}` and empty 'train', 'eval', 'throughput'.
  Raises `NonFiniteError` on a NaN/inf loss or gradient norm, `Preempted` after SIGTERM or
  SIGINT, `checkpoints.CheckpointError` when a save fails or no checkpoint restores,
  `checkpoints.WorkdirBusyError` when another process runs in `workdir`.

  `devices`: the devices the run's mesh spans (config.mesh resolves against their number;
  the global batch is per_device_batch_size rows on each); None: all of them (`jax.devices()`).
  """
  config_lib.validate(config)
  _initialize_distributed(config)
  workdir = files.resolve(workdir)  # local: absolute; remote (gs://...): as given
  files.makedirs(workdir)
  lock = checkpoints.WorkdirLock(workdir)  # before any data work: a second run stops here
  try:
    tensorboard = os.path.join(workdir, metrics_lib.TENSORBOARD_DIR)
    metrics_lib.say(f'run directory {workdir}; TensorBoard: tensorboard --logdir {tensorboard}')
    finished = _finished(config, workdir)
    if finished is not None:
      return finished
    return _train_and_evaluate(config, workdir, jax.devices() if devices is None else devices)
  finally:
    lock.release()


def _finished(config, workdir: str) -> dict[str, Any] | None:
  """The result of a finished run (its final evaluation recorded), read without building
  anything (no data, no compile); None if the run is not finished."""
  step = config.num_train_steps
  recorded = _recorded_final(workdir, step, list(_final_splits(config)))
  if recorded is None:
    return None
  path = os.path.join(workdir, FINAL_EVAL_DIR, str(step), 'metrics.json')
  metrics_lib.say(
      f'already finished at step {step}: nothing to do (its final evaluation: ' f'{path}).'
  )
  return {
      'step': step,
      'train': {},
      'eval': {},
      'throughput': {},
      'final': recorded,
      'already_finished': True,
  }


def _train_and_evaluate(config, workdir: str, devices: Sequence[Any]) -> dict[str, Any]:

  # A micro-batch is per_device_batch_size rows per device; a step takes grad_accum_steps.
  batch_size = config.per_device_batch_size * len(devices)
  pipeline = lambda split, train, rows: tasks_lib.make_pipeline(
      config.data,
      split=split,
      seed=config.seed,
      global_batch_size=rows,
      train=train,
      workdir=workdir,
      process_index=jax.process_index(),
      process_count=jax.process_count(),
  )
  train_data = pipeline('train', True, batch_size * config.grad_accum_steps)
  eval_data = pipeline(config.eval_split, False, batch_size)
  # Built now, so that a missing split or a bad extra_test_files path fails before training.
  final_data = {
      name: eval_data if split == config.eval_split else pipeline(split, False, batch_size)
      for name, split in _final_splits(config).items()
  }
  tokenizer = train_data.tokenizer
  s = state_lib.setup(
      config, vocab_size=tokenizer.vocab_size, bos_id=tokenizer.bos_id, devices=devices
  )
  metrics_lib.say(
      f'mesh {dict(s.mesh.shape)} on {len(devices)} '
      f'{devices[0].platform} devices, {jax.process_count()} process(es); '
      f'global batch {train_data.global_batch_size}'
  )
  train_step, eval_step = state_lib.compile_steps(
      s, train_data.element_spec, eval_data.element_spec, jax.process_count()
  )

  checkpointer = checkpoints.Checkpointer(
      workdir, keep=config.keep_checkpoints, async_save=config.async_checkpointing
  )
  writer = metrics_lib.MetricWriter(workdir)
  preemption = checkpoints.PreemptionWatcher()
  evaluators = s.task.make_evaluators(
      tasks_lib.EvalContext(s, eval_step, tokenizer, stop_requested=preemption.requested)
  )
  try:
    state, start_step = _start(s, checkpointer, train_data, writer)
    # Written once the checkpoints are known to fit this config: a rerun refused for another
    # config leaves the one they were written with.
    checkpoints.save_config(workdir, config_lib.to_dict(config))
    evaluate_all = lambda params: _evaluate_all(
        evaluators, params, eval_data, config.num_eval_steps
    )
    result, state = _train_loop(
        s, state, start_step, train_step, evaluate_all, train_data, checkpointer, writer, preemption
    )
    step = result['step']
    result['final'] = {}
    if step == config.num_train_steps:
      # The final checkpoint committed first: a recorded final evaluation marks the run as
      # finished, and a rerun would never write a checkpoint whose save failed.
      checkpointer.wait()
      # Not yet recorded: the first time, or a run stopped during its final evaluation. With
      # no split to evaluate it records {}: the mark of a finished run (`_finished`).
      recorded = _recorded_final(workdir, step, list(final_data))
      if recorded is None:
        try:
          recorded = _evaluate_final(evaluators, state['params'], final_data, workdir, step, writer)
        except EvalStopped:
          raise _stop(
              preemption,
              checkpointer,
              step,
              state,
              train_data,
              'during the final evaluation, which reruns on resume',
          ) from None
      result['final'] = recorded
      tensorboard = os.path.join(workdir, metrics_lib.TENSORBOARD_DIR)
      metrics_lib.say(
          f'finished at step {step}: outputs in {workdir}; TensorBoard: '
          f'tensorboard --logdir {tensorboard}'
      )
    return result
  finally:
    try:
      checkpointer.close()  # waits for an in-flight save: the last good checkpoint is complete
    finally:
      writer.close()
      preemption.close()  # last: a second signal while waiting above still exits at once


def _stop(preemption, checkpointer, step: int, state, train_data, during: str) -> Preempted:
  """After a stop request: saves `state` as step `step` (unless that step is committed or being
  saved already), waits until it is committed; the exception to raise."""
  _check_before_saving(state, step, checkpointer)
  checkpointer.save(step, state, train_data.get_state())
  checkpointer.wait()
  return Preempted(step, checkpointer.directory, during=during, exit_status=preemption.exit_status)


def _start(s, checkpointer, train_data, writer):
  """(state, first step): restored from the newest intact checkpoint (damaged newer ones are
  skipped and moved aside, one line each), or created (warm-started)."""
  latest, state, data_state, skipped = checkpointer.restore_latest(s.abstract_state)
  for line in skipped:
    metrics_lib.say(line)
  if latest is None:
    writer.write_hparams(config_lib.to_dict(s.config))  # once per run, not per resume
    state = state_lib.create_state(s)
  elif latest > s.config.num_train_steps:
    raise ValueError(
        f'num_train_steps={s.config.num_train_steps} is below the checkpoint at step {latest} '
        f'in {checkpointer.directory}: nothing would train, and no final evaluation would run. '
        'Rerun with num_train_steps >= that step, or use a new --workdir.'
    )
  else:
    train_data.set_state(data_state)
    metrics_lib.say(f'resumed from step {latest} ({checkpointer.directory})')
  metrics_lib.say(
      f'model: {s.config.task}, '
      f'{sharding.describe(state["params"], s.state_shardings["params"])}'
  )
  metrics_lib.say(f'numerics: {s.model_cfg.describe_numerics()}')
  return state, latest or 0


def _progress(s, train_data) -> metrics_lib.Progress:
  config = s.config
  shapes = state_lib.element_shapes(train_data.element_spec, jax.process_count())
  flops_per_step = s.step_flops(shapes)
  peak = _peak_flops(config, s.model_cfg.compute_dtype, s.mesh.size)
  metrics_lib.say(
      f'{flops_per_step / 1e9:.2f} GFLOP per step (3x forward matmuls), '
      f'{metrics_lib.describe_peak(peak)}'
  )
  return metrics_lib.Progress(
      num_train_steps=config.num_train_steps,
      tokens_per_step=int(np.prod(shapes['inputs'][:2])),
      flops_per_step=flops_per_step,
      peak_flops=peak,
      every_secs=config.progress_every_secs,
  )


def _train_loop(
    s, state, start_step, train_step, evaluate_all, train_data, checkpointer, writer, preemption
):
  config = s.config
  progress = _progress(s, train_data)
  dropout_key = jax.random.key(config.seed + 1)
  pending: list[tuple[int, dict]] = []  # step metrics not yet fetched to the host
  last_train: dict[str, float] = {}
  # Step metrics since the last logged step: a logged train mean covers the steps since the
  # previous log, however many fetches (saves, evaluations, progress lines) came between.
  unlogged: list[tuple[int, dict[str, float]]] = []
  last_eval: dict[str, float] = {}
  last_saved = start_step or None
  stop = lambda step, during: _stop(preemption, checkpointer, step, state, train_data, during)
  if (
      start_step
      and Due.after(config, start_step, first=False, show=False).eval
      and (not _eval_recorded(checkpointer.workdir, start_step))
  ):
    # The run stopped (or was killed) during this step's evaluation: it is done now.
    metrics_lib.say(
        f'evaluating step {start_step}: the run stopped before its evaluation ' 'was recorded'
    )
    try:
      last_eval = evaluate_all(state['params'])
    except EvalStopped:
      raise stop(
          start_step, f'during the evaluation at step {start_step}, which reruns ' 'on resume'
      ) from None
    writer.write_scalars(start_step, 'eval', last_eval)
    writer.flush()
    metrics_lib.say(
        f'eval at step {start_step}: ' + '  '.join(f'{k} {v:.4g}' for k, v in last_eval.items())
    )
  progress.resume()
  for step in range(start_step, config.num_train_steps):
    checkpointer.check()  # a failed background save (disk full) stops the run here
    if preemption.reached(step):
      progress.pause()
      _host_metrics(pending, checkpointer.directory, last_saved)
      if step == 0:  # nothing trained yet: nothing to save
        raise Preempted(0, checkpointer.directory, exit_status=preemption.exit_status, saved=False)
      raise stop(step, f'at step {step}' if step > start_step else 'before its first step')
    if len(pending) >= config.max_steps_in_flight:  # bound how far dispatch runs ahead
      jax.block_until_ready(pending[-config.max_steps_in_flight][1])
    batch = s.global_batch(next(train_data))
    with s.activate():
      state, step_metrics = train_step(state, batch, dropout_key)
    done = step + 1
    pending.append((done, step_metrics))
    progress.count()

    due = Due.after(config, done, first=step == start_step, show=progress.due(done))
    if not due.anything:
      continue
    host = _host_metrics(pending, checkpointer.directory, last_saved)  # waits for the step
    progress.pause()
    unlogged += host
    rates = progress.take_window()
    if rates:  # real (non-padding) tokens, from the steps' own counts
      rates['tokens_per_sec'] = _summarise(host)['tokens'] * rates['steps_per_sec'] / len(host)
    if due.log:
      last_train = _summarise(unlogged)
      unlogged.clear()
      writer.write_scalars(
          done, 'train', {**last_train, **rates, 'train_secs': progress.train_secs}
      )
    if due.show:
      progress.show(done, host[-1][1]['loss'], rates)
    if due.save:
      _check_before_saving(state, done, checkpointer)
      checkpointer.save(done, state, train_data.get_state())
      last_saved = done
    if due.eval:
      try:
        last_eval = evaluate_all(state['params'])
      except EvalStopped:
        raise stop(
            done, f'during the evaluation at step {done}, which reruns on ' 'resume'
        ) from None
      writer.write_scalars(done, 'eval', last_eval)
      metrics_lib.say(
          f'eval at step {done}: ' + '  '.join(f'{k} {v:.4g}' for k, v in last_eval.items())
      )
    writer.flush()
    progress.resume()

  total = progress.rates(window=False)
  if total:
    metrics_lib.say(
        f'done: {total["steps_per_sec"]:.2f} steps/s, '
        f'{metrics_lib.format_throughput(total)} '
        '(evaluation and checkpointing excluded)'
    )
  return {
      'step': int(jax.device_get(state['step'])),
      'train': last_train,
      'eval': last_eval,
      'throughput': total,
      'vocab_size': s.model_cfg.vocab_size,
  }, state


def _evaluate_all(evaluators, params, pipeline, num_batches: int) -> dict[str, float]:
  """Every evaluator of the task on config.eval_split (up to num_eval_steps batches)."""
  results = {}
  for evaluator in evaluators:
    results.update(evaluator.evaluate(params, pipeline, num_batches))
  return results


# ------------------------------------------------------------------ evaluation at the end

FINAL_EVAL_DIR = 'final_eval'  # <workdir>/final_eval/<step>/{metrics.json, <name>.txt}


def _final_splits(config) -> dict[str, str]:
  """Name -> split evaluated at num_train_steps: the task's (`Task.final_splits`) and every
  extra_test_files entry (`DataConfig.extra_test_splits`)."""
  task = tasks_lib.get(config.task)
  splits = task.final_splits(config)
  data_config = data_lib.as_data_config(config.data)
  num_files = len(task.data_format.file_features(data_config, None))
  extra = data_config.extra_test_splits(num_files)
  clash = sorted(set(splits) & set(extra))
  if clash:
    raise ValueError(
        f'config.data.extra_test_files={config.data.extra_test_files!r}: '
        f'{clash} would be reported under the name of a split of the data set; '
        'rename the file.'
    )
  return {**splits, **extra}


def _eval_recorded(workdir: str, step: int) -> bool:
  """Whether metrics.jsonl holds the evaluation of `step` (process 0 reads, all agree)."""
  found = False
  if jax.process_index() == 0:
    path = os.path.join(workdir, metrics_lib.METRICS_FILE)
    if files.exists(path):
      for line in files.read_text(path).splitlines():
        try:
          record = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill
          continue
        if record.get('split') == 'eval' and record.get('step') == step:
          found = True
          break
  if jax.process_count() > 1:
    found = bool(multihost_utils.broadcast_one_to_all(np.array(found)))
  return found


def _recorded_final(workdir: str, step: int, names: list[str]) -> dict[str, dict] | None:
  """The final evaluation of `step` as it was saved, if it covered every split of `names` (a
  finished run started again), else None (also after a kill during the final evaluation).
  Process 0 decides, the others follow (and return {})."""
  found, complete = {}, False
  if jax.process_index() == 0:
    path = os.path.join(workdir, FINAL_EVAL_DIR, str(step), 'metrics.json')
    if files.exists(path):  # (with no split to evaluate: {}, the mark of a finished run)
      found = json.loads(files.read_text(path))
      complete = set(names) <= set(found)
  if jax.process_count() > 1:
    complete = bool(multihost_utils.broadcast_one_to_all(np.array(complete)))
  return {name: found.get(name, {}) for name in names} if complete else None


def _evaluate_final(
    evaluators, params, pipelines, workdir: str, step: int, writer
) -> dict[str, dict[str, Any]]:
  """Every split of `pipelines` (name -> eval pipeline), whole, by every evaluator of the task
  (`Evaluator.final`): loss and the task's metrics (translation: BLEU against the raw
  references, chrF, sentences; GLUE: its metrics). Each split is written to metrics.jsonl as
  split=<name>; the evaluators' files (translations) to `<workdir>/final_eval/<step>/`, and
  all of it (signatures included) to `final_eval/<step>/metrics.json`.
  """
  results = {}
  for name, pipeline in pipelines.items():
    metrics, strings = {}, {}
    for evaluator in evaluators:
      result = evaluator.final(params, pipeline, name)
      metrics.update(result.metrics)
      strings.update(result.strings)
      for file_name, text in result.files.items():
        _write_final(workdir, step, file_name, text)
    writer.write_scalars(step, name, metrics)
    metrics_lib.say(
        f'final {name} at step {step}: ' + '  '.join(f'{k} {v:.4g}' for k, v in metrics.items())
    )
    results[name] = {**metrics, **strings}
  for evaluator in evaluators:
    line = evaluator.finish()
    if line:
      metrics_lib.say(line)
  writer.flush()
  _write_final(workdir, step, 'metrics.json', json.dumps(results, indent=2, sort_keys=True))
  return results


def _write_final(workdir: str, step: int, name: str, text: str) -> None:
  """`<workdir>/final_eval/<step>/<name>` (process 0; written, then renamed; remote: one
  object write)."""
  if jax.process_index() != 0:
    return
  directory = os.path.join(workdir, FINAL_EVAL_DIR, str(step))
  files.makedirs(directory)
  files.write_atomic(os.path.join(directory, name), text)
