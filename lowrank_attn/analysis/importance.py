"""Per-head statistics over a data set: importance (Michel et al. 2019), confidence (Voita et al.).

    importance = head_importance(model, batches)         # {type: [layers, heads]}
    confidence = head_confidence(model, batches)         # {type: [layers, heads]}

Both stream over `batches` (dicts as the data pipelines yield them, one sentence or sentence
pair per row, e.g. an evaluation pipeline) with one jitted function per batch shape, summing
on the device; a pruned model's layers may have different head counts (then each type maps
to a list of per-layer arrays).
"""

from collections.abc import Iterable, Mapping
import functools

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from lowrank_attn import models, tasks
from lowrank_attn.pruning.heads import head_counts, per_type

Batch = Mapping[str, np.ndarray]


def task_of(model: nnx.Module) -> tasks.Task:
  """The training task whose model class `model` is (its forward pass and batches fit it)."""
  for task in tasks.TASKS.values():
    if type(model) is task.model_class:  # pylint: disable=unidiomatic-typecheck
      return task
  raise ValueError(
      f"{type(model).__name__} is the model of no task; the tasks' models: "
      f'{sorted(t.model_class.__name__ for t in tasks.TASKS.values())}.'
  )


def _per_example_masks(counts: Mapping[str, tuple[int, ...]], batch_size: int):
  """All-ones head masks with a batch axis: {type: per layer [batch, heads]}."""
  return {t: [jnp.ones((batch_size, h), jnp.float32) for h in heads] for t, heads in counts.items()}


@functools.partial(jax.jit, static_argnames=('graphdef', 'task_name'))
def _importance_sums(graphdef, params, batch, *, task_name):
  """Sum over the batch's examples x of |d L_x / d xi_h| (L_x: x's summed loss, the task's),
  and the loss's weight (target tokens, or examples)."""
  task = tasks.get(task_name)
  model = nnx.merge(graphdef, params)
  masks = _per_example_masks(head_counts(model), batch['inputs'].shape[0])

  def loss(masks):
    outputs, _ = task.forward(model, batch, deterministic=True, head_masks=masks)
    sums = task.loss(outputs, batch, 0.0)  # summed over the batch's examples (and tokens)
    return sums['nll'], sums['weight']

  grads, weight = jax.grad(loss, has_aux=True)(masks)
  # Each example's loss depends only on its own mask row: one backward pass gives every
  # example's gradient, and the absolute value is taken per example (Michel et al., eq. 2).
  sums = {t: [jnp.sum(jnp.abs(g), axis=0) for g in layers] for t, layers in grads.items()}
  return sums, weight


def head_importance(
    model: nnx.Module, batches: Iterable[Batch], *, normalize_layers: bool = False
) -> dict:
  """Michel et al. (2019)'s head importance I_h = E_x |dL(x) / d xi_h| at xi = 1.

  xi_h multiplies head h's output (`head_masks`), L(x) is example x's summed loss under its
  task (`Task.loss` without label smoothing: the token cross entropy of a row, a GLUE
  example's cross entropy or squared error), and the expectation weighs examples by the
  loss's weights: I_h = sum_x |dL(x) / d xi_h| / sum_x weight(x), the average per target
  token (per example for GLUE).

  Args:
    model: the model of a task (`task_of`): an EncoderDecoder, EncoderMLM, DecoderLM or
      GLUE's classifier.
    batches: batches of the model's task (`inputs`, `targets`, `weights`, ...), one example
      per row; a packed row counts as one example.
    normalize_layers: divide each layer's scores by their L2 norm (Michel et al. sec. 4.2,
      which makes importance comparable across layers for global pruning).

  Returns:
    {attention type: [layers, heads]} float64 (per-layer arrays where head counts differ).
  """
  task = task_of(model)
  graphdef, params = nnx.split(model, nnx.Param)
  totals, tokens = None, 0.0
  for batch in batches:
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    sums, count = _importance_sums(graphdef, params, batch, task_name=task.name)
    totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
    tokens += float(count)
  if totals is None:
    raise ValueError('batches is empty: head importance needs at least one batch.')
  scores = {
      t: [np.asarray(s, np.float64) / max(tokens, 1.0) for s in layers]
      for t, layers in totals.items()
  }
  if normalize_layers:
    scores = {t: [s / (np.linalg.norm(s) + 1e-20) for s in layers] for t, layers in scores.items()}
  return per_type(scores)


def _position_tokens(model, batch) -> dict[str, tuple[jax.Array, jax.Array]]:
  """{type: (query tokens [b, q], key tokens [b, k])}: the token at each position, 0 where
  there is none (padding)."""
  if isinstance(model, models.EncoderDecoder):
    source, targets = batch['inputs'], batch['targets']
    # The decoder reads the targets shifted right: BOS, then target j - 1 at position j.
    shifted = jnp.concatenate([jnp.full_like(targets[:, :1], model.bos_id), targets[:, :-1]], 1)
    shifted = jnp.where(targets != 0, shifted, 0)
    return {'encoder': (source, source), 'decoder': (shifted, shifted), 'cross': (shifted, source)}
  tokens = batch['inputs']
  return {'encoder' if isinstance(model, models.EncoderMLM) else 'decoder': (tokens, tokens)}


@functools.partial(jax.jit, static_argnames=('graphdef', 'task_name', 'eos_id'))
def _confidence_sums(graphdef, params, batch, *, task_name, eos_id):
  """Per type: (per layer the sum over real queries of each head's top weight, #queries)."""
  model = nnx.merge(graphdef, params)
  _, aux = tasks.get(task_name).forward(model, batch, deterministic=True, return_weights=True)
  real = lambda tokens: (tokens != 0) & (tokens != (-1 if eos_id is None else eos_id))
  sums = {}
  for attention_type, (queries, keys) in _position_tokens(model, batch).items():
    queries, keys = real(queries), real(keys)
    layers = []
    for weights in aux['attention_weights'][attention_type]:  # [b, h, q, k]
      top = jnp.max(jnp.where(keys[:, None, None, :], weights, 0.0), axis=-1)
      layers.append(jnp.sum(top * queries[:, None, :], axis=(0, 2)))
    sums[attention_type] = (layers, jnp.sum(queries))
  return sums


def head_confidence(
    model: nnx.Module, batches: Iterable[Batch], *, eos_id: int | None = None
) -> dict:
  """Voita et al. (2019)'s confidence: each head's maximum attention weight, averaged over
  the real (non-padding) query tokens of `batches`.

  Args:
    model: an EncoderDecoder, EncoderMLM or DecoderLM.
    batches: batches of the model's task, as for `head_importance`.
    eos_id: if given, the end-of-sentence token is left out as a query and as a key (Voita et
      al.: "maximum attention weight excluding the end of sentence symbol").

  Returns:
    {attention type: [layers, heads]} in [0, 1] (per-layer arrays where head counts differ).
  """
  task = task_of(model)
  graphdef, params = nnx.split(model, nnx.Param)
  totals = None
  for batch in batches:
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    sums = _confidence_sums(graphdef, params, batch, task_name=task.name, eos_id=eos_id)
    totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
  if totals is None:
    raise ValueError('batches is empty: head confidence needs at least one batch.')
  return per_type(
      {
          t: [np.asarray(s, np.float64) / max(float(count), 1.0) for s in layers]
          for t, (layers, count) in totals.items()
      }
  )
