"""`train_and_evaluate(config, workdir)`: the sharded training loop, and its pure steps.

The train state is a plain pytree `{'step', 'params', 'opt_state'}` (parameters as a nested
dict of arrays, `nnx.to_pure_dict`); the model's structure travels separately as a static
`nnx.GraphDef`. `train_step` / `eval_step` are pure functions of pytrees, jitted with explicit
`in_shardings` / `out_shardings` under `jax.set_mesh`, the state donated.

Exactness of resume rests on: the dropout key of step s is `fold_in(key(seed + 1), s)`; the
input position is checkpointed with the state; a NaN/inf step is detected before any
checkpoint after it is written (metrics are checked before every save).
"""

from collections.abc import Mapping
import dataclasses
import functools
import math
import os
from typing import Any

from absl import logging
from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import ml_collections
import numpy as np
import optax

from lowrank_attn import data as data_lib
from lowrank_attn.train import checkpoints, config as config_lib, metrics as metrics_lib
from lowrank_attn.train import optim, sharding, tasks

PyTree = Any


class NonFiniteError(FloatingPointError):
  """The loss or gradient norm became NaN/inf; the run stopped without saving that state."""


class Preempted(Exception):
  """SIGTERM / preemption: a checkpoint was saved at `step` and the run stopped."""

  def __init__(self, step: int, directory: str):
    super().__init__(f'preempted: saved step {step} to {directory}; rerun the same command '
                     'to resume.')
    self.step = step


# ------------------------------------------------------------------------------- losses


def cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array,
                  label_smoothing: float = 0.0) -> dict[str, jax.Array]:
  """Weighted sums over tokens: negative log-likelihood, smoothed objective, correct, weight.

  `nll` is the plain cross entropy (perplexity = exp(nll / weight)); `objective` mixes in
  label smoothing (Szegedy et al. 2016): (1 - e) nll + e mean_v(-log p_v).
  """
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  nll = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
  objective = nll
  if label_smoothing > 0:
    objective = (1 - label_smoothing) * nll - label_smoothing * jnp.mean(log_probs, axis=-1)
  weights = weights.astype(jnp.float32)
  correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
  return {'nll': jnp.sum(nll * weights), 'objective': jnp.sum(objective * weights),
          'correct': jnp.sum(correct * weights), 'weight': jnp.sum(weights)}


# ------------------------------------------------------------------------------- steps


@dataclasses.dataclass(frozen=True)
class StepOptions:
  """Static settings of the step functions (hashable: part of the jit cache key)."""

  task: str
  graphdef: Any
  grad_accum_steps: int = 1
  label_smoothing: float = 0.0
  l0_penalty_weight: float = 0.0


def _micro_batches(batch: Mapping[str, jax.Array], k: int) -> dict[str, jax.Array]:
  """`[B, ...]` -> `[k, B/k, ...]` where micro-batch i holds rows i, i+k, i+2k, ...

  Strided rows keep each device's shard of the batch on that device: no data moves.
  """
  def split(x):
    x = x.reshape(x.shape[0] // k, k, *x.shape[1:])
    return jnp.swapaxes(x, 0, 1)
  return {name: split(x) for name, x in batch.items()}


def train_step(state: PyTree, batch: Mapping[str, jax.Array], dropout_key: jax.Array, *,
               options: StepOptions, tx: optax.GradientTransformation,
               schedule: optax.Schedule) -> tuple[PyTree, dict[str, jax.Array]]:
  """One optimizer update on one global batch (split in `grad_accum_steps` micro-batches)."""
  step = state['step']
  key = jax.random.fold_in(dropout_key, step)
  total_weight = jnp.maximum(jnp.sum(batch['weights'].astype(jnp.float32)), 1.0)
  k = options.grad_accum_steps

  def objective(params, micro_batch, micro_key):
    model = nnx.merge(options.graphdef, params)
    logits, aux = tasks.forward(model, micro_batch, options.task, deterministic=False,
                                rngs=nnx.Rngs(dropout=micro_key))
    sums = cross_entropy(logits, micro_batch['targets'], micro_batch['weights'],
                         options.label_smoothing)
    # Normalised by the whole batch's weight, so micro-batch gradients simply add up.
    value = sums['objective'] / total_weight + options.l0_penalty_weight * aux['l0_penalty'] / k
    return value, {**sums, 'l0_penalty': aux['l0_penalty']}

  grad_fn = jax.grad(objective, has_aux=True)
  if k == 1:
    grads, sums = grad_fn(state['params'], batch, key)
  else:
    def accumulate(carry, inputs):
      i, micro_batch = inputs
      grads, sums = grad_fn(state['params'], micro_batch, jax.random.fold_in(key, i))
      return jax.tree.map(jnp.add, carry, (grads, sums)), None
    zeros = jax.tree.map(jnp.zeros_like, state['params'])
    zero_sums = {name: jnp.zeros((), jnp.float32)
                 for name in ('nll', 'objective', 'correct', 'weight', 'l0_penalty')}
    (grads, sums), _ = jax.lax.scan(
        accumulate, (zeros, zero_sums), (jnp.arange(k), _micro_batches(batch, k)))
    sums['l0_penalty'] = sums['l0_penalty'] / k

  updates, opt_state = tx.update(grads, state['opt_state'], state['params'])
  params = optax.apply_updates(state['params'], updates)
  weight = jnp.maximum(sums['weight'], 1.0)
  metrics = {
      'loss': sums['nll'] / weight,
      'objective': sums['objective'] / weight + options.l0_penalty_weight * sums['l0_penalty'],
      'accuracy': sums['correct'] / weight,
      'l0_penalty': sums['l0_penalty'],
      'grad_norm': optax.tree.norm(grads),
      'learning_rate': schedule(step),
      'tokens': sums['weight'],
  }
  return {'step': step + 1, 'params': params, 'opt_state': opt_state}, metrics


def eval_step(params: PyTree, batch: Mapping[str, jax.Array], *,
              options: StepOptions) -> dict[str, jax.Array]:
  """Sums of nll / correct / weight over a batch (rows with weight 0 count for nothing)."""
  model = nnx.merge(options.graphdef, params)
  logits, aux = tasks.forward(model, batch, options.task, deterministic=True)
  sums = cross_entropy(logits, batch['targets'], batch['weights'])
  return {'nll': sums['nll'], 'correct': sums['correct'], 'weight': sums['weight'],
          'l0_penalty': aux['l0_penalty']}


# ------------------------------------------------------------------------------- state


def _path_keys(path) -> tuple:
  return tuple(getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', k))) for k in path)


def _opt_state_shardings(abstract_opt_state, abstract_params, param_shardings: Mapping,
                         mesh) -> PyTree:
  """Optimizer-state leaves shaped like a parameter (Adam moments) share its sharding.

  A leaf matches the parameter whose dict path is the longest suffix of the leaf's path and
  has the same shape; everything else (step counts) is replicated.
  """
  shapes = {_path_keys(p): x.shape
            for p, x in jax.tree_util.tree_flatten_with_path(abstract_params)[0]}
  flat_params = {_path_keys(p): (s, shapes[_path_keys(p)])
                 for p, s in jax.tree_util.tree_flatten_with_path(param_shardings)[0]}
  replicated = NamedSharding(mesh, P())

  def one(path, leaf):
    keys = _path_keys(path)
    for start in range(len(keys)):
      match = flat_params.get(keys[start:])
      if match is not None and match[1] == leaf.shape:
        return match[0]
    return replicated

  return jax.tree_util.tree_map_with_path(one, abstract_opt_state)


@dataclasses.dataclass
class Setup:
  """Everything derived from the config before the first step (also used by tests/benchmarks)."""

  config: ml_collections.ConfigDict
  mesh: Any
  rules: sharding.Rules
  model_cfg: Any
  graphdef: Any
  abstract_state: PyTree  # ShapeDtypeStructs with shardings
  state_shardings: PyTree
  init_state: Any  # () -> state, to be jitted with out_shardings
  tx: optax.GradientTransformation
  schedule: optax.Schedule
  options: StepOptions
  flops_fn: Any  # batch shapes -> forward FLOPs


def setup(config: ml_collections.ConfigDict, *, vocab_size: int, bos_id: int,
          devices=None) -> Setup:
  """Mesh, abstract model and state, shardings, optimizer and step options for a config."""
  mesh = sharding.make_mesh(config.mesh, devices)
  rules = sharding.validate_rules(config.logical_axis_rules)
  model_cfg = config_lib.model_config(config, vocab_size)
  init_key = jax.random.key(config.seed)
  model_fn = lambda: tasks.create_model(config.task, model_cfg, bos_id=bos_id,
                                        rngs=nnx.Rngs(params=init_key))
  graphdef, abstract_vars, *rest = nnx.split(
      nnx.eval_shape(lambda: _without_eager_sharding(model_fn)), nnx.Param, ...)
  if any(jax.tree.leaves(r) for r in rest):
    raise ValueError(f'the model holds non-parameter state {rest}; training expects a model '
                     'whose only state is nnx.Param (create layers with keep_rngs=False).')
  param_shardings = nnx.to_pure_dict(sharding.state_shardings(abstract_vars, mesh, rules))

  schedule = optim.learning_rate_schedule(
      learning_rate=config.learning_rate, warmup_steps=config.warmup_steps,
      num_train_steps=config.num_train_steps, decay=config.lr_schedule,
      end_factor=config.end_learning_rate_factor)
  tx = optim.make_optimizer(schedule, b1=config.adam_b1, b2=config.adam_b2,
                            eps=config.adam_eps, weight_decay=config.weight_decay,
                            grad_clip_norm=config.grad_clip_norm)

  def init_state():
    model = _without_eager_sharding(model_fn)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return {'step': jnp.zeros((), jnp.int32), 'params': params, 'opt_state': tx.init(params)}

  abstract = jax.eval_shape(init_state)
  state_shardings = {
      'step': NamedSharding(mesh, P()),
      'params': param_shardings,
      'opt_state': _opt_state_shardings(abstract['opt_state'], abstract['params'],
                                        param_shardings, mesh)}
  abstract_state = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, state_shardings)
  options = StepOptions(task=config.task, graphdef=graphdef,
                        grad_accum_steps=config.grad_accum_steps,
                        label_smoothing=config.label_smoothing,
                        l0_penalty_weight=config.l0_penalty_weight)
  abstract_model = nnx.merge(graphdef, abstract_vars)
  flops_fn = lambda shapes: tasks.forward_flops(abstract_model, config.task, shapes)
  return Setup(config, mesh, rules, model_cfg, graphdef, abstract_state, state_shardings,
               init_state, tx, schedule, options, flops_fn)


def _without_eager_sharding(fn):
  # Parameters keep logical axes as metadata; they are sharded once, at the jit boundary.
  with nnx.use_eager_sharding(False):
    return fn()


def create_state(s: Setup) -> PyTree:
  """The initial train state, each array created directly in its shards (jitted init)."""
  with jax.set_mesh(s.mesh), nnx.logical_axis_rules(s.rules):
    return sharding.create_sharded(s.init_state, s.state_shardings)


def compile_steps(s: Setup, batch_shapes: Mapping[str, tuple[int, ...]]):
  """Jitted (train_step, eval_step) with explicit shardings; the state is donated."""
  batch_shardings = sharding.batch_shardings(batch_shapes, s.mesh, s.rules)
  replicated = NamedSharding(s.mesh, P())
  train = jax.jit(
      functools.partial(train_step, options=s.options, tx=s.tx, schedule=s.schedule),
      in_shardings=(s.state_shardings, batch_shardings, replicated),
      out_shardings=(s.state_shardings, replicated),
      donate_argnums=(0,))
  evaluate = jax.jit(
      functools.partial(eval_step, options=s.options),
      in_shardings=(s.state_shardings['params'], batch_shardings),
      out_shardings=replicated)
  return train, evaluate, batch_shardings


def _run_step(fn, *args, s: Setup):
  """Calls a jitted step under the mesh and logical rules (activation constraints read them)."""
  with jax.set_mesh(s.mesh), nnx.logical_axis_rules(s.rules):
    return fn(*args)


# ------------------------------------------------------------------------------- the loop


def _maybe_initialize_distributed(config) -> None:
  if not config.jax_distributed:
    return
  try:
    jax.distributed.initialize()
  except (ValueError, RuntimeError) as e:  # no cluster found: a single host is fine
    logging.warning('jax.distributed.initialize() failed (%s); continuing as a single host.', e)


def _peak_flops(config, dtype) -> float:
  per_device = config.peak_flops_per_device
  if per_device is None:
    per_device = metrics_lib.measure_peak_flops_per_device(dtype)
  return per_device * jax.device_count()


def _host_metrics(pending: list[tuple[int, dict[str, jax.Array]]], directory: str,
                  last_saved: int | None) -> list[tuple[int, dict[str, float]]]:
  """Fetches queued step metrics; raises NonFiniteError at the first NaN/inf step."""
  fetched = jax.device_get(pending)
  pending.clear()
  out = []
  for step, values in fetched:
    values = {k: float(v) for k, v in values.items()}
    bad = {k: values[k] for k in ('loss', 'objective', 'grad_norm') if not math.isfinite(values[k])}
    if bad:
      saved = (f'the last good checkpoint is step {last_saved} in {directory}'
               if last_saved is not None else 'no checkpoint was written')
      raise NonFiniteError(
          f'step {step}: non-finite {", ".join(f"{k}={v}" for k, v in bad.items())}; stopping '
          f'the run ({saved}). Lower the learning rate, raise warmup_steps or enable '
          'grad_clip_norm.')
    out.append((step, values))
  return out


def _summarise(host: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
  """Mean of each metric over steps, tokens summed."""
  summary = {k: float(np.mean([v[k] for _, v in host])) for k in host[0][1]}
  summary['tokens'] = float(np.sum([v['tokens'] for _, v in host]))
  return summary


def evaluate(s: Setup, params: PyTree, eval_step_fn, pipeline, num_steps: int) -> dict[str, float]:
  """Token-level loss, perplexity and accuracy over (up to num_steps batches of) a split."""
  totals = None
  for i, batch in enumerate(pipeline):
    if num_steps > 0 and i >= num_steps:
      break
    shardings = sharding.batch_shardings({k: v.shape for k, v in batch.items()}, s.mesh, s.rules)
    batch = sharding.global_batch(batch, shardings, jax.process_count())
    sums = _run_step(eval_step_fn, params, batch, s=s)
    totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
  if totals is None:
    return {}
  totals = jax.device_get(totals)
  weight = max(float(totals['weight']), 1.0)
  loss = float(totals['nll']) / weight
  return {'loss': loss, 'perplexity': math.exp(min(loss, 50.0)),
          'accuracy': float(totals['correct']) / weight, 'tokens': float(totals['weight'])}


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains (resuming from `<workdir>/checkpoints` if present) and evaluates.

  Returns `{'step', 'train': last train metrics, 'eval': last eval metrics, 'throughput':
  steps/s, tokens/s and MFU of the timed steps, 'vocab_size'}`.
  Raises `NonFiniteError` on a NaN/inf loss or gradient norm, `Preempted` after SIGTERM.
  """
  config_lib.validate(config)
  _maybe_initialize_distributed(config)
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  process_index, process_count = jax.process_index(), jax.process_count()

  # A micro-batch is per_device_batch_size rows per device; a step takes grad_accum_steps.
  global_batch_size = config.per_device_batch_size * jax.device_count() * config.grad_accum_steps
  eval_batch_size = config.per_device_batch_size * jax.device_count()
  train_data = data_lib.make_pipeline(
      config.data, split='train', seed=config.seed, global_batch_size=global_batch_size,
      train=True, workdir=workdir, process_index=process_index, process_count=process_count)
  tokenizer = train_data.tokenizer
  s = setup(config, vocab_size=tokenizer.vocab_size, bos_id=tokenizer.bos_id)
  metrics_lib.say(f'mesh {dict(s.mesh.shape)} on {jax.device_count()} {jax.devices()[0].platform} '
                  f'devices, {process_count} process(es); global batch {global_batch_size}')

  checkpointer = checkpoints.Checkpointer(workdir, keep=config.keep_checkpoints,
                                          async_save=config.async_checkpointing)
  checkpoints.save_config(workdir, config_lib.to_dict(config))
  writer = metrics_lib.MetricWriter(workdir)
  preemption = checkpoints.PreemptionWatcher()
  try:
    return _train_loop(config, workdir, s, train_data, tokenizer, checkpointer, writer,
                       preemption, eval_batch_size)
  finally:
    preemption.close()
    checkpointer.close()  # waits for an in-flight save: the last good checkpoint is complete
    writer.close()


def _train_loop(config, workdir, s: Setup, train_data, tokenizer, checkpointer, writer,
                preemption, eval_batch_size):
  latest = checkpointer.latest_step()
  if latest is None:
    state = create_state(s)
    start_step = 0
    writer.write_hparams(config_lib.to_dict(config))  # once per run, not per resume
  else:
    state, data_state = checkpointer.restore(latest, s.abstract_state)
    train_data.set_state(data_state)
    start_step = latest
    metrics_lib.say(f'resumed from step {latest} ({checkpointer.directory})')
  metrics_lib.say(f'model: {config.task}, '
                  f'{sharding.describe(state["params"], s.state_shardings["params"])}')

  dropout_key = jax.random.key(config.seed + 1)
  train_step_fn = eval_step_fn = batch_shardings = progress = None
  pending: list[tuple[int, dict]] = []
  eval_pipelines = {}
  last_train: dict[str, float] = {}
  last_eval: dict[str, float] = {}
  last_saved = latest
  for step in range(start_step, config.num_train_steps):
    if preemption.reached(step):
      if progress:
        progress.pause()
      _host_metrics(pending, checkpointer.directory, last_saved)
      checkpointer.save(step, state, train_data.get_state())
      checkpointer.wait()
      raise Preempted(step, checkpointer.directory)
    batch = next(train_data)
    if train_step_fn is None:  # shapes are known from the first batch
      train_step_fn, eval_step_fn, batch_shardings, progress = _compile(
          config, s, batch)
    global_batch = sharding.global_batch(batch, batch_shardings, jax.process_count())
    state, step_metrics = _run_step(train_step_fn, state, global_batch, dropout_key, s=s)
    pending.append((step + 1, step_metrics))
    done = step + 1
    if step == start_step:  # the first step includes compilation: keep it out of the timing
      jax.block_until_ready(step_metrics)
      progress.resume()
    else:
      progress.count()

    is_last = done == config.num_train_steps
    first = step == start_step  # logged too: the loss the run starts from
    log_now = done % config.log_every_steps == 0 or is_last or first
    save_now = done % config.checkpoint_every_steps == 0 or is_last
    eval_now = is_last or (config.eval_every_steps and done % config.eval_every_steps == 0)
    show_now = progress.due(done) or is_last or first
    if log_now or save_now or eval_now or show_now:
      host = _host_metrics(pending, checkpointer.directory, last_saved)  # waits for the step
      progress.pause()
      if host:
        last_train = _summarise(host)
        rates = progress.take_window()
        if log_now:
          writer.write_scalars(done, 'train', {**last_train, **rates})
        if show_now:
          progress.show(done, host[-1][1]['loss'], rates)
      if save_now:
        checkpointer.save(done, state, train_data.get_state())
        last_saved = done
      if eval_now:
        last_eval = _evaluate_all(config, workdir, s, state['params'], eval_step_fn, tokenizer,
                                  eval_batch_size, eval_pipelines)
        writer.write_scalars(done, 'eval', last_eval)
        metrics_lib.say(f'eval at step {done}: ' + '  '.join(
            f'{k} {v:.4g}' for k, v in last_eval.items()))
      writer.flush()
      progress.resume()

  total = progress.rates(window=False) if progress else {}
  if total:
    metrics_lib.say(f'done: {total["steps_per_sec"]:.2f} steps/s, '
                    f'{total["tokens_per_sec"]:,.0f} tokens/s, MFU {100 * total["mfu"]:.1f}% '
                    '(compilation, evaluation and checkpointing excluded)')
  return {'step': int(jax.device_get(state['step'])), 'train': last_train, 'eval': last_eval,
          'throughput': total, 'vocab_size': s.model_cfg.vocab_size}


def _compile(config, s: Setup, local_batch):
  """Jitted steps for the batch shapes, and the progress meter with this step's FLOPs."""
  global_shapes = {k: (v.shape[0] * jax.process_count(),) + v.shape[1:]
                   for k, v in local_batch.items()}
  train_step_fn, eval_step_fn, batch_shardings = compile_steps(s, global_shapes)
  k = config.grad_accum_steps
  micro_shapes = {name: (shape[0] // k,) + shape[1:] for name, shape in global_shapes.items()}
  flops_per_step = 3 * s.flops_fn(micro_shapes) * k
  tokens_per_step = int(np.prod(global_shapes['inputs'][:2]))
  if config.task == 'nmt':
    tokens_per_step += int(np.prod(global_shapes['targets'][:2]))
  peak = _peak_flops(config, config_lib.DTYPES[config.model.dtype])
  source = 'given' if config.peak_flops_per_device else 'measured'
  metrics_lib.say(f'{flops_per_step / 1e9:.2f} GFLOP per step (3x forward matmuls), peak '
                  f'{peak / 1e9:.0f} GFLOP/s ({source})')
  progress = metrics_lib.Progress(
      num_train_steps=config.num_train_steps, tokens_per_step=tokens_per_step,
      flops_per_step=flops_per_step, peak_flops=peak, every_secs=config.progress_every_secs)
  return train_step_fn, eval_step_fn, batch_shardings, progress


def _evaluate_all(config, workdir, s, params, eval_step_fn, tokenizer, eval_batch_size,
                  pipelines: dict):
  """Eval metrics (and BLEU for nmt) on config.eval_split; the pipeline is built once."""
  if 'eval' not in pipelines:
    pipelines['eval'] = data_lib.make_pipeline(
        config.data, split=config.eval_split, seed=config.seed,
        global_batch_size=eval_batch_size, train=False, workdir=workdir,
        process_index=jax.process_index(), process_count=jax.process_count())
  pipeline = pipelines['eval']
  pipeline.reset()
  results = evaluate(s, params, eval_step_fn, pipeline, config.num_eval_steps)
  if config.task == 'nmt' and config.decode.num_examples != 0:
    from lowrank_attn.train import decode  # only translation needs it
    pipeline.reset()
    results.update(decode.bleu(s, params, pipeline, tokenizer, config.decode))
  return results
