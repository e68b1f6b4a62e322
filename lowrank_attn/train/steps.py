"""The pure training and evaluation steps; the loss is the task's (`Task.loss`).

`train_step(state, batch, dropout_key)` is one optimizer update of the train state
`{'step', 'params', 'opt_state'}` (parameters as a nested dict of arrays); the model's structure
travels as a static `nnx.GraphDef` in `StepOptions`. Both steps are jitted by
`lowrank_attn.train.state.compile_steps`.
"""

from collections.abc import Mapping
import dataclasses
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
import optax

from lowrank_attn import tasks
from lowrank_attn.tasks.base import cross_entropy  # pylint: disable=unused-import  (re-export)

PyTree = Any


# ------------------------------------------------------------------------------- steps


@dataclasses.dataclass(frozen=True)
class StepOptions:
  """Static settings of the step functions (hashable: part of the jit cache key)."""

  task: str  # a name in `lowrank_attn.tasks.TASKS`
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


def train_step(
    state: PyTree,
    batch: Mapping[str, jax.Array],
    dropout_key: jax.Array,
    *,
    options: StepOptions,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule
) -> tuple[PyTree, dict[str, jax.Array]]:
  """One optimizer update on one global batch (split in `grad_accum_steps` micro-batches)."""
  task = tasks.get(options.task)
  step = state['step']
  key = jax.random.fold_in(dropout_key, step)  # a new dropout mask every step, resumable
  total_weight = jnp.maximum(jnp.sum(batch['weights'].astype(jnp.float32)), 1.0)
  k = options.grad_accum_steps

  def objective(params, micro_batch, micro_key):
    model = nnx.merge(options.graphdef, params)
    outputs, aux = task.forward(
        model, micro_batch, deterministic=False, rngs=nnx.Rngs(dropout=micro_key)
    )
    sums = task.loss(outputs, micro_batch, options.label_smoothing)
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
    _, sum_shapes = jax.eval_shape(
        grad_fn, state['params'], jax.tree.map(lambda x: x[0], (_micro_batches(batch, k))), key
    )
    zero_sums = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), sum_shapes)
    (grads, sums), _ = jax.lax.scan(
        accumulate, (zeros, zero_sums), (jnp.arange(k), _micro_batches(batch, k))
    )
    sums['l0_penalty'] = sums['l0_penalty'] / k

  updates, opt_state = tx.update(grads, state['opt_state'], state['params'])
  params = optax.apply_updates(state['params'], updates)
  weight = jnp.maximum(sums['weight'], 1.0)
  metrics = {
      'loss': sums['nll'] / weight,
      'objective': sums['objective'] / weight + options.l0_penalty_weight * sums['l0_penalty'],
      **({'accuracy': sums['correct'] / weight} if 'correct' in sums else {}),
      'l0_penalty': sums['l0_penalty'],
      'grad_norm': optax.tree.norm(grads),
      'learning_rate': schedule(step),
      'tokens': task.real_tokens(batch),  # source and target tokens that are not padding
  }
  return {'step': step + 1, 'params': params, 'opt_state': opt_state}, metrics


def eval_step(
    params: PyTree, batch: Mapping[str, jax.Array], *, options: StepOptions
) -> dict[str, jax.Array]:
  """The task's loss sums over a batch (rows with weight 0 count for nothing), no smoothing;
  `objective` is left out (without smoothing it is `nll`)."""
  task = tasks.get(options.task)
  model = nnx.merge(options.graphdef, params)
  outputs, aux = task.forward(model, batch, deterministic=True)
  sums = task.loss(outputs, batch, 0.0)
  return {**{k: v for k, v in sums.items() if k != 'objective'}, 'l0_penalty': aux['l0_penalty']}


def row_sums(
    params: PyTree, batch: Mapping[str, jax.Array], *, options: StepOptions
) -> dict[str, jax.Array]:
  """`eval_step`'s `nll` and `weight` for each row alone (`[batch]` each): the examples a paired
  bootstrap resamples (`experiments.stats`). Summed over rows they are `eval_step`'s sums."""
  task = tasks.get(options.task)
  model = nnx.merge(options.graphdef, params)
  outputs, _ = task.forward(model, batch, deterministic=True)
  one_row = lambda tree: jax.tree.map(lambda x: x[None], tree)
  sums = jax.vmap(lambda out, row: task.loss(one_row(out), one_row(row), 0.0))(outputs, batch)
  return {'nll': sums['nll'], 'weight': sums['weight']}
