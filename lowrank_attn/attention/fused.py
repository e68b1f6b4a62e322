"""Fused attention kernels behind our operands: cuDNN (GPU) and Pallas splash (TPU).

(Our own Pallas kernel, for what these cannot take, is `pallas_gpu.py`.)

Both take `query [batch..., q, heads, dk]` (already scaled), `key [batch..., kv, key_heads,
dk]`, `value [batch..., kv, value_heads, dv]` as `dispatch.attend` builds them and return
`[batch..., q, heads, dv]`; a query that sees no key outputs 0, as every implementation does.

'cudnn' has run on an H100 and an H200 (`tests/gpu`, `make test-gpu`); on CPU the tests run this wrapper
with jax's XLA implementation standing in for cuDNN. 'splash' has not run on a TPU: the tests
run its kernel in Pallas' CPU interpreter (alone and inside every model, with segment ids),
and `tpu/compile.py` compiles the train steps with it for TPU slices (tpu/README.md).
"""

import functools
import math

import jax
import jax.numpy as jnp

from lowrank_attn.attention import core

Array = jax.Array

# Splash's default block sizes (`BlockSizes.get_default()`): lengths are padded to multiples
# (on TPU its key blocks must be multiples of 128 lanes).
SPLASH_BLOCK = 128
# cuDNN's head widths: a multiple of 8, at most 256 on Hopper and later (128 before).
CUDNN_WIDTH_MULTIPLE = 8
CUDNN_MAX_WIDTH = 256
CUDNN_MAX_WIDTH_BEFORE_HOPPER = 128
CUDNN_HOPPER = (9, 0)
# Values of another width than keys ("mla" in jax): cuDNN >= 9.10 on compute capability >= 9.0.
CUDNN_MLA_VERSION = 91000
CUDNN_MLA_CAPABILITY = (9, 0)


def cudnn_accepts_value_width(
    cudnn_version: int | None = None, compute_capability: str | None = None
) -> bool:
  """Whether cuDNN computes attention with values narrower or wider than keys.

  cudnn_version: as cuDNN reports it (9.10.0 = 91000); compute_capability: '9.0'. None: those
  of this machine's first GPU (False without a GPU or cuDNN). jax 0.10's own check
  (`fused_attention_stablehlo.check_is_flash_attention`) is the rule; its public
  `jax.nn.dot_product_attention` still requires value.shape == key.shape, so where this holds
  `cudnn_attention` calls the cuDNN function behind it.
  """
  if cudnn_version is None and compute_capability is None:
    cudnn_version, compute_capability = _local_cudnn()
  if cudnn_version is None or compute_capability is None:
    return False
  capability = tuple(int(part) for part in str(compute_capability).split('.')[:2])
  return cudnn_version >= CUDNN_MLA_VERSION and capability >= CUDNN_MLA_CAPABILITY


def cudnn_max_width(compute_capability: str | None = None) -> int:
  """The widest head cuDNN attention takes on a GPU of `compute_capability` ('8.0'; None: this
  machine's first GPU, and with none, Hopper's: a call checked for a GPU elsewhere)."""
  if compute_capability is None:
    compute_capability = _local_cudnn()[1]
  if compute_capability is None:
    return CUDNN_MAX_WIDTH
  capability = tuple(int(part) for part in str(compute_capability).split('.')[:2])
  return CUDNN_MAX_WIDTH if capability >= CUDNN_HOPPER else CUDNN_MAX_WIDTH_BEFORE_HOPPER


@functools.cache
def _local_cudnn() -> tuple[int | None, str | None]:
  """(cuDNN version, compute capability) of this machine's first GPU, or (None, None)."""
  try:
    from jax._src.cudnn import fused_attention_stablehlo as cudnn  # GPU-only dependency

    return cudnn.check_cudnn_version(), jax.devices('gpu')[0].compute_capability
  except (ImportError, RuntimeError):
    return None, None


def cudnn_widths(key_width: int, value_width: int, mla: bool) -> tuple[int, int]:
  """The (query/key, value) head widths `cudnn_attention` hands cuDNN: each rounded up to a
  multiple of 8 with zero columns, and, where cuDNN needs equal widths (not `mla`), both the
  larger of the two. Zero columns change no product."""
  up = lambda d: -(-d // CUDNN_WIDTH_MULTIPLE) * CUDNN_WIDTH_MULTIPLE
  if mla:
    return up(key_width), up(value_width)
  return (up(max(key_width, value_width)),) * 2


def cudnn_attention(query, key, value, mask, is_causal):
  """GPU: cuDNN's fused attention over `[B, L, heads, d]`.

  cuDNN takes a mask as a bias of full shape `[B, heads|1, q, kv]` (a `[.., 1, kv]` padding
  mask is broadcast), and its backward pass needs even lengths: odd lengths are padded by one
  position, the padded key masked out, the padded query dropped.

  Collaborative attention (one key head, `heads` value heads): cuDNN wants as many key heads
  as value heads, so the shared key is broadcast to every value head. Head widths go through
  `cudnn_widths`: where `cudnn_accepts_value_width()` (cuDNN >= 9.10, Hopper or later) values
  keep their own width, else the narrower operand is padded with zero columns to the wider
  (exact, but the padded product costs its extra width).
  """
  batch_shape, (q_length, heads, _) = query.shape[:-3], query.shape[-3:]
  kv_length, dv = key.shape[-3], value.shape[-1]
  if key.shape[-2] != value.shape[-2]:  # collaborative: a key per value head
    key = jnp.broadcast_to(key, (*key.shape[:-2], value.shape[-2], key.shape[-1]))
  mla = key.shape[-1] != dv and cudnn_accepts_value_width()
  dk_cudnn, dv_cudnn = cudnn_widths(key.shape[-1], dv, mla)
  flat = lambda x, d: jnp.pad(
      x.reshape(-1, *x.shape[-3:]), ((0, 0), (0, 0), (0, 0), (0, d - x.shape[-1]))
  )
  query, key, value = flat(query, dk_cudnn), flat(key, dk_cudnn), flat(value, dv_cudnn)
  pad_q, pad_kv = q_length % 2, kv_length % 2
  if pad_kv and mask is None:
    mask = jnp.ones((q_length, kv_length), bool)
  if mask is not None:  # to [B, heads|1, q, kv]
    mask = jnp.asarray(mask, bool)
    mask = mask.reshape((1,) * (len(batch_shape) + 3 - mask.ndim) + mask.shape)
    mask = jnp.broadcast_to(mask, (*batch_shape, mask.shape[-3], q_length, kv_length))
    mask = jnp.pad(mask.reshape(-1, *mask.shape[-3:]), ((0, 0), (0, 0), (0, pad_q), (0, pad_kv)))
  along = lambda x, n: jnp.pad(x, ((0, 0), (0, n), (0, 0), (0, 0)))
  query, key, value = along(query, pad_q), along(key, pad_kv), along(value, pad_kv)
  if dk_cudnn != dv_cudnn:
    from jax._src.cudnn import fused_attention_stablehlo as cudnn  # GPU-only dependency

    out = cudnn.dot_product_attention(
        query,
        key,
        value,
        mask=mask,
        scale=1.0,
        mask_type=cudnn.MaskType.CAUSAL if is_causal else cudnn.MaskType.NO_MASK,
    )
  else:
    out = jax.nn.dot_product_attention(
        query, key, value, mask=mask, scale=1.0, is_causal=is_causal, implementation='cudnn'
    )
  out = out[:, :q_length, :, :dv]
  if mask is not None:  # our contract: a query that sees no key outputs 0
    mask = mask[..., :q_length, :kv_length]
    visible = mask & core.causal_mask(q_length, kv_length) if is_causal else mask
    sees_any = jnp.broadcast_to(jnp.any(visible, axis=-1), (out.shape[0], heads, q_length))
    out = out * jnp.swapaxes(sees_any, 1, 2)[..., None].astype(out.dtype)
  return out.reshape(*batch_shape, *out.shape[1:])


def splash_attention(query, key, value, is_causal, heads, segment_ids=None):
  """TPU: the Pallas splash-attention kernel, vmapped over the batch (run here only in Pallas'
  CPU interpreter).

  Lengths are padded to whole kernel blocks (`SPLASH_BLOCK`), padded keys hidden by segment
  id 0. Segment ids give `core.segment_mask`'s semantics: splash lets a query see the keys of
  its own id, so queries of id <= 0 (which see no key under that mask, and in splash would see
  padding) and queries whose segment has no (earlier, if causal) key output 0, as every
  implementation does.
  """
  from jax.experimental.pallas.ops.tpu.splash_attention import (  # TPU-only dependency
      splash_attention_kernel as splash,
      splash_attention_mask as splash_mask,
  )

  batch_shape = query.shape[:-3]
  q_length, kv_length = query.shape[-3], key.shape[-3]
  # Collaborative: splash wants a key per value head. Its multi-query kernel (make_splash_mqa)
  # takes one key but also one value head for all query heads, and collaborative heads have
  # values of their own; so the multi-head kernel, the key broadcast (value widths may differ
  # from key widths in both kernels).
  if key.shape[-2] != value.shape[-2]:
    key = jnp.broadcast_to(key, (*key.shape[:-2], value.shape[-2], key.shape[-1]))
  q_padded, kv_padded = (-(-n // SPLASH_BLOCK) * SPLASH_BLOCK for n in (q_length, kv_length))

  def head_major(x, padded):  # [batch..., L, h, d] -> [B, h, L_padded, d]
    x = jnp.swapaxes(x.reshape(-1, *x.shape[-3:]), 1, 2)
    return jnp.pad(x, ((0, 0), (0, 0), (0, padded - x.shape[2]), (0, 0)))

  def flat_ids(ids, length, padded):  # [batch..., L] -> int32 [B, L_padded], padding 0
    ids = jnp.broadcast_to(jnp.asarray(ids, jnp.int32), (*batch_shape, length))
    return jnp.pad(ids.reshape(-1, length), ((0, 0), (0, padded - length)))

  batch = math.prod(batch_shape)
  if segment_ids is not None:
    q_ids, kv_ids = flat_ids(segment_ids[0], q_length, q_padded), flat_ids(
        segment_ids[1], kv_length, kv_padded
    )
  elif kv_padded != kv_length:  # only to hide the padded keys
    q_ids = jnp.ones((batch, q_padded), jnp.int32)
    kv_ids = flat_ids(jnp.ones((kv_length,), jnp.int32), kv_length, kv_padded)
  shape = (q_padded, kv_padded)
  one = splash_mask.CausalMask(shape) if is_causal else splash_mask.FullMask(shape)
  kernel = splash.make_splash_mha(
      splash_mask.MultiHeadMask((one,) * heads), head_shards=1, q_seq_shards=1
  )
  operands = (head_major(query, q_padded), head_major(key, kv_padded), head_major(value, kv_padded))
  if segment_ids is not None or kv_padded != kv_length:
    operands += (splash.SegmentIds(q=q_ids, kv=kv_ids),)
  out = _per_batch_shard(jax.vmap(kernel), batch, *operands)
  out = jnp.swapaxes(out[:, :, :q_length], 1, 2)  # [B, q, heads, dv]
  if segment_ids is not None:
    sees_any = _sees_any_key(q_ids[:, :q_length], kv_ids, is_causal)
    out = out * sees_any[:, :, None, None].astype(out.dtype)
  return out.reshape(*batch_shape, q_length, heads, value.shape[-1])


def _per_batch_shard(fn, batch: int, *operands):
  """`fn(*operands)`, under a mesh in a `shard_map` over the leading (batch) axis.

  XLA cannot partition a Pallas kernel itself. The batch is split over every mesh axis whose
  size still divides it (data and fsdp in our layouts), each shard getting whole rows and all
  heads; operands are replicated over the other axes.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return fn(*operands)
  axes, shards = [], 1
  for name, size in mesh.shape.items():
    if size > 1 and batch % (shards * size) == 0:
      axes.append(name)
      shards *= size
  spec = jax.sharding.PartitionSpec(tuple(axes) if axes else None)
  return jax.shard_map(fn, in_specs=spec, out_specs=spec, check_vma=False)(*operands)


def _sees_any_key(q_ids: Array, kv_ids: Array, is_causal: bool) -> Array:
  """bool `[B, q]`: `core.segment_mask` (causal: and `causal_mask`) leaves query i some key.

  From each segment's first key (a sort, O(L log L)), never materialising `[B, q, kv]`.
  """
  order = jnp.argsort(kv_ids, axis=-1, stable=True)  # within a segment, keys in position order
  sorted_ids = jnp.take_along_axis(kv_ids, order, axis=-1)
  first = jax.vmap(jnp.searchsorted)(sorted_ids, q_ids)
  first = jnp.minimum(first, kv_ids.shape[-1] - 1)
  sees = (jnp.take_along_axis(sorted_ids, first, axis=-1) == q_ids) & (q_ids > 0)
  if is_causal:
    sees &= jnp.take_along_axis(order, first, axis=-1) <= jnp.arange(q_ids.shape[-1])
  return sees
