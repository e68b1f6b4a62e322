"""The core every attention kind shares: masks, float32 masked softmax, dropout, weighted sum.

Shapes: logits and weights are `[batch..., heads, q_length, kv_length]`, values
`[batch..., kv_length, kv_heads, head_dim]`; masks are boolean (True = may attend) and
broadcast to the logits. Pure `jnp`; jit/vmap/grad-safe.
"""

import jax
import jax.numpy as jnp

Array = jax.Array


def causal_mask(q_length: int, kv_length: int | None = None, offset=0) -> Array:
  """`[q_length, kv_length]`: query i (at absolute position offset + i) sees keys 0..offset+i."""
  kv_length = q_length if kv_length is None else kv_length
  q_positions = jnp.arange(q_length)[:, None] + offset
  return jnp.arange(kv_length)[None, :] <= q_positions


def padding_mask(query_valid: Array, key_valid: Array) -> Array:
  """`[batch..., 1, q_length, kv_length]` from `[batch..., q_length]`, `[batch..., kv_length]`."""
  mask = query_valid.astype(bool)[..., :, None] & key_valid.astype(bool)[..., None, :]
  return mask[..., None, :, :]


def segment_mask(query_segments: Array, key_segments: Array) -> Array:
  """`[batch..., 1, q, kv]`: packed sequences attend within their segment; segment 0 is padding."""
  same = query_segments[..., :, None] == key_segments[..., None, :]
  return (same & (key_segments[..., None, :] > 0))[..., None, :, :]


def combine_masks(*masks: Array | None) -> Array | None:
  """Logical AND of the masks that are not None (broadcasting), or None."""
  result = None
  for mask in masks:
    if mask is not None:
      mask = jnp.asarray(mask).astype(bool)
      result = mask if result is None else result & mask
  return result


def check_broadcastable(name: str, array_shape, target_shape, target_desc: str) -> None:
  """ValueError naming `name` unless `array_shape` broadcasts to `target_shape`."""
  ok = len(array_shape) <= len(target_shape) and all(
      a in (1, t) for a, t in zip(reversed(array_shape), reversed(target_shape)))
  if not ok:
    raise ValueError(
        f'{name} has shape {tuple(array_shape)}, which does not broadcast to '
        f'{target_desc} = {tuple(target_shape)}.')


def masked_softmax(logits: Array, mask: Array | None = None) -> Array:
  """Softmax over the last axis in float32; masked entries and fully masked rows give 0."""
  logits = logits.astype(jnp.float32)
  if mask is None:
    return jax.nn.softmax(logits, axis=-1)
  # A finite fill keeps gradients NaN-free; the row's max-subtraction makes its exp exactly 0.
  weights = jax.nn.softmax(jnp.where(mask, logits, jnp.finfo(jnp.float32).min), axis=-1)
  # A row with nothing to attend to would come out uniform: make it 0 instead.
  return jnp.where(jnp.any(mask, axis=-1, keepdims=True), weights, 0.0)


def dropout(weights: Array, rng: Array, rate: float, broadcast: bool = True) -> Array:
  """Attention dropout. `broadcast` shares one `[q, kv]` mask over batch and heads (as flax)."""
  keep_prob = 1.0 - rate
  shape = (1,) * (weights.ndim - 2) + weights.shape[-2:] if broadcast else weights.shape
  keep = jax.random.bernoulli(rng, keep_prob, shape)
  return jnp.where(keep, weights / keep_prob, 0.0).astype(weights.dtype)


def weighted_sum(weights: Array, value: Array, precision=None) -> Array:
  """`[batch..., heads, q, kv]` x `[batch..., kv, kv_heads, d]` -> `[batch..., q, heads, d]`.

  With fewer value heads than query heads (grouped-query attention), each value head serves
  a contiguous group of query heads.
  """
  heads, kv_heads = weights.shape[-3], value.shape[-2]
  weights = weights.astype(value.dtype)
  if heads == kv_heads:
    return jnp.einsum('...hqk,...khd->...qhd', weights, value, precision=precision)
  grouped = weights.reshape(*weights.shape[:-3], kv_heads, heads // kv_heads, *weights.shape[-2:])
  out = jnp.einsum('...hgqk,...khd->...qhgd', grouped, value, precision=precision)
  return out.reshape(*out.shape[:-3], heads, out.shape[-1])
