"""Multi-head attention of every kind, as one pure function of a parameter dict.

    out = multi_head_attention(params, x, spec=spec, mask=mask).out

The kinds differ only in how they project inputs and compute per-head logits
(`project` + `logits`); masking, softmax, dropout, the weighted sum, head gates/masks and the
output projection are shared. Shapes: inputs `[batch..., length, features]`; per-head queries
and keys `[batch..., length, heads, head_dim]`; collaborative shared queries and keys
`[batch..., length, key_dim]`; logits and weights `[batch..., heads, q_length, kv_length]`.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from lowrank_attn.attention import core, dispatch
from lowrank_attn.attention.spec import AttentionSpec

Array = jax.Array
Params = dict[str, Array]


class AttentionOutput(NamedTuple):
  out: Array  # [batch..., q_length, out_features]
  weights: Array | None  # [batch..., heads, q_length, kv_length] float32, if requested
  cache: dict[str, Array] | None  # the updated decoding cache, if one was given
  logits: Array | None = None  # [batch..., heads, q_length, kv_length] float32, if requested


# --------------------------------------------------------------------------- logits per kind


def dot_product_logits(query: Array, key: Array, scale: float, precision=None) -> Array:
  """`[..., q, h, d]` x `[..., k, h_kv, d]` -> float32 `[..., h, q, k]` (h_kv divides h)."""
  heads, kv_heads = query.shape[-2], key.shape[-2]
  query = query * jnp.asarray(scale, query.dtype)  # scaling q is cheaper than the logits
  # Head-major operands make heads a leading batch dimension of the matrix product; XLA's
  # CPU backend is about 2x slower on batch dimensions that sit between free ones.
  query, key = jnp.swapaxes(query, -2, -3), jnp.swapaxes(key, -2, -3)
  if heads == kv_heads:
    return jnp.einsum(
        '...hqd,...hkd->...hqk', query, key, precision=precision, preferred_element_type=jnp.float32
    )
  grouped = query.reshape(*query.shape[:-3], kv_heads, heads // kv_heads, *query.shape[-2:])
  logits = jnp.einsum(
      '...hgqd,...hkd->...hgqk',
      grouped,
      key,
      precision=precision,
      preferred_element_type=jnp.float32,
  )
  return logits.reshape(*logits.shape[:-4], heads, *logits.shape[-2:])


def collaborative_logits(
    query: Array,
    key: Array,
    mixing: Array,
    scale: float,
    content_bias: Array | None = None,
    precision=None,
) -> Array:
  """Head i: `scale * ((Q diag(m_i)) K^T + 1 (X_k c_i)^T)` (Cordonnier et al. 2020, eq. 7).

  query `[..., q, key_dim]` and key `[..., k, key_dim]` are shared by all heads, mixing is
  `[heads, key_dim]`, content_bias `[..., k, heads]` holds x_k . c_i. Returns float32
  `[..., heads, q, k]`.
  """
  # [..., h, q, key_dim]: heads x queries form the rows of one matrix product per example.
  mixed = query[..., None, :, :] * (mixing * scale).astype(query.dtype)[:, None, :]
  logits = jnp.einsum(
      '...hqd,...kd->...hqk', mixed, key, precision=precision, preferred_element_type=jnp.float32
  )
  if content_bias is not None:
    bias = jnp.swapaxes(content_bias, -1, -2).astype(jnp.float32) * scale  # [..., h, k]
    logits = logits + bias[..., :, None, :]
  return logits


def mix_heads(x: Array, mixing: Array, precision=None) -> Array:
  """Talking heads: `out[g] = sum_h x[h] mixing[h, g]` over `[..., heads, q, k]` (Shazeer eq. 3)."""
  return jnp.einsum('...hqk,hg->...gqk', x, mixing.astype(x.dtype), precision=precision)


# --------------------------------------------------------------------------- projections


def _layer_norm(x: Array, scale: Array, epsilon: float = 1e-6) -> Array:
  x32 = x.astype(jnp.float32)
  mean = jnp.mean(x32, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
  return ((x32 - mean) * jax.lax.rsqrt(var + epsilon) * scale).astype(x.dtype)


def _dense(x: Array, kernel: Array, bias: Array | None, precision, in_axes: int = 1) -> Array:
  """Contract the last `in_axes` axes of x with the first `in_axes` of kernel.

  As one 2-D matrix product: XLA:CPU computes the weight gradient of a contraction over
  several batch dimensions about 30% slower than that of the same product flattened.
  """
  in_shape, out_shape = kernel.shape[:in_axes], kernel.shape[in_axes:]
  fan_in = math.prod(in_shape)
  y = jnp.matmul(x.reshape(-1, fan_in), kernel.reshape(fan_in, -1), precision=precision)
  y = y.reshape(*x.shape[: x.ndim - in_axes], *out_shape)
  return y if bias is None else y + bias


def project(
    params: Params,
    spec: AttentionSpec,
    inputs_q: Array,
    inputs_k: Array,
    inputs_v: Array,
    precision=None,
) -> tuple[Array, Array, Array, Array | None]:
  """Queries, keys, values and (collaborative) key-content bias, in the inputs' dtype."""
  p = params.get
  value = _dense(inputs_v, p('value_kernel'), p('value_bias'), precision)
  if spec.is_dot_product:
    query = _dense(inputs_q, p('query_kernel'), p('query_bias'), precision)
    key = _dense(inputs_k, p('key_kernel'), p('key_bias'), precision)
    if spec.normalize_qk:
      query = _layer_norm(query, p('query_ln_scale'))
      key = _layer_norm(key, p('key_ln_scale'))
    return query, key, value, None
  query = _dense(inputs_q, p('query_kernel'), None, precision)
  key = _dense(inputs_k, p('key_kernel'), None, precision)
  content_bias = None
  if spec.use_bias:
    content_bias = _dense(inputs_k, p('content_bias'), None, precision)
  return query, key, value, content_bias


def logits(
    params: Params,
    spec: AttentionSpec,
    query: Array,
    key: Array,
    content_bias: Array | None,
    precision=None,
) -> Array:
  """Per-head logits of `spec.kind`, float32 `[..., heads, q, k]`, before masking."""
  if spec.kind == 'collaborative':
    return collaborative_logits(
        query, key, params['mixing'], spec.logit_scale, content_bias, precision
    )
  result = dot_product_logits(query, key, spec.logit_scale, precision)
  if spec.kind == 'talking_heads':
    result = mix_heads(result, params['pre_softmax_mixing'], precision)
  return result


# --------------------------------------------------------------------------- decoding cache


def init_cache(
    spec: AttentionSpec, batch_shape: tuple[int, ...], max_length: int, dtype=jnp.float32
) -> dict[str, Array]:
  """An empty autoregressive cache: projected keys/values of up to `max_length` positions.

  Collaborative layers cache one shared key of width key_dim per position instead of
  num_heads keys of width head_dim, plus the per-head key-content bias.

  The caller keeps decoding within `max_length` positions: the cache index is traced, so a step
  past the end is not caught; its keys overwrite the last slots and the output is wrong (as in
  flax's layer). Make the cache as long as the longest output.
  """
  batch_shape = tuple(batch_shape)
  h, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
  if spec.is_dot_product:
    cache = {
        'key': jnp.zeros((*batch_shape, max_length, spec.key_heads, d), dtype),
        'value': jnp.zeros((*batch_shape, max_length, hkv, d), dtype),
    }
  else:
    cache = {
        'key': jnp.zeros((*batch_shape, max_length, spec.key_dim), dtype),
        'value': jnp.zeros((*batch_shape, max_length, h, d), dtype),
    }
    if spec.use_bias:
      cache['content_bias'] = jnp.zeros((*batch_shape, max_length, h), dtype)
  cache['index'] = jnp.zeros((), jnp.int32)
  return cache


def _append_to_cache(cache, key, value, content_bias, length_axis):
  """Write this step's keys/values at `cache['index']`; return the cache and all keys/values."""
  index = cache['index']
  write = lambda buffer, new: jax.lax.dynamic_update_slice_in_dim(
      buffer, new.astype(buffer.dtype), index, axis=length_axis
  )
  new_cache = {
      'key': write(cache['key'], key),
      'value': write(cache['value'], value),
      'index': index + key.shape[length_axis],
  }
  if content_bias is not None:
    new_cache['content_bias'] = write(cache['content_bias'], content_bias)
  return new_cache


# --------------------------------------------------------------------------- the layer function


def _check_inputs(params, spec, inputs_q, inputs_k, inputs_v, cache):
  expected = spec.param_shapes()
  missing = sorted(set(expected) - set(params))
  unexpected = sorted(set(params) - set(expected))
  if missing or unexpected:
    raise ValueError(
        f'params do not match the spec (kind={spec.kind!r}): missing {missing}, '
        f'unexpected {unexpected}.'
    )
  for name, shape in expected.items():
    if tuple(params[name].shape) != shape:
      raise ValueError(
          f"params['{name}'] has shape {tuple(params[name].shape)}, "
          f'expected {shape} for {spec}.'
      )
  if inputs_q.ndim < 2:
    raise ValueError(
        f'inputs_q has shape {inputs_q.shape}: expected [batch..., length, ' 'features].'
    )
  for name, array, width in (
      ('inputs_q', inputs_q, spec.in_features),
      ('inputs_k', inputs_k, spec.in_kv_features),
      ('inputs_v', inputs_v, spec.in_kv_features),
  ):
    if array.shape[-1] != width or array.shape[:-2] != inputs_q.shape[:-2]:
      raise ValueError(
          f'{name} has shape {array.shape}: expected [batch..., length, {width}] '
          f'with the batch dims of inputs_q {inputs_q.shape[:-2]}.'
      )
  if inputs_k.shape[-2] != inputs_v.shape[-2]:
    raise ValueError(
        f'inputs_k and inputs_v lengths differ: {inputs_k.shape[-2]} vs ' f'{inputs_v.shape[-2]}.'
    )
  if cache is not None:
    if inputs_k.shape[-2] != inputs_q.shape[-2]:
      raise ValueError(
          'a decoding cache is for self-attention: inputs_k must have the length '
          f'of inputs_q ({inputs_q.shape[-2]}), got {inputs_k.shape[-2]}.'
      )
    max_length = cache['value'].shape[inputs_q.ndim - 2]
    if inputs_q.shape[-2] > max_length:
      raise ValueError(
          f'decoding {inputs_q.shape[-2]} positions at once exceeds the cache '
          f'length {max_length}.'
      )


def _check_segment_ids(segment_ids, batch_shape, q_length, kv_length) -> None:
  """ValueError unless `segment_ids` is an integer (query, key) pair of the right lengths."""
  if not isinstance(segment_ids, (tuple, list)) or len(segment_ids) != 2:
    raise ValueError(
        'segment_ids must be a (query_segment_ids, key_segment_ids) pair, got '
        f'{type(segment_ids).__name__}.'
    )
  for name, ids, length in (
      ('query', segment_ids[0], q_length),
      ('key', segment_ids[1], kv_length),
  ):
    if not jnp.issubdtype(jnp.result_type(ids), jnp.integer):
      raise ValueError(f'{name} segment_ids must be integers, got {jnp.result_type(ids)}.')
    core.check_broadcastable(
        f'{name} segment_ids', jnp.shape(ids), (*batch_shape, length), f'[batch..., {name}_length]'
    )


def _without_heads(
    params, spec, inputs_q, inputs_k, cache, dtype, return_weights, return_logits
) -> AttentionOutput:
  """A fully pruned layer (num_heads=0): its output is its output bias."""
  q_length = inputs_q.shape[-2]
  out = jnp.zeros((*inputs_q.shape[:-1], spec.out_features), dtype)
  if 'out_bias' in params:
    out = out + params['out_bias']
  kv_length = inputs_k.shape[-2]
  if cache is not None:  # the decoding position still advances
    kv_length = cache['value'].shape[inputs_q.ndim - 2]
    cache = {**cache, 'index': cache['index'] + q_length}
  empty = jnp.zeros((*inputs_q.shape[:-2], 0, q_length, kv_length), jnp.float32)
  return AttentionOutput(
      out, empty if return_weights else None, cache, empty if return_logits else None
  )


def multi_head_attention(
    params: Params,
    inputs_q: Array,
    inputs_k: Array | None = None,
    inputs_v: Array | None = None,
    *,
    spec: AttentionSpec,
    mask: Array | None = None,
    is_causal: bool = False,
    segment_ids: tuple[Array, Array] | None = None,
    head_mask: Array | None = None,
    cache: dict[str, Array] | None = None,
    rng: Array | None = None,
    dropout_rate: float | None = None,
    broadcast_dropout: bool = True,
    deterministic: bool = True,
    return_weights: bool = False,
    return_logits: bool = False,
    dtype=None,
    precision=None,
    implementation: str | None = None,
    block_size: int | None = None,
    platform: str | None = None,
    name: str | None = None,
) -> AttentionOutput:
  """Multi-head attention of kind `spec.kind`.

  Args:
    params: arrays named and shaped as `spec.param_shapes()`.
    inputs_q: `[batch..., q_length, in_features]`.
    inputs_k: `[batch..., kv_length, in_kv_features]`; defaults to inputs_q.
    inputs_v: like inputs_k; defaults to inputs_k.
    spec: the layer's kind and sizes.
    mask: boolean (or 0/1) mask broadcastable to `[batch..., heads, q_length, kv_length]`;
      False hides a key from a query. A query that sees no key outputs 0 (never NaN).
    is_causal: also hide keys after the query's position.
    segment_ids: int (query `[batch..., q_length]`, key `[batch..., kv_length]`) segment ids of
      packed sequences, 0 for padding: a query sees only keys of its own segment, and nothing
      sees padding (the mask `core.segment_mask` builds, ANDed with `mask`). 'pallas' and
      'splash' take them as their kernels' segment ids (they take no boolean mask); the others
      as that mask.
    head_mask: `[heads]` or `[batch..., heads]` factors multiplying each head's output
      before the output projection: 0/1 to prune heads; its gradient at ones is the head
      importance of Michel et al. (2019).
    cache: from `init_cache`: decode `q_length` new positions (self-attention) appended at
      `cache['index']`; the query at step t sees cached keys 0..t. Returned updated.
    rng: PRNG key for attention dropout and, when gated, gate noise (needed when not
      deterministic and either is active).
    dropout_rate: attention dropout probability, in [0, 1); default `spec.dropout_rate`.
    broadcast_dropout: one dropout mask shared over batch and heads (as flax).
    deterministic: no dropout, and evaluation-mode (deterministic) gates.
    return_weights: also return the attention weights (after talking-heads mixing, before
      dropout).
    return_logits: also return the pre-softmax logits (scaled, after talking-heads
      pre-softmax mixing, before masking): their rank is what Bhojanapalli et al. bound.
    dtype: computation dtype; default: promoted from the inputs and parameters. Logits and
      the softmax are always float32.
    precision: `jax.lax.Precision` of the matrix products.
    implementation: 'xla' materialises `[batch..., heads, q_length, kv_length]`; 'blockwise'
      computes the same in O(length) memory (online softmax over key blocks, recomputing
      backward; dropout masks differ); 'cudnn', 'pallas' (GPU) and 'splash' (TPU) call fused
      kernels where the kind allows; 'auto' the one `dispatch.choose_implementation` picks for
      this call. See `lowrank_attn.attention.dispatch`. Default: `spec.implementation`, or
      'xla' with a cache (a decoding step's logits are O(length), and the fused kernels take
      no cache).
    block_size: queries and keys per block of 'blockwise'; default `spec.block_size`.
    platform: the backend 'auto' chooses for and 'cudnn'/'pallas'/'splash' are checked
      against; default `spec.platform` (None: `jax.default_backend()`).
    name: what an 'auto' choice is logged as ('encoder self-attention'); None: not logged.
  """
  if implementation is None:
    implementation = 'xla' if cache is not None else spec.implementation
  block_size = spec.block_size if block_size is None else block_size
  platform = spec.platform if platform is None else platform
  inputs_k = inputs_q if inputs_k is None else inputs_k
  inputs_v = inputs_k if inputs_v is None else inputs_v
  _check_inputs(params, spec, inputs_q, inputs_k, inputs_v, cache)
  dropout_rate = spec.dropout_rate if dropout_rate is None else dropout_rate
  if not 0.0 <= dropout_rate < 1.0:
    raise ValueError(f'dropout_rate={dropout_rate!r} must be in [0, 1).')
  stochastic = not deterministic and (dropout_rate > 0.0 or spec.gated)
  if stochastic and rng is None:
    raise ValueError('rng is required when deterministic=False and dropout_rate > 0 or gated.')

  if dtype is None:
    dtype = jnp.result_type(
        inputs_q, inputs_k, inputs_v, *(v for name, v in params.items() if name != 'gate_log_alpha')
    )
  options = dict(
      return_weights=return_weights,
      return_logits=return_logits,
      dropout=not deterministic and dropout_rate > 0.0,
      mask=mask is not None,
      cache=cache is not None,
      dtype=dtype,
      platform=platform,
  )
  if implementation == 'auto':
    q_length = inputs_q.shape[-2]
    kv_length = (
        cache['value'].shape[inputs_q.ndim - 2] if cache is not None else (inputs_k.shape[-2])
    )
    implementation = dispatch.choose_implementation(
        spec,
        q_length=q_length,
        kv_length=kv_length,
        batch=math.prod(inputs_q.shape[:-2]),
        **options,
    )
    if name is not None and cache is None:
      dispatch.log_choice(
          name,
          implementation,
          platform=platform,
          dtype=dtype,
          q_length=q_length,
          kv_length=kv_length,
      )
  dispatch.check_implementation(implementation, spec, block_size=block_size, **options)
  # Gate parameters stay float32: they only enter through float32 sigmoids.
  params = {
      name: value if name == 'gate_log_alpha' else jnp.asarray(value, dtype)
      for name, value in params.items()
  }
  inputs_q, inputs_k, inputs_v = (jnp.asarray(x, dtype) for x in (inputs_q, inputs_k, inputs_v))
  batch_shape = inputs_q.shape[:-2]
  length_axis = len(batch_shape)
  if spec.num_heads == 0:
    return _without_heads(
        params, spec, inputs_q, inputs_k, cache, dtype, return_weights, return_logits
    )

  query, key, value, content_bias = project(params, spec, inputs_q, inputs_k, inputs_v, precision)
  if cache is not None:
    step_mask = core.causal_mask(
        inputs_q.shape[-2], cache['value'].shape[length_axis], offset=cache['index']
    )
    cache = _append_to_cache(cache, key, value, content_bias, length_axis)
    key, value, content_bias = cache['key'], cache['value'], cache.get('content_bias')
    mask = core.combine_masks(mask, step_mask)
  elif is_causal and implementation == 'xla':  # the others build causal masks per block
    mask = core.combine_masks(mask, core.causal_mask(inputs_q.shape[-2], inputs_k.shape[-2]))

  if segment_ids is not None:
    _check_segment_ids(segment_ids, batch_shape, query.shape[length_axis], key.shape[length_axis])
    if implementation not in dispatch.SEGMENT_ID_IMPLEMENTATIONS:  # take the mask instead
      mask = core.combine_masks(mask, core.segment_mask(*segment_ids))
      segment_ids = None

  if implementation != 'xla':  # [..., q, h, d], never materialising [..., h, q, k]
    heads = dispatch.attend(
        params,
        spec,
        query,
        key,
        value,
        content_bias,
        mask=mask,
        is_causal=is_causal and cache is None,
        segment_ids=segment_ids,
        rng=rng if not deterministic and dropout_rate > 0.0 else None,
        dropout_rate=dropout_rate,
        broadcast_dropout=broadcast_dropout,
        implementation=implementation,
        block_size=block_size,
        precision=precision,
    )
    scores = returned_weights = None
  else:
    scores = logits(params, spec, query, key, content_bias, precision)
    if mask is not None:
      mask = jnp.asarray(mask).astype(bool)
      core.check_broadcastable(
          'mask', mask.shape, scores.shape, '[batch..., heads, q_length, kv_length]'
      )
    weights = core.masked_softmax(scores, mask)
    if spec.kind == 'talking_heads':
      weights = mix_heads(weights, params['post_softmax_mixing'].astype(jnp.float32), precision)
      if mask is not None:  # heads with different masks must not leak weight onto hidden keys
        weights = weights * mask
    returned_weights = weights if return_weights else None
    if not deterministic and dropout_rate > 0.0:
      weights = core.dropout(weights, rng, dropout_rate, broadcast_dropout)
    heads = core.weighted_sum(weights, value, precision)  # [..., q, h, d]

  head_scale = head_mask
  if head_scale is not None:
    core.check_broadcastable(
        'head_mask', jnp.shape(head_scale), (*batch_shape, spec.num_heads), '[batch..., heads]'
    )
  if spec.gated:
    log_alpha = params['gate_log_alpha']
    gates = (
        spec.gate.deterministic(log_alpha)
        if deterministic
        else spec.gate.sample(jax.random.fold_in(rng, 1), log_alpha)
    )
    head_scale = gates if head_scale is None else head_scale * gates
  if head_scale is not None:
    heads = heads * jnp.asarray(head_scale, dtype)[..., None, :, None]

  out = _dense(heads, params['out_kernel'], params.get('out_bias'), precision, in_axes=2)
  return AttentionOutput(out, returned_weights, cache, scores if return_logits else None)
