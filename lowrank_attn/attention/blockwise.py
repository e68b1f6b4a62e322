"""Attention in O(length) memory: blockwise over keys with an online softmax, pure JAX.

    heads = blockwise_attention(query, key, value, key_bias=..., mask=..., is_causal=...,
                                pre_mixing=..., post_mixing=..., block_size=128)

Queries in blocks of `block_size`, each scanning key blocks with an online softmax (Rabe &
Staats 2021; Dao et al. 2022, flash attention); causal attention skips key blocks above the
diagonal. A `jax.custom_vjp` saves only the output and the per-row log-sum-exp and recomputes
each block's weights in the backward pass, so memory is O(length) forward and backward. Every
kind reaches it through `dispatch.attend` (collaborative as shared keys plus a `key_bias`).

Talking heads (Shazeer et al. 2020): the pre-softmax mix is linear in one block's logits, so
it is applied per block. The post-softmax mix is not: out_g = sum_h P[h, g] softmax_h V_g
needs every head's *normalised* weights, and the online softmax only knows a row's
normaliser after its last key block. Accumulating sum_k exp(s_h - m_h) v_g for every pair
(h, g) would cost `heads` times the weighted sum; instead a first pass computes each row's
log-sum-exp per head, and a second pass forms normalised weights per block, mixes them and
accumulates the weighted sum. The backward pass needs one more pass for D_h = sum_k P_h dP_h
(which for plain attention is just rowsum(dO * O)). Per token pair: forward 3 and backward 7
head_dim-wide products, against 2 and 5 for the other kinds.

Dropout: each block (i, j) draws its keep mask from `fold_in(rng, i * num_kv_blocks + j)`, so
a result is reproducible for a given rng and block size (and is regenerated, not stored, in
the backward pass), but it is not the mask the materialising path draws.

Masks: a boolean mask broadcastable to `[batch..., heads, q, kv]` is sliced per block (it is
1 byte per entry where given in full; pass `is_causal=True` rather than a causal mask, which is
then built per block from positions and lets blocks above the diagonal be skipped). A query
that sees no key outputs 0, never NaN.
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from lowrank_attn.attention import core
from lowrank_attn.attention.spec import DEFAULT_BLOCK_SIZE

Array = jax.Array


def blockwise_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    key_bias: Array | None = None,
    mask: Array | None = None,
    is_causal: bool = False,
    pre_mixing: Array | None = None,
    post_mixing: Array | None = None,
    dropout_rng: Array | None = None,
    dropout_rate: float = 0.0,
    broadcast_dropout: bool = True,
    block_size: int = DEFAULT_BLOCK_SIZE,
    precision=None
) -> Array:
  """softmax(q k^T + key_bias, masked) v per head, in blocks; O(length) memory.

  Args:
    query: `[batch..., q, heads, dk]`, already scaled.
    key: `[batch..., kv, key_heads, dk]`; key_heads divides heads (a contiguous group of query
      heads shares a key head).
    value: `[batch..., kv, value_heads, dv]`; value_heads divides heads.
    key_bias: float32 `[batch..., heads, kv]`, added to every query's logits.
    mask: boolean, broadcastable to `[batch..., heads, q, kv]`; False hides a key.
    is_causal: also hide key j from query i when j > i.
    pre_mixing, post_mixing: float32 `[heads, heads]` talking-heads mixes of the logits and of
      the normalised weights (out[g] = sum_h x[h] mixing[h, g]).
    dropout_rng, dropout_rate, broadcast_dropout: attention dropout (no dropout when the rng
      is None or the rate 0); broadcast shares one `[q, kv]` mask over batch and heads.
    block_size: queries and keys per block.
  Returns:
    `[batch..., q, heads, dv]` in value's dtype.
  """
  batch_shape = query.shape[:-3]
  q_length, heads, dk = query.shape[-3:]
  kv_length, key_heads = key.shape[-3:-1]
  value_heads, dv = value.shape[-2:]
  core.check_head_groups(query, key, value)
  batch = 1
  for size in batch_shape:
    batch *= size
  q_block, kv_block = min(block_size, q_length), min(block_size, kv_length)
  q_padded = -(-q_length // q_block) * q_block
  kv_padded = -(-kv_length // kv_block) * kv_block

  def head_major(x, length, padded):  # [batch..., L, h, d] -> [B, h, L_padded, d]
    x = jnp.swapaxes(x.reshape(batch, length, *x.shape[-2:]), 1, 2)
    return jnp.pad(x, ((0, 0), (0, 0), (0, padded - length), (0, 0)))

  q = head_major(query, q_length, q_padded)
  k = head_major(key, kv_length, kv_padded)
  v = head_major(value, kv_length, kv_padded)
  if key_bias is not None:
    key_bias = jnp.broadcast_to(key_bias, (*batch_shape, heads, kv_length))
    key_bias = jnp.pad(
        key_bias.reshape(batch, heads, kv_length).astype(jnp.float32),
        ((0, 0), (0, 0), (0, kv_padded - kv_length)),
    )
  if mask is not None:
    mask = _block_layout_mask(mask, batch_shape, heads, q_length, kv_length, q_padded, kv_padded)
  dropout = dropout_rng is not None and dropout_rate > 0.0
  config = _Config(
      q_block=q_block,
      kv_block=kv_block,
      q_length=q_length,
      kv_length=kv_length,
      is_causal=bool(is_causal),
      dropout_rate=float(dropout_rate) if dropout else 0.0,
      broadcast_dropout=bool(broadcast_dropout),
      precision=precision,
  )
  out = _attention(
      config, q, k, v, key_bias, pre_mixing, post_mixing, mask, dropout_rng if dropout else None
  )
  out = jnp.swapaxes(out[:, :, :q_length], 1, 2)  # [B, q, heads, dv]
  return out.reshape(*batch_shape, q_length, heads, dv)


def _block_layout_mask(mask, batch_shape, heads, q_length, kv_length, q_padded, kv_padded):
  """`[B|1, heads|1, q_padded|1, kv_padded|1]` bool: broadcast axes stay 1, padding hidden."""
  mask = jnp.asarray(mask).astype(bool)
  full = (*batch_shape, heads, q_length, kv_length)
  core.check_broadcastable('mask', mask.shape, full, '[batch..., heads, q_length, kv_length]')
  mask = mask.reshape((1,) * (len(full) - mask.ndim) + mask.shape)
  n = len(batch_shape)
  if all(size == 1 for size in mask.shape[:n]):
    mask = mask.reshape(1, *mask.shape[n:])
  else:
    mask = jnp.broadcast_to(mask, (*batch_shape, *mask.shape[n:])).reshape(-1, *mask.shape[n:])
  pad = [
      (0, 0),
      (0, 0),
      (0, q_padded - q_length if mask.shape[2] > 1 else 0),
      (0, kv_padded - kv_length if mask.shape[3] > 1 else 0),
  ]
  return jnp.pad(mask, pad, constant_values=False)


@dataclasses.dataclass(frozen=True)
class _Config:
  """Static settings of one blockwise call (hashable: a custom_vjp non-differentiable arg)."""

  q_block: int
  kv_block: int
  q_length: int  # before padding to whole blocks
  kv_length: int
  is_causal: bool
  dropout_rate: float
  broadcast_dropout: bool
  precision: Any


# Blocks: q_i = q[:, :, i*bq:(i+1)*bq] `[B, heads, bq, dk]`, k_j, v_j likewise over keys; the
# logits of a block pair are float32 `[B, heads, bq, bk]`.


def _grouped(x: Array, heads_of_y: int) -> Array:
  """`[B, H, n, d]` -> `[B, H_y, (H / H_y) * n, d]`: the query heads sharing one head of y,
  stacked as rows of one matrix product (contiguous groups, as `core.weighted_sum`)."""
  b, h, n, d = x.shape
  return x.reshape(b, heads_of_y, (h // heads_of_y) * n, d)


def _ungrouped(x: Array, heads: int) -> Array:
  b, _, m, d = x.shape
  return x.reshape(b, heads, m * x.shape[1] // heads, d)


def _rows_times(x, y, heads, precision):
  """`x [B, H, n, m] @ y [B, H_y, m, d] -> float32 [B, H, n, d]` (grouped over H_y)."""
  out = jnp.einsum(
      'bhnm,bhmd->bhnd',
      _grouped(x, y.shape[1]),
      y,
      precision=precision,
      preferred_element_type=jnp.float32,
  )
  return _ungrouped(out, heads)


def _rows_dot(x, y, heads, precision):
  """`x [B, H, n, d] . y [B, H_y, m, d] -> float32 [B, H, n, m]` (grouped over H_y)."""
  out = jnp.einsum(
      'bhnd,bhmd->bhnm',
      _grouped(x, y.shape[1]),
      y,
      precision=precision,
      preferred_element_type=jnp.float32,
  )
  return _ungrouped(out, heads)


def _columns_dot(x, y, heads_out, precision):
  """`x [B, H, n, m]^T . y [B, H, n, d] -> float32 [B, H_out, m, d]`, summed over the query
  heads of each group (the gradient of a key or value head shared by a group)."""
  return jnp.einsum(
      'bhnm,bhnd->bhmd',
      _grouped(x, heads_out),
      _grouped(y, heads_out),
      precision=precision,
      preferred_element_type=jnp.float32,
  )


def _mix(x, mixing):
  """Talking heads: `out[g] = sum_h x[h] mixing[h, g]` over `[B, heads, bq, bk]`."""
  return jnp.einsum('bhqk,hg->bgqk', x, mixing)


class _Blocks:
  """Slicing, masking and logits of block pairs, shared by the forward and backward passes."""

  def __init__(self, config: _Config, q, k, v, key_bias, pre, post, mask, rng):
    self.c = config
    self.q, self.k, self.v = q, k, v
    self.key_bias, self.pre, self.post, self.mask, self.rng = key_bias, pre, post, mask, rng
    self.heads = q.shape[1]
    self.num_q = q.shape[2] // config.q_block
    self.num_kv = k.shape[2] // config.kv_block

  def q_slice(self, x, i, axis=2):
    return jax.lax.dynamic_slice_in_dim(x, i * self.c.q_block, self.c.q_block, axis=axis)

  def kv_slice(self, x, j, axis=2):
    return jax.lax.dynamic_slice_in_dim(x, j * self.c.kv_block, self.c.kv_block, axis=axis)

  def kv_end(self, i):
    """Key blocks query block i needs: causal attention stops at its last query's position."""
    if not self.c.is_causal:
      return self.num_kv
    last_query = jnp.minimum((i + 1) * self.c.q_block, self.c.q_length) - 1
    return jnp.minimum(last_query // self.c.kv_block + 1, self.num_kv)

  def q_start(self, j):
    """First query block that sees key block j."""
    return (j * self.c.kv_block) // self.c.q_block if self.c.is_causal else 0

  def visible(self, i, j):
    """bool `[B|1, heads|1, bq, bk]`, or None when every key of every block is visible."""
    c = self.c
    parts = []
    if self.mask is not None:
      m = self.mask
      if m.shape[2] > 1:
        m = self.q_slice(m, i)
      if m.shape[3] > 1:
        m = self.kv_slice(m, j, axis=3)
      parts.append(m)
    key_pos = j * c.kv_block + jnp.arange(c.kv_block)[None, :]
    if c.is_causal:
      parts.append(key_pos <= i * c.q_block + jnp.arange(c.q_block)[:, None])
    if self.k.shape[2] != c.kv_length:  # padded keys
      parts.append(key_pos < c.kv_length)
    return core.combine_masks(*parts)

  def logits(self, q_i, j, visible):
    """(raw q.k `[B, H, bq, bk]` float32, masked logits after pre-mixing and key bias)."""
    raw = _rows_dot(q_i, self.kv_slice(self.k, j), self.heads, self.c.precision)
    scores = raw if self.pre is None else _mix(raw, self.pre)
    if self.key_bias is not None:
      scores = scores + self.kv_slice(self.key_bias, j)[:, :, None, :]
    if visible is not None:  # as core.masked_softmax: a finite bias, then zeroed by the mask
      scores = scores + jnp.where(visible, 0.0, core.MASK_BIAS)
    return raw, scores

  def keep(self, i, j):
    """Dropout factors keep / keep_prob of block (i, j), or None without dropout."""
    if self.rng is None:
      return None
    c = self.c
    shape = ((1, 1) if c.broadcast_dropout else self.q.shape[:2]) + (c.q_block, c.kv_block)
    keep_prob = 1.0 - c.dropout_rate
    kept = jax.random.bernoulli(jax.random.fold_in(self.rng, i * self.num_kv + j), keep_prob, shape)
    return kept.astype(jnp.float32) / keep_prob

  def weights(self, scores, lse_i, visible):
    """Normalised weights of a block from the row log-sum-exp; post-mixed for talking heads."""
    p = jnp.exp(scores - lse_i[..., None])
    if visible is not None:
      p = p * visible
    if self.post is None:
      return p, p
    w = _mix(p, self.post)
    if visible is not None:  # heads with different masks must not leak weight onto hidden keys
      w = w * visible
    return p, w


def _online_softmax_step(scores, visible, m, l):
  """One key block of the online softmax: new row max, rescale factor, exp'd block, new sum."""
  m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
  p = jnp.exp(scores - m_new[..., None])
  if visible is not None:
    p = p * visible  # exactly 0 for hidden keys even in a row that sees none
  correction = jnp.exp(m - m_new)
  return m_new, correction, p, l * correction + jnp.sum(p, axis=-1)


def _log_sum_exp(m, l):
  # Rows that see no key (l == 0) get 0: their weights are zeroed by the mask anyway.
  return jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), 0.0)


def _forward(config: _Config, q, k, v, key_bias, pre, post, mask, rng):
  """(out `[B, heads, q_padded, dv]` in v's dtype, lse float32 `[B, heads, q_padded]`)."""
  blocks = _Blocks(config, q, k, v, key_bias, pre, post, mask, rng)
  b, heads = q.shape[:2]
  bq, dv, precision = config.q_block, v.shape[-1], config.precision
  stats0 = (jnp.full((b, heads, bq), -jnp.inf, jnp.float32), jnp.zeros((b, heads, bq), jnp.float32))

  def query_block(_, i):
    q_i = blocks.q_slice(q, i)
    if post is None:  # one pass: the online softmax rescales the running weighted sum

      def step(j, carry):
        m, l, acc = carry
        visible = blocks.visible(i, j)
        _, scores = blocks.logits(q_i, j, visible)
        m, correction, p, l = _online_softmax_step(scores, visible, m, l)
        keep = blocks.keep(i, j)
        p = p if keep is None else p * keep
        acc = acc * correction[..., None] + _rows_times(
            p.astype(v.dtype), blocks.kv_slice(v, j), heads, precision
        )
        return m, l, acc

      m, l, acc = jax.lax.fori_loop(
          0, blocks.kv_end(i), step, (*stats0, jnp.zeros((b, heads, bq, dv), jnp.float32))
      )
      out = acc / jnp.where(l > 0, l, 1.0)[..., None]
      return None, (out.astype(v.dtype), _log_sum_exp(m, l))

    # Talking heads: pass 1, each head's row log-sum-exp; pass 2, normalise, mix, accumulate.
    def stats_step(j, carry):
      m, l = carry
      visible = blocks.visible(i, j)
      _, scores = blocks.logits(q_i, j, visible)
      m, _, _, l = _online_softmax_step(scores, visible, m, l)
      return m, l

    lse_i = _log_sum_exp(*jax.lax.fori_loop(0, blocks.kv_end(i), stats_step, stats0))

    def sum_step(j, acc):
      visible = blocks.visible(i, j)
      _, scores = blocks.logits(q_i, j, visible)
      _, w = blocks.weights(scores, lse_i, visible)
      keep = blocks.keep(i, j)
      w = w if keep is None else w * keep
      return acc + _rows_times(w.astype(v.dtype), blocks.kv_slice(v, j), heads, precision)

    acc = jax.lax.fori_loop(
        0, blocks.kv_end(i), sum_step, jnp.zeros((b, heads, bq, dv), jnp.float32)
    )
    return None, (acc.astype(v.dtype), lse_i)

  _, (out, lse) = jax.lax.scan(query_block, None, jnp.arange(blocks.num_q))
  # [num_q, B, H, bq, ...] -> [B, H, num_q * bq, ...]
  out = jnp.moveaxis(out, 0, 2).reshape(b, heads, -1, dv)
  lse = jnp.moveaxis(lse, 0, 2).reshape(b, heads, -1)
  return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(config, q, k, v, key_bias, pre, post, mask, rng):
  return _forward(config, q, k, v, key_bias, pre, post, mask, rng)[0]


def _attention_fwd(config, q, k, v, key_bias, pre, post, mask, rng):
  out, lse = _forward(config, q, k, v, key_bias, pre, post, mask, rng)
  # Residuals are O(length): the inputs, the output and one float per (row, head).
  return out, (q, k, v, key_bias, pre, post, mask, rng, out, lse)


def _attention_bwd(config, residuals, d_out):
  """Flash-attention backward: recompute each block's weights from the saved log-sum-exp.

  dS = P * (dP - D) with D = rowsum(P * dP) (the softmax Jacobian); outer loop over key blocks
  (accumulating their dK, dV), inner over the query blocks that see them (adding into dQ).
  """
  q, k, v, key_bias, pre, post, mask, rng, out, lse = residuals
  blocks = _Blocks(config, q, k, v, key_bias, pre, post, mask, rng)
  heads, precision = q.shape[1], config.precision
  d_out = d_out.astype(v.dtype)
  f32 = lambda x: x.astype(jnp.float32)

  def d_weights(i, j, d_out_i, visible):
    """dL/d(normalised, post-mixed) weights of block (i, j), float32 `[B, H, bq, bk]`."""
    dw = _rows_dot(d_out_i, blocks.kv_slice(v, j), heads, precision)
    keep = blocks.keep(i, j)
    if keep is not None:
      dw = dw * keep
    if post is not None and visible is not None:
      dw = dw * visible
    return dw, keep

  if post is None:
    # D = rowsum(P * dP) = rowsum(dO * O): no extra pass.
    delta = jnp.sum(f32(d_out) * f32(out), axis=-1)
  else:
    # Talking heads: D_h = sum_k P_h dP_h with dP_h = sum_g post[h, g] dW_g: one more pass.
    def delta_block(_, i):
      q_i, d_out_i, lse_i = blocks.q_slice(q, i), blocks.q_slice(d_out, i), blocks.q_slice(lse, i)

      def step(j, delta_i):
        visible = blocks.visible(i, j)
        _, scores = blocks.logits(q_i, j, visible)
        p, _ = blocks.weights(scores, lse_i, visible)
        dw, _ = d_weights(i, j, d_out_i, visible)
        return delta_i + jnp.sum(p * _mix(dw, post.T), axis=-1)

      return None, jax.lax.fori_loop(0, blocks.kv_end(i), step, jnp.zeros_like(lse_i))

    _, delta = jax.lax.scan(delta_block, None, jnp.arange(blocks.num_q))
    delta = jnp.moveaxis(delta, 0, 2).reshape(lse.shape)

  zeros = lambda x: None if x is None else jnp.zeros(x.shape, jnp.float32)

  def key_block(carry, j):
    k_j, v_j = blocks.kv_slice(k, j), blocks.kv_slice(v, j)

    def step(i, inner):
      dk_j, dv_j, dkb_j, d_pre, d_post, dq = inner
      q_i, d_out_i = blocks.q_slice(q, i), blocks.q_slice(d_out, i)
      visible = blocks.visible(i, j)
      raw, scores = blocks.logits(q_i, j, visible)
      p, w = blocks.weights(scores, blocks.q_slice(lse, i), visible)
      dw, keep = d_weights(i, j, d_out_i, visible)
      w = w if keep is None else w * keep
      dv_j = dv_j + _columns_dot(w.astype(v.dtype), d_out_i, v.shape[1], precision)
      if post is None:
        dp = dw
      else:
        d_post = d_post + jnp.einsum('bhqk,bgqk->hg', p, dw)
        dp = _mix(dw, post.T)
      ds = p * (dp - blocks.q_slice(delta, i)[..., None])
      if key_bias is not None:
        dkb_j = dkb_j + jnp.sum(ds, axis=2)
      if pre is not None:
        d_pre = d_pre + jnp.einsum('bhqk,bgqk->hg', raw, ds)
        ds = _mix(ds, pre.T)
      ds = ds.astype(q.dtype)
      dq_i = _rows_times(ds, k_j, heads, precision)
      dq = jax.lax.dynamic_update_slice_in_dim(
          dq, blocks.q_slice(dq, i) + dq_i, i * config.q_block, axis=2
      )
      dk_j = dk_j + _columns_dot(ds, q_i, k.shape[1], precision)
      return dk_j, dv_j, dkb_j, d_pre, d_post, dq

    d_pre, d_post, dq = carry
    inner = (
        zeros(k_j),
        zeros(v_j),
        None if key_bias is None else zeros(blocks.kv_slice(key_bias, j)),
        d_pre,
        d_post,
        dq,
    )
    dk_j, dv_j, dkb_j, d_pre, d_post, dq = jax.lax.fori_loop(
        blocks.q_start(j), blocks.num_q, step, inner
    )
    return (d_pre, d_post, dq), (dk_j, dv_j, dkb_j)

  (d_pre, d_post, dq), (dk, dv, dkb) = jax.lax.scan(
      key_block, (zeros(pre), zeros(post), zeros(q)), jnp.arange(blocks.num_kv)
  )
  from_blocks = lambda x: jnp.moveaxis(x, 0, 2).reshape(*x.shape[1:3], -1, *x.shape[4:])
  dk, dv = from_blocks(dk).astype(k.dtype), from_blocks(dv).astype(v.dtype)
  if dkb is not None:
    dkb = from_blocks(dkb)
  return (dq.astype(q.dtype), dk, dv, dkb, d_pre, d_post, None, None)


_attention.defvjp(_attention_fwd, _attention_bwd)
