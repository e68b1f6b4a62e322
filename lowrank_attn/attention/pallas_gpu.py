"""Flash attention as a Pallas kernel of our own: Triton on a GPU, Pallas' interpreter elsewhere.

    heads = flash_attention(query, key, value, key_bias=..., segment_ids=..., is_causal=...)

For what cuDNN cannot take, first of all collaborative attention: one key of width D_k shared
by every head (multi-query), per-head values of another width d_v, and the key-content bias as
a per-(head, key) logit bias instead of extra key columns. Shared or grouped keys and values
are read through the block index maps (head h reads key head h // (heads / key_heads)), never
broadcast in memory.

Forward (Dao 2023, FlashAttention-2): the grid is (query block, batch, head); each program
holds its query block and scans the key blocks (causal: only those at or below the diagonal)
with an online softmax in float32, writing the output and the row's log-sum-exp. Backward:
two kernels recompute the weights from the log-sum-exp, dQ (grid over query blocks, scanning
key blocks) and dK, dV, d(key_bias) per query head (grid over key blocks, scanning query
blocks); heads sharing a key or value head are summed outside the kernel.

Masks: `is_causal` and segment ids (`core.segment_mask`'s semantics: a query sees the keys of
its own id, and no key of id <= 0), both built per block from positions and ids, so memory is
O(length). A query that sees no key outputs 0 (its log-sum-exp is +inf, so the backward's
weights are 0 too), never NaN.

Triton wants power-of-two blocks: lengths are padded to whole blocks (padded keys hidden),
head widths to powers of two >= 16 with zero columns (which change no product). float32
inputs multiply in IEEE float32 (Triton's default would be TF32); bfloat16 ones in bfloat16
with float32 accumulation, the weights rounded to bfloat16 before the product with the
values, as in flash attention.

Not yet run on a GPU (none was available when it was written): the tests run it in Pallas'
interpreter on CPU against the materialising path (tests/attention/test_pallas_gpu.py);
tests/gpu/test_pallas_gpu.py is for the next GPU machine.
"""

import dataclasses
import functools
import math

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from lowrank_attn.attention import core

Array = jax.Array

# Queries and keys per block (jax's own Triton attention uses 128 x 128 forward, 32 x 32
# backward; ours are untuned).
BLOCK_Q = 64
BLOCK_K = 64
MIN_WIDTH = 16  # Triton's smallest dot operand


def flash_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    key_bias: Array | None = None,
    segment_ids: tuple[Array, Array] | None = None,
    is_causal: bool = False,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
    interpret: bool | None = None
) -> Array:
  """softmax(q k^T + key_bias, masked) v per head, as one fused kernel (and two backward).

  Args:
    query: `[batch..., q, heads, dk]`, already scaled.
    key: `[batch..., kv, key_heads, dk]`; key_heads divides heads (1: collaborative).
    value: `[batch..., kv, value_heads, dv]`; value_heads divides heads; dv may differ from dk.
    key_bias: float `[batch..., heads, kv]` added to every query's logits (collaborative's
      content bias), or None.
    segment_ids: int (query `[batch..., q]`, key `[batch..., kv]`), or None.
    is_causal: hide key j from query i when j > i.
    block_q, block_k: queries and keys per block (powers of two >= 16 on a GPU).
    interpret: run in Pallas' interpreter; None: unless the default backend is a GPU.
  Returns:
    `[batch..., q, heads, dv]` in value's dtype.
  """
  core.check_head_groups(query, key, value)
  batch_shape, (q_length, heads, dk) = query.shape[:-3], query.shape[-3:]
  (kv_length, key_heads), (value_heads, dv) = key.shape[-3:-1], value.shape[-2:]
  if interpret is None:
    interpret = jax.default_backend() != 'gpu'
  bq = min(block_q, max(MIN_WIDTH, pl.next_power_of_2(q_length)))
  bk = min(block_k, max(MIN_WIDTH, pl.next_power_of_2(kv_length)))
  q_padded, kv_padded = -(-q_length // bq) * bq, -(-kv_length // bk) * bk
  width = lambda d: max(MIN_WIDTH, pl.next_power_of_2(d))
  batch = math.prod(batch_shape)

  def operand(x, padded, d):  # [batch..., L, h, d] -> [B, L_padded, h, width(d)]
    x = x.reshape(batch, *x.shape[-3:])
    return jnp.pad(x, ((0, 0), (0, padded - x.shape[1]), (0, 0), (0, width(d) - d)))

  q = operand(query, q_padded, dk)
  k = operand(key.astype(query.dtype), kv_padded, dk)
  v = operand(value, kv_padded, dv)
  if key_bias is not None:
    key_bias = jnp.broadcast_to(key_bias, (*batch_shape, heads, kv_length))
    key_bias = jnp.pad(
        key_bias.reshape(batch, heads, kv_length).astype(jnp.float32),
        ((0, 0), (0, 0), (0, kv_padded - kv_length)),
    )
  q_ids = kv_ids = None
  if segment_ids is not None:

    def flat_ids(ids, length, padded):  # [batch..., L] -> int32 [B, L_padded], padding 0
      ids = jnp.broadcast_to(jnp.asarray(ids, jnp.int32), (*batch_shape, length))
      return jnp.pad(ids.reshape(batch, length), ((0, 0), (0, padded - length)))

    q_ids = flat_ids(segment_ids[0], q_length, q_padded)
    kv_ids = flat_ids(segment_ids[1], kv_length, kv_padded)
  config = _Config(
      block_q=bq,
      block_k=bk,
      kv_length=kv_length,
      is_causal=bool(is_causal),
      key_groups=heads // key_heads,
      value_groups=heads // value_heads,
      interpret=bool(interpret),
  )
  out = _flash(config, q, k, v, key_bias, q_ids, kv_ids)
  return out[:, :q_length, :, :dv].reshape(*batch_shape, q_length, heads, dv)


@dataclasses.dataclass(frozen=True)
class _Config:
  """Static settings of one call (hashable: a custom_vjp non-differentiable argument)."""

  block_q: int
  block_k: int
  kv_length: int  # before padding to whole blocks
  is_causal: bool
  key_groups: int  # query heads per key head
  value_groups: int
  interpret: bool

  def call(self, kernel, grid, in_specs, out_specs, out_shape, width, name):
    """`pl.pallas_call` with this call's compiler settings (those of jax's Triton attention)."""
    return pl.pallas_call(
        functools.partial(kernel, config=self),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=self.interpret,
        name=name,
        compiler_params=plgpu.CompilerParams(num_warps=4 if width <= 64 else 8, num_stages=2),
    )


# Operand layouts (grid axes (block, batch b, head h)): q, k, v, outputs `[B, L, heads, d]`,
# one block or the whole length of one (b, head) per program; key_bias `[B, heads, kv]`;
# lse and delta float32 `[B, heads, q]`; segment ids int32 `[B, L]`.


def _rows(d, block, groups=1):
  """BlockSpec of a `[B, L, heads / groups, d]` operand: query head h reads head h // groups;
  `block` rows: this program's block; `(length,)`: the whole length."""
  if isinstance(block, tuple):
    return pl.BlockSpec((None, *block, None, d), lambda i, b, h: (b, 0, h // groups, 0))
  return pl.BlockSpec((None, block, None, d), lambda i, b, h: (b, i, h // groups, 0))


def _per_head(length, block=None):
  """BlockSpec of a `[B, heads, L]` operand: this program's block, or the whole length."""
  if block is None:
    return pl.BlockSpec((None, None, length), lambda i, b, h: (b, h, 0))
  return pl.BlockSpec((None, None, block), lambda i, b, h: (b, h, i))


def _ids(length, block=None):
  """BlockSpec of int32 segment ids `[B, L]`: this program's block, or the whole length."""
  if block is None:
    return pl.BlockSpec((None, length), lambda i, b, h: (b, 0))
  return pl.BlockSpec((None, block), lambda i, b, h: (b, i))


def _scores(config, q, k, q_start, k_start, bias_ref, q_ids, kv_ids_ref):
  """Float32 logits `[bq, bk]` of one block pair, -inf where hidden."""
  bq, bk = q.shape[0], k.shape[0]
  s = plgpu.dot(q, k, trans_b=True, allow_tf32=False)
  k_slice = pl.ds(k_start, bk)
  if bias_ref is not None:
    s = s + bias_ref[k_slice][None, :]
  k_pos = k_start + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
  visible = k_pos < config.kv_length
  if config.is_causal:
    visible &= k_pos <= q_start + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
  if q_ids is not None:
    kv_ids = kv_ids_ref[k_slice][None, :]
    visible &= (q_ids[:, None] == kv_ids) & (kv_ids > 0)
  return jnp.where(visible, s, -jnp.inf)


def _kv_blocks(config, i, kv_padded):
  """Key blocks query block i sees: all, or (causal) those at or below the diagonal."""
  count = kv_padded // config.block_k
  if not config.is_causal:
    return count
  return jnp.minimum(count, lax.div((i + 1) * config.block_q + config.block_k - 1, config.block_k))


def _forward_kernel(
    q_ref, k_ref, v_ref, bias_ref, q_ids_ref, kv_ids_ref, o_ref, lse_ref, *, config
):
  bq, bk = config.block_q, config.block_k
  i = pl.program_id(0)
  q = q_ref[...]
  q_ids = None if q_ids_ref is None else q_ids_ref[...]

  def body(j, carry):
    acc, m, l = carry
    s = _scores(config, q, k_ref[pl.ds(j * bk, bk), :], i * bq, j * bk, bias_ref, q_ids, kv_ids_ref)
    m_next = jnp.maximum(m, jnp.max(s, axis=1))
    shift = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # a row with no key yet: p = 0
    p = jnp.exp(s - shift[:, None])
    alpha = jnp.exp(m - shift)
    v = v_ref[pl.ds(j * bk, bk), :]
    acc = alpha[:, None] * acc + plgpu.dot(p.astype(v.dtype), v, allow_tf32=False)
    return acc, m_next, alpha * l + jnp.sum(p, axis=1)

  acc = jnp.zeros((bq, v_ref.shape[-1]), jnp.float32)
  m = jnp.full((bq,), -jnp.inf, jnp.float32)
  acc, m, l = lax.fori_loop(
      0, _kv_blocks(config, i, k_ref.shape[0]), body, (acc, m, jnp.zeros((bq,), jnp.float32))
  )
  sees = l > 0
  o_ref[...] = (acc / jnp.where(sees, l, 1.0)[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(sees, m + jnp.log(jnp.where(sees, l, 1.0)), jnp.inf)


def _forward(config, q, k, v, bias, q_ids, kv_ids):
  """Output `[B, q_padded, heads, dv]` and float32 log-sum-exp `[B, heads, q_padded]`."""
  batch, q_padded, heads, dk = q.shape
  kv_padded, dv = k.shape[1], v.shape[-1]
  bq = config.block_q
  in_specs = [
      _rows(dk, bq),
      _rows(dk, (kv_padded,), config.key_groups),
      _rows(dv, (kv_padded,), config.value_groups),
      None if bias is None else _per_head(kv_padded),
      None if q_ids is None else _ids(q_padded, bq),
      None if kv_ids is None else _ids(kv_padded),
  ]
  return config.call(
      _forward_kernel,
      (q_padded // bq, batch, heads),
      in_specs,
      [_rows(dv, bq), _per_head(q_padded, bq)],
      [
          jax.ShapeDtypeStruct((batch, q_padded, heads, dv), v.dtype),
          jax.ShapeDtypeStruct((batch, heads, q_padded), jnp.float32),
      ],
      max(dk, dv),
      'lowrank_flash_forward',
  )(q, k, v, bias, q_ids, kv_ids)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(config, q, k, v, bias, q_ids, kv_ids):
  return _forward(config, q, k, v, bias, q_ids, kv_ids)[0]


def _flash_fwd(config, q, k, v, bias, q_ids, kv_ids):
  out, lse = _forward(config, q, k, v, bias, q_ids, kv_ids)
  return out, (q, k, v, bias, q_ids, kv_ids, out, lse)


def _dq_kernel(
    q_ref,
    k_ref,
    v_ref,
    bias_ref,
    q_ids_ref,
    kv_ids_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dq_ref,
    *,
    config
):
  bq, bk = config.block_q, config.block_k
  i = pl.program_id(0)
  q, do = q_ref[...], do_ref[...]
  lse, delta = lse_ref[...][:, None], delta_ref[...][:, None]
  q_ids = None if q_ids_ref is None else q_ids_ref[...]

  def body(j, dq):
    k = k_ref[pl.ds(j * bk, bk), :]
    p = jnp.exp(_scores(config, q, k, i * bq, j * bk, bias_ref, q_ids, kv_ids_ref) - lse)
    dp = plgpu.dot(do, v_ref[pl.ds(j * bk, bk), :], trans_b=True, allow_tf32=False)
    ds = p * (dp - delta)
    return dq + plgpu.dot(ds.astype(k.dtype), k, allow_tf32=False)

  dq = lax.fori_loop(
      0, _kv_blocks(config, i, k_ref.shape[0]), body, jnp.zeros(q.shape, jnp.float32)
  )
  dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkv_kernel(
    q_ref,
    k_ref,
    v_ref,
    bias_ref,
    q_ids_ref,
    kv_ids_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dk_ref,
    dv_ref,
    *dbias_ref,
    config
):
  bq, bk = config.block_q, config.block_k
  j = pl.program_id(0)
  k, v = k_ref[...], v_ref[...]

  def body(i, carry):
    dk, dv, dbias = carry
    rows = pl.ds(i * bq, bq)
    q, do = q_ref[rows, :], do_ref[rows, :]
    q_ids = None if q_ids_ref is None else q_ids_ref[rows]
    s = _scores(config, q, k, i * bq, j * bk, bias_ref, q_ids, kv_ids_ref)
    p = jnp.exp(s - lse_ref[rows][:, None])
    dv = dv + plgpu.dot(p.astype(do.dtype), do, trans_a=True, allow_tf32=False)
    dp = plgpu.dot(do, v, trans_b=True, allow_tf32=False)
    ds = p * (dp - delta_ref[rows][:, None])
    dk = dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True, allow_tf32=False)
    return dk, dv, dbias + jnp.sum(ds, axis=0)

  # Causal: query blocks before this key block's first key see none of it.
  first = lax.div(j * bk, bq) if config.is_causal else 0
  dk, dv, dbias = lax.fori_loop(
      first,
      q_ref.shape[0] // bq,
      body,
      (
          jnp.zeros(k.shape, jnp.float32),
          jnp.zeros(v.shape, jnp.float32),
          jnp.zeros((bk,), jnp.float32),
      ),
  )
  dk_ref[...], dv_ref[...] = dk, dv
  if dbias_ref:
    dbias_ref[0][...] = dbias


def _flash_bwd(config, residuals, d_out):
  """dQ, and dK, dV, d(key_bias) per query head summed over the heads sharing them."""
  q, k, v, bias, q_ids, kv_ids, out, lse = residuals
  batch, q_padded, heads, dk = q.shape
  kv_padded, dv = k.shape[1], v.shape[-1]
  bq, bk = config.block_q, config.block_k
  d_out = d_out.astype(out.dtype)
  # D = rowsum(dO * O), the softmax Jacobian's diagonal term: [B, heads, q] float32.
  delta = jnp.swapaxes(jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), -1), 1, 2)
  operands = (q, k, v, bias, q_ids, kv_ids, d_out, lse, delta)
  key_spec = _rows(dk, (kv_padded,), config.key_groups)
  value_spec = _rows(dv, (kv_padded,), config.value_groups)
  bias_spec = None if bias is None else _per_head(kv_padded)
  dq = config.call(
      _dq_kernel,
      (q_padded // bq, batch, heads),
      [
          _rows(dk, bq),
          key_spec,
          value_spec,
          bias_spec,
          None if q_ids is None else _ids(q_padded, bq),
          None if kv_ids is None else _ids(kv_padded),
          _rows(dv, bq),
          _per_head(q_padded, bq),
          _per_head(q_padded, bq),
      ],
      _rows(dk, bq),
      jax.ShapeDtypeStruct(q.shape, q.dtype),
      max(dk, dv),
      'lowrank_flash_dq',
  )(*operands)

  out_specs = [_rows(dk, bk), _rows(dv, bk)]
  out_shape = [
      jax.ShapeDtypeStruct((batch, kv_padded, heads, dk), jnp.float32),
      jax.ShapeDtypeStruct((batch, kv_padded, heads, dv), jnp.float32),
  ]
  if bias is not None:
    out_specs.append(_per_head(kv_padded, bk))
    out_shape.append(jax.ShapeDtypeStruct(bias.shape, jnp.float32))
  grads = config.call(
      _dkv_kernel,
      (kv_padded // bk, batch, heads),
      [
          _rows(dk, (q_padded,)),
          _rows(dk, bk, config.key_groups),
          _rows(dv, bk, config.value_groups),
          bias_spec,
          None if q_ids is None else _ids(q_padded),
          None if kv_ids is None else _ids(kv_padded),
          _rows(dv, (q_padded,)),
          _per_head(q_padded),
          _per_head(q_padded),
      ],
      out_specs,
      out_shape,
      max(dk, dv),
      'lowrank_flash_dkv',
  )(*operands)

  def per_shared_head(x, groups, like):  # [B, kv, heads, d] -> [B, kv, heads / groups, d]
    return x.reshape(batch, kv_padded, heads // groups, groups, -1).sum(3).astype(like.dtype)

  d_bias = grads[2] if bias is not None else None
  return (
      dq,
      per_shared_head(grads[0], config.key_groups, k),
      per_shared_head(grads[1], config.value_groups, v),
      d_bias,
      None,
      None,
  )


_flash.defvjp(_flash_fwd, _flash_bwd)
