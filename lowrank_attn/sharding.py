"""The device mesh, logical axis rules and sharded state creation (the only place that does this).

One mesh with axes `('data', 'fsdp', 'tensor')`:
  data    pure data parallelism: the batch is split, parameters are replicated;
  fsdp    the batch is split *and* parameters / optimizer state are sharded (ZeRO-3 style),
          gathered by XLA when a layer needs them;
  tensor  Megatron-style model parallelism over heads, MLP width and vocabulary.

Models only name the logical axes of their parameters (`vocab, embed, mlp, heads, kv, key,
layers`; `logical_metadata`) and of a few activations (`batch, length`; `constrain`). The rules
that map logical names to mesh axes live in the config (maxtext style), so a new parallelism
layout is a config change; `logical_to_spec` is the one resolver of names to mesh axes.

Parameters are never sharded eagerly at construction (`logical_metadata` says so on every
parameter): models build anywhere, e.g. in a notebook without a mesh, and the training loop
creates the state directly in its shards with one jitted init (`create_sharded`).

All mesh axes are `AxisType.Auto`: shardings are given at the jit boundary
(`in_shardings` / `out_shardings`) and by a few `with_sharding_constraint`s on activations, and
XLA's partitioner propagates the rest. Explicit axes would make every op in the attention
kernels state its output sharding, which they do not (and need not) do.
"""

from collections.abc import Callable, Mapping, Sequence
import contextlib
import math
from typing import Any

from absl import logging
from flax import nnx
from flax.core import spmd
import jax
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np

MESH_AXES = ('data', 'fsdp', 'tensor')
# Logical axes that carry the batch; their rule decides how input batches are split.
BATCH_AXIS = 'batch'

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]


def mesh_shape(mesh_config: Mapping[str, int], num_devices: int) -> tuple[int, ...]:
  """Resolves `{'data': -1, 'fsdp': 1, 'tensor': 1}` to a shape whose product is num_devices."""
  unknown = set(mesh_config) - set(MESH_AXES)
  if unknown:
    raise ValueError(f'config.mesh has unknown axes {sorted(unknown)}; the axes are {MESH_AXES}.')
  sizes = [int(mesh_config.get(axis, 1)) for axis in MESH_AXES]
  for axis, size in zip(MESH_AXES, sizes):
    if size != -1 and size < 1:
      raise ValueError(f'config.mesh.{axis}={size} must be -1 (the rest) or an integer >= 1.')
  if sizes.count(-1) > 1:
    raise ValueError(f'config.mesh={dict(zip(MESH_AXES, sizes))}: at most one axis may be -1.')
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if num_devices % known:
      raise ValueError(
          f'config.mesh={dict(zip(MESH_AXES, sizes))}: the fixed axes ({known} devices) do not '
          f'divide the {num_devices} available devices.'
      )
    sizes[sizes.index(-1)] = num_devices // known
  if math.prod(sizes) != num_devices:
    raise ValueError(
        f'config.mesh={dict(zip(MESH_AXES, sizes))} uses {math.prod(sizes)} devices but '
        f'{num_devices} are available; set one axis to -1 to use "the rest".'
    )
  return tuple(sizes)


def make_mesh(mesh_config: Mapping[str, int], devices: Sequence[Any] | None = None):
  """The training mesh, all axes Auto (see the module docstring)."""
  devices = jax.devices() if devices is None else list(devices)
  shape = mesh_shape(mesh_config, len(devices))
  return jax.make_mesh(
      shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES), devices=devices
  )


def validate_rules(rules: Sequence[Sequence[Any]]) -> Rules:
  """Checks `((logical, mesh_axes), ...)` and returns it as a tuple of tuples."""
  out = []
  seen = set()
  for i, rule in enumerate(rules):
    if len(rule) != 2 or not isinstance(rule[0], str):
      raise ValueError(
          f'config.logical_axis_rules[{i}]={rule!r} must be a pair (logical_name, mesh_axes).'
      )
    name, target = rule
    if name in seen:
      raise ValueError(f'config.logical_axis_rules names {name!r} twice.')
    seen.add(name)
    axes = () if target is None else (target,) if isinstance(target, str) else tuple(target)
    for axis in axes:
      if axis not in MESH_AXES:
        raise ValueError(
            f'config.logical_axis_rules[{i}]: {name!r} -> {target!r} names {axis!r}, which is '
            f'not a mesh axis; valid: {MESH_AXES} or None.'
        )
    out.append((name, None if not axes else axes[0] if len(axes) == 1 else axes))
  return tuple(out)


def logical_metadata(*axes: str | None) -> dict[str, Any]:
  """Variable metadata naming a parameter's logical axes (one name or None per dimension)."""
  return {'out_sharding': axes, 'eager_sharding': False}


@contextlib.contextmanager
def use(mesh, rules: Rules):
  """The mesh and logical rules in effect: jitted steps and `constrain` read them."""
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    yield


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
  """Pins an activation's sharding by logical names when a mesh and rules are active.

  The identity outside a mesh (notebooks, one device). A dimension the mesh axes do not
  divide (e.g. a beam-search batch) is left to the compiler.
  """
  mesh = jax.sharding.get_abstract_mesh()
  rules = spmd.get_logical_axis_rules()  # those of the enclosing nnx.logical_axis_rules
  if mesh.empty or not rules:
    return x
  spec = logical_to_spec(logical_axes, tuple(rules), x.shape, mesh, quiet=True)
  return jax.lax.with_sharding_constraint(x, spec)


def logical_to_spec(
    logical_axes: Sequence[str | None],
    rules: Rules,
    shape=None,
    mesh=None,
    what: str = 'array',
    quiet: bool = False,
) -> P:
  """PartitionSpec for an array whose dimensions carry `logical_axes`.

  With `shape` and `mesh`, a dimension that the mesh axes do not divide evenly is replicated
  instead (e.g. a 65-character vocabulary on tensor=2): jit rejects uneven shardings, and a
  replicated embedding is the right answer for such small dimensions anyway. A mesh axis
  shards one dimension at most (e.g. 'embed' -> fsdp is skipped when 'batch' holds fsdp).
  `quiet`: names without a rule are replicated instead of an error (activations).
  """
  table = dict(rules)
  spec = []
  used = set()
  for dim, name in enumerate(logical_axes):
    if name is None:
      spec.append(None)
      continue
    if name not in table and quiet:
      spec.append(None)
      continue
    if name not in table:
      raise ValueError(
          f'{what}: logical axis {name!r} has no rule in config.logical_axis_rules '
          f'(rules cover {sorted(table)}); add ({name!r}, None) to replicate it.'
      )
    target = table[name]
    axes = () if target is None else (target,) if isinstance(target, str) else tuple(target)
    axes = tuple(a for a in axes if a not in used)  # a mesh axis may shard one dim only
    if shape is not None and mesh is not None and axes:
      size = math.prod(mesh.shape[a] for a in axes)
      if shape[dim] % size and quiet:
        axes = ()
      elif shape[dim] % size:
        logging.info(
            '%s: dim %d (%s, size %d) is not divisible by mesh axes %s (%d); ' 'replicating it.',
            what,
            dim,
            name,
            shape[dim],
            axes,
            size,
        )
        axes = ()
    used.update(axes)
    spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return P(*spec)


def _variable_axes(variable) -> tuple[str | None, ...] | None:
  return variable.get_metadata().get('out_sharding')


def state_shardings(state: Any, mesh, rules: Rules) -> Any:
  """NamedSharding for every leaf of an `nnx.State` (of Variables or of ShapeDtypeStructs).

  A Variable's logical axes are its `out_sharding` metadata; leaves without it are replicated.
  """

  def one(path, variable):
    value = variable.get_value() if isinstance(variable, nnx.Variable) else variable
    axes = _variable_axes(variable) if isinstance(variable, nnx.Variable) else None
    name = '/'.join(str(getattr(k, 'key', k)) for k in path)
    if axes is None or getattr(value, 'ndim', 0) == 0:
      spec = P()
    else:
      if len(axes) != value.ndim:
        raise ValueError(f'parameter {name}: logical axes {axes} do not match shape {value.shape}.')
      spec = logical_to_spec(axes, rules, value.shape, mesh, what=f'parameter {name}')
    sharding = NamedSharding(mesh, spec)
    return variable.replace(sharding) if isinstance(variable, nnx.Variable) else sharding

  return jax.tree_util.tree_map_with_path(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def create_sharded(init_fn: Callable[[], Any], shardings: Any) -> Any:
  """Runs `init_fn` under jit so that every output is created directly with its sharding.

  No parameter is ever materialised whole on one device (unlike init + device_put).
  """
  return jax.jit(init_fn, out_shardings=shardings)()


def batch_spec(rules: Rules, ndim: int) -> P:
  """Batch arrays are split along dim 0 by the rule for 'batch' and replicated otherwise."""
  return P(logical_to_spec((BATCH_AXIS,), rules)[0], *([None] * (ndim - 1)))


def batch_shardings(batch_shapes: Mapping[str, tuple[int, ...]], mesh, rules: Rules):
  return {k: NamedSharding(mesh, batch_spec(rules, len(s))) for k, s in batch_shapes.items()}


def global_batch(
    local_batch: Mapping[str, np.ndarray],
    shardings: Mapping[str, NamedSharding],
    process_count: int,
) -> dict[str, jax.Array]:
  """Assembles each process's rows into global arrays (multi-host safe).

  Every process passes only its own rows; `make_array_from_process_local_data` places them on
  the process's devices without any host ever holding the whole batch.
  """
  out = {}
  for key, local in local_batch.items():
    global_shape = (local.shape[0] * process_count,) + tuple(local.shape[1:])
    out[key] = jax.make_array_from_process_local_data(shardings[key], local, global_shape)
  return out


def tree_size(tree) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def describe(state, shardings) -> str:
  """Parameter count and how many are sharded, for the start-of-run log."""
  leaves = jax.tree.leaves(state)
  specs = jax.tree.leaves(shardings, is_leaf=lambda s: isinstance(s, NamedSharding))
  total = sum(int(np.prod(x.shape)) for x in leaves)

  def ways(s):
    axes = [
        a
        for entry in s.spec
        if entry is not None
        for a in ((entry,) if isinstance(entry, str) else entry)
    ]
    return math.prod(s.mesh.shape[a] for a in axes)

  sharded = sum(int(np.prod(x.shape)) for x, s in zip(leaves, specs) if ways(s) > 1)
  return f'{total:,} parameters, {sharded:,} of them sharded'
