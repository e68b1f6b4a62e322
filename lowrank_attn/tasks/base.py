"""What a task is: one record that owns its data format, model, loss, cost and evaluators.

The training loop, the pipeline and the config know no task by name: they call the fields of
the `Task` that `config.task` names. A new task is one module in this package that defines a
module-level `TASK` (found by `lowrank_attn.tasks.get`), plus a data builder and a config.

Evaluators (after big_vision's `evaluators/`) are objects made once per run by
`Task.evaluators(context)`; each runs during training on the eval split (cheap, maybe on part
of it) and at the end on whole splits, adding metrics (and text files, e.g. translations).
An evaluator stops between batches when a stop is requested (preemption, Ctrl-C): it reads
its batches through `EvalContext.batches`, or calls `EvalContext.check_stop` itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
import dataclasses
import math
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp

from lowrank_attn.data import RowFormat

Array = jax.Array
Batch = Mapping[str, Array]
PyTree = Any


class EvalStopped(Exception):
  """An evaluation stopped between batches because a stop was requested (`EvalContext`)."""


@dataclasses.dataclass
class EvalContext:
  """What an evaluator may use: the run's `Setup` (mesh, config, graphdef), the compiled
  `eval_step(params, batch) -> sums`, the tokenizer, and `stop_requested() -> bool` (a
  preemption or Ctrl-C arrived: the evaluation is abandoned, and rerun when the run resumes)."""

  setup: Any  # lowrank_attn.train.state.Setup
  eval_step: Callable[[PyTree, Batch], dict[str, Array]]
  tokenizer: Any
  stop_requested: Callable[[], bool] = lambda: False

  def check_stop(self, *_) -> None:
    """Raises EvalStopped if a stop was requested (any arguments are ignored, so that it can
    serve as a progress callback)."""
    if self.stop_requested():
      raise EvalStopped()

  def batches(self, pipeline, num_batches: int = -1):
    """`pipeline` from its start, up to `num_batches` batches (-1: all), checking for a stop
    request before each batch."""
    pipeline.reset()
    for i, batch in enumerate(pipeline):
      if num_batches > 0 and i >= num_batches:
        return
      self.check_stop()
      yield batch


@dataclasses.dataclass
class FinalResult:
  """One evaluator on one whole split: numbers, strings (e.g. signatures), files to write."""

  metrics: dict[str, float]
  strings: dict[str, str] = dataclasses.field(default_factory=dict)
  files: dict[str, str] = dataclasses.field(default_factory=dict)  # file name -> text


class Evaluator:
  """Base evaluator; subclasses override `evaluate` and/or `final`."""

  def __init__(self, context: EvalContext):
    self.context = context

  def evaluate(self, params: PyTree, pipeline, num_batches: int) -> dict[str, float]:
    """During training, on the eval split (up to `num_batches`; -1: all)."""
    return {}

  def final(self, params: PyTree, pipeline, name: str) -> FinalResult:
    """At the end, on the whole split `pipeline` (reported as `name`)."""
    return FinalResult(self.evaluate(params, pipeline, -1))

  def finish(self) -> str | None:
    """After every final split: a line to print, if any."""
    return None


class LossEvaluator(Evaluator):
  """The task's eval-step sums over a split, summarised by `Task.summarize`."""

  def __init__(self, context: EvalContext, summarize):
    super().__init__(context)
    self.summarize = summarize

  def evaluate(self, params, pipeline, num_batches):
    s = self.context.setup
    totals = None
    for batch in self.context.batches(pipeline, num_batches):
      with s.activate():
        sums = self.context.eval_step(params, s.global_batch(batch))
      totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
    if totals is None:
      return {}
    return self.summarize({k: float(v) for k, v in jax.device_get(totals).items()})


def token_summary(totals: Mapping[str, float]) -> dict[str, float]:
  """Token-level loss, perplexity and accuracy from summed nll / correct / weight."""
  weight = max(totals['weight'], 1.0)
  loss = totals['nll'] / weight
  return {
      'loss': loss,
      'perplexity': math.exp(min(loss, 50.0)),
      'accuracy': totals['correct'] / weight,
      'tokens': totals['weight'],
  }


def cross_entropy(
    logits: Array, targets: Array, weights: Array, label_smoothing: float = 0.0
) -> dict[str, Array]:
  """Weighted sums over tokens (or rows): negative log-likelihood, smoothed objective,
  correct, weight.

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
  return {
      'nll': jnp.sum(nll * weights),
      'objective': jnp.sum(objective * weights),
      'correct': jnp.sum(correct * weights),
      'weight': jnp.sum(weights),
  }


def token_loss(outputs: Array, batch: Batch, label_smoothing: float) -> dict[str, Array]:
  """`cross_entropy` of the model's logits against `targets`, weighted by `weights`."""
  return cross_entropy(outputs, batch['targets'], batch['weights'], label_smoothing)


def sequence_forward(model, batch: Batch, **options):
  """One token sequence per row (decoder LM, encoder MLM)."""
  return model(
      batch['inputs'],
      positions=batch.get('positions'),
      segment_ids=batch.get('segment_ids'),
      **options,
  )


def sequence_flops(model, shapes) -> int:
  return model.flops(*shapes['inputs'][:2])


def segment_tokens(batch: Batch) -> Array:
  """Tokens that are not padding: those with a segment id."""
  return jnp.sum(batch['segment_ids'] > 0)


@dataclasses.dataclass(frozen=True)
class Task:
  """A training task.

  Attributes:
    name: the task's name (`config.task`, `config.data.task`).
    attention_types: the model's attention types, in `models.ATTENTION_TYPES`' names.
    data_format: how examples become batches (`lowrank_attn.data.RowFormat`).
    create_model: `(config, model_cfg, bos_id, rngs) -> nnx.Module`; `config` is the run's
      ConfigDict (for the task's own settings group), `model_cfg` its `TransformerConfig`.
    forward: `(model, batch, **options) -> (outputs, aux)`; options are those every model
      takes: deterministic, rngs, head_masks, return_weights, return_logits.
    loss: `(outputs, batch, label_smoothing) -> sums` with 'nll', 'objective', 'weight' (and
      'correct' where accuracy means something); the training loss is objective / weight.
    summarize: summed eval sums -> evaluation metrics.
    flops: `(model, batch shapes) -> forward matmul FLOPs` (a training step is ~3x).
    real_tokens: `batch -> tokens that are not padding` (what tokens/s counts).
    evaluators: `context -> [Evaluator]`, in the order their metrics are reported.
    final_splits: `config -> {name: split}` evaluated whole at the end (besides
      data.extra_test_files).
    settings: config groups the task adds, `{name: frozen dataclass}` (`config.<name>`),
      each validated by building it.
    check_config: `config -> None`, raises ValueError naming a field the task cannot use.
    model_class: the class `create_model` builds (how analyses find a model's task).
  """

  name: str
  attention_types: tuple[str, ...]
  data_format: RowFormat
  create_model: Callable[..., nnx.Module]
  forward: Callable[..., tuple[Array, dict]]
  flops: Callable[[nnx.Module, Mapping[str, tuple[int, ...]]], int]
  real_tokens: Callable[[Batch], Array]
  loss: Callable[[Array, Batch, float], dict[str, Array]] = token_loss
  summarize: Callable[[Mapping[str, float]], dict[str, float]] = token_summary
  evaluators: Callable[[EvalContext], list[Evaluator]] = None  # None: the loss evaluator
  final_splits: Callable[[Any], dict[str, str]] = lambda config: {}
  settings: Mapping[str, type] = dataclasses.field(default_factory=dict)
  check_config: Callable[[Any], None] = lambda config: None
  model_class: type | None = None

  @property
  def layer_fields(self) -> tuple[str, ...]:
    """The `TransformerConfig` layer counts this task's model uses."""
    stacks = {'encoder': 'num_encoder_layers', 'decoder': 'num_decoder_layers'}
    return tuple(field for stack, field in stacks.items() if stack in self.attention_types)

  def make_evaluators(self, context: EvalContext) -> list[Evaluator]:
    if self.evaluators is None:
      return [LossEvaluator(context, self.summarize)]
    return self.evaluators(context)
