"""What differs between the three tasks: which model, how a batch enters it, its FLOPs.

Batches (from `lowrank_attn.data`), pad id 0:
  lm   inputs, targets, weights, segment_ids, positions   [batch, length]
  mlm  inputs, targets, weights (1 on predicted tokens), segment_ids, positions
  nmt  inputs [batch, source_length], targets, weights [batch, target_length]
"""

from collections.abc import Mapping

from flax import nnx
import jax

from lowrank_attn import models

Array = jax.Array


def create_model(task: str, cfg: models.TransformerConfig, *, bos_id: int,
                 rngs: nnx.Rngs) -> nnx.Module:
  if task == 'lm':
    return models.DecoderLM(cfg, rngs=rngs)
  if task == 'mlm':
    return models.EncoderMLM(cfg, rngs=rngs)
  if task == 'nmt':
    return models.EncoderDecoder(cfg, bos_id=bos_id, rngs=rngs)
  raise ValueError(f'task={task!r} is not one of lm, mlm, nmt.')


def forward(model: nnx.Module, batch: Mapping[str, Array], task: str, *, deterministic: bool,
            rngs: nnx.Rngs | None = None, head_masks=None, return_weights: bool = False):
  """`(logits, aux)` of `model` on a task batch."""
  options = dict(deterministic=deterministic, rngs=rngs, head_masks=head_masks,
                 return_weights=return_weights)
  if task in ('lm', 'mlm'):
    return model(batch['inputs'], positions=batch.get('positions'),
                 segment_ids=batch.get('segment_ids'), **options)
  return model(batch['inputs'], batch['targets'], **options)


def forward_flops(model: nnx.Module, task: str, shapes: Mapping[str, tuple[int, ...]]) -> int:
  """Forward matmul FLOPs for a batch of these shapes (a training step costs ~3x)."""
  batch, length = shapes['inputs'][:2]
  if task == 'nmt':
    return model.flops(batch, length, shapes['targets'][1])
  return model.flops(batch, length)
