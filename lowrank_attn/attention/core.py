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
      a in (1, t) for a, t in zip(reversed(array_shape), reversed(target_shape))
  )
  if not ok:
    raise ValueError(
        f'{name} has shape {tuple(array_shape)}, which does not broadcast to '
        f'{target_desc} = {tuple(target_shape)}.'
    )


def check_head_groups(query, key, value) -> None:
  """ValueError unless key and value heads (`[..., heads, d]`) each divide the query heads."""
  heads, key_heads, value_heads = query.shape[-2], key.shape[-2], value.shape[-2]
  if heads % key_heads or heads % value_heads:
    raise ValueError(
        f'key heads ({key_heads}) and value heads ({value_heads}) must divide the '
        f'query heads ({heads}).'
    )


# Added to hidden logits. Finite, so no inf - inf = NaN anywhere; far below any real logit,
# so exp() of a hidden entry is exactly 0 after the softmax's max-subtraction; and 0.7x the
# float32 max, so adding it to a (very negative) logit cannot overflow.
MASK_BIAS = -0.7 * float(jnp.finfo(jnp.float32).max)


def masked_softmax(logits: Array, mask: Array | None = None) -> Array:
  """Softmax over the last axis in float32; masked entries and fully masked rows give 0.

  Masking adds a bias built at the mask's own (broadcast, usually small) shape and multiplies
  by the mask afterwards: on XLA:CPU this fuses into the softmax, where `jnp.where` on the
  full logits costs about 4x more in the backward pass.
  """
  logits = logits.astype(jnp.float32)
  if mask is None:
    return jax.nn.softmax(logits, axis=-1)
  mask = jnp.asarray(mask).astype(bool)
  weights = jax.nn.softmax(logits + jnp.where(mask, 0.0, MASK_BIAS), axis=-1)
  # Hidden entries are already exactly 0, except in a row with nothing to attend to, which
  # comes out uniform: the product zeroes it.
  return weights * mask


def dropout(weights: Array, rng: Array, rate: float, broadcast: bool = True) -> Array:
  """Attention dropout. `broadcast` shares one `[q, kv]` mask over batch and heads (as flax)."""
  keep_prob = 1.0 - rate
  shape = (1,) * (weights.ndim - 2) + weights.shape[-2:] if broadcast else weights.shape
  keep = jax.random.bernoulli(rng, keep_prob, shape)
  return weights * (keep.astype(weights.dtype) / jnp.asarray(keep_prob, weights.dtype))


def weighted_sum(weights: Array, value: Array, precision=None) -> Array:
  """`[batch..., heads, q, kv]` x `[batch..., kv, kv_heads, d]` -> `[batch..., q, heads, d]`.

  With fewer value heads than query heads (grouped-query attention), each value head serves
  a contiguous group of query heads.
  """
  heads, kv_heads = weights.shape[-3], value.shape[-2]
  weights = weights.astype(value.dtype)
  value = jnp.swapaxes(value, -2, -3)  # head-major: heads become a leading batch dimension
  if heads == kv_heads:
    out = jnp.einsum('...hqk,...hkd->...hqd', weights, value, precision=precision)
  else:
    grouped = weights.reshape(*weights.shape[:-3], kv_heads, heads // kv_heads, *weights.shape[-2:])
    out = jnp.einsum('...hgqk,...hkd->...hgqd', grouped, value, precision=precision)
    out = out.reshape(*out.shape[:-4], heads, *out.shape[-2:])
  return jnp.swapaxes(out, -2, -3)
