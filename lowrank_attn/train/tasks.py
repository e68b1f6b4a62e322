"""What a task is, in one record: its model, attention types, forward pass, cost and extras.

Batches (from `lowrank_attn.data`), pad id 0, all `[batch, length]`:
  lm   inputs, targets, weights, segment_ids, positions
  mlm  inputs (with [MASK]s), targets, weights (1 on predicted tokens), segment_ids, positions
  nmt  inputs (source), targets, weights; packed rows add inputs_segment_ids, inputs_positions,
       targets_segment_ids, targets_positions

A new task (or an experiment's variant of one) is a new `Task`: the config, the training
loop and the benchmarks read everything task-specific from here.
"""

from collections.abc import Callable, Mapping
import dataclasses

from flax import nnx
import jax
import jax.numpy as jnp

from lowrank_attn import models

Array = jax.Array
Batch = Mapping[str, Array]


@dataclasses.dataclass(frozen=True)
class Task:
  """A training task.

  Attributes:
    name: 'lm' | 'mlm' | 'nmt'.
    attention_types: the model's attention types, in `models.ATTENTION_TYPES`' names.
    create_model: `(TransformerConfig, bos_id, rngs) -> nnx.Module`.
    forward: `(model, batch, **options) -> (logits, aux)`; options are those every model
      takes: deterministic, rngs, head_masks, return_weights, return_logits.
    flops: `(model, batch shapes) -> forward matmul FLOPs` (a training step is ~3x).
    translates: evaluation also decodes and scores BLEU/chrF (`lowrank_attn.train.decode`).
  """

  name: str
  attention_types: tuple[str, ...]
  create_model: Callable[..., nnx.Module]
  forward: Callable[..., tuple[Array, dict]]
  flops: Callable[[nnx.Module, Mapping[str, tuple[int, ...]]], int]
  translates: bool = False

  @property
  def layer_fields(self) -> tuple[str, ...]:
    """The `TransformerConfig` layer counts this task's model uses."""
    stacks = {'encoder': 'num_encoder_layers', 'decoder': 'num_decoder_layers'}
    return tuple(field for stack, field in stacks.items() if stack in self.attention_types)

  def real_tokens(self, batch: Batch) -> Array:
    """Tokens that are not padding, source and target sides: what tokens/s counts."""
    if self.name == 'nmt':
      return jnp.sum(batch['inputs'] != 0) + jnp.sum(batch['targets'] != 0)
    return jnp.sum(batch['segment_ids'] > 0)


def _sequence_forward(model, batch: Batch, **options):
  return model(batch['inputs'], positions=batch.get('positions'),
               segment_ids=batch.get('segment_ids'), **options)


def _translation_forward(model, batch: Batch, **options):
  packed = {k: batch[k] for k in ('inputs_segment_ids', 'inputs_positions',
                                  'targets_segment_ids', 'targets_positions') if k in batch}
  return model(batch['inputs'], batch['targets'], **packed, **options)


def _sequence_flops(model, shapes) -> int:
  return model.flops(*shapes['inputs'][:2])


def _translation_flops(model, shapes) -> int:
  batch, source_length = shapes['inputs'][:2]
  return model.flops(batch, source_length, shapes['targets'][1])


TASKS: dict[str, Task] = {
    'lm': Task(
        name='lm', attention_types=('decoder',),
        create_model=lambda cfg, bos_id, rngs: models.DecoderLM(cfg, rngs=rngs),
        forward=_sequence_forward, flops=_sequence_flops),
    'mlm': Task(
        name='mlm', attention_types=('encoder',),
        create_model=lambda cfg, bos_id, rngs: models.EncoderMLM(cfg, rngs=rngs),
        forward=_sequence_forward, flops=_sequence_flops),
    'nmt': Task(
        name='nmt', attention_types=('encoder', 'decoder', 'cross'),
        create_model=lambda cfg, bos_id, rngs: models.EncoderDecoder(cfg, bos_id=bos_id,
                                                                     rngs=rngs),
        forward=_translation_forward, flops=_translation_flops, translates=True),
}


def get(name: str) -> Task:
  if name not in TASKS:
    raise ValueError(f'task={name!r} is not one of {tuple(TASKS)}.')
  return TASKS[name]
