"""The attention op: per-kind operands, then the implementation that computes softmax(QK^T)V.

    heads = attend(params, spec, query, key, value, content_bias, mask=..., is_causal=...,
                   implementation='blockwise')

`multi_head_attention(..., implementation=...)` calls this after the projections; everything
before (projections, decoding cache) and after (head masks, gates, output projection) is shared
with the materialising path of `kernels.py` ('xla'), which never comes here.

Implementations (`PLATFORMS`: the backend each needs):
  'blockwise'  pure JAX, any backend, O(length) memory (`blockwise.py`).
  'cudnn'      GPU: cuDNN's fused attention (`fused.py`), bfloat16/float16 only.
  'pallas'     GPU: our own Pallas (Triton) flash-attention kernel (`pallas_gpu.py`), any float
               dtype: collaborative as true multi-query attention (one shared key read by every
               head, values of their own width, the content bias as a logit bias).
  'splash'     TPU: the Pallas splash-attention kernel (`fused.py`).
'pallas' and 'splash' take no boolean mask: padding and packed sequences come as (query, key)
`segment_ids` (`SEGMENT_ID_IMPLEMENTATIONS`).
`check_implementation` refuses, with a ValueError, what an implementation cannot compute,
against the `platform` it is given (None: `jax.default_backend()`), so a TPU program can be
checked and compiled on a machine without one.

How each kind becomes attention over `query [.., q, heads, dk]`, `key [.., kv, key_heads, dk]`,
`value [.., kv, value_heads, dv]` (key_heads and value_heads divide heads):
  concat, fixed_head, grouped-query: as is (key_heads = value_heads = num_kv_heads).
  collaborative: multi-query attention in disguise (Cordonnier et al. 2020, eq. 7): head i's
    query is the shared query scaled by its mixing vector, q * m_i, and all heads share one
    key of width key_dim (key_heads = 1); values stay per head. The key-content bias x_k . c_i
    is a per-(head, key) logit bias (`key_bias`); 'cudnn' and 'splash', which take no bias, get
    it as `heads` extra key columns with one-hot query columns instead, and a key broadcast to
    every value head (both want as many key heads as value heads; splash's multi-query kernel
    shares the values too, which collaborative heads do not). 'pallas' reads the one key.
  talking_heads (Shazeer et al. 2020): the mixing matrices go to the blockwise kernel. No fused
    kernel (cuDNN, splash, ours) computes it: they compute one softmax per head from that
    head's own logits, while talking heads mixes every head's logits before the softmax and
    every head's weights after it, so a kernel would need all heads' blocks at once and the
    post-softmax mix needs each head's final normaliser (the two-pass scheme of
    `blockwise.py`). Its cost, measured on an H100 (benchmarks/results/attention_long_gpu.md,
    bfloat16, L = 4096, forward+backward): blockwise talking heads 131 ms, 2.84x blockwise
    concat (46 ms), 7.1x flax's materialising layer (18 ms), ~60x concat through cuDNN (2 ms).

Masks: a boolean mask broadcastable to `[batch..., heads, q, kv]`; pass `is_causal=True` rather
than a causal mask (the kernels build it per block). Segment ids (query, key; 0 = padding) stand
for `core.segment_mask` of them: 'splash' takes the ids, the others that mask. A query that sees
no key outputs 0, never NaN.
"""

import jax
import jax.numpy as jnp

from lowrank_attn.attention import blockwise, fused, pallas_gpu
from lowrank_attn.attention.spec import DEFAULT_BLOCK_SIZE, IMPLEMENTATIONS, AttentionSpec

Array = jax.Array

# implementation -> the backend it needs (None: any).
PLATFORMS = {'xla': None, 'blockwise': None, 'cudnn': 'gpu', 'pallas': 'gpu', 'splash': 'tpu'}
# Take padding and packing as segment ids, not as a boolean mask.
SEGMENT_ID_IMPLEMENTATIONS = ('pallas', 'splash')


def check_implementation(implementation: str, spec: AttentionSpec, *, block_size: int = 1,
                         return_weights: bool = False, return_logits: bool = False,
                         dropout: bool = False, mask: bool = False, cache: bool = False,
                         dtype=None, platform: str | None = None) -> None:
  """ValueError naming the setting unless `implementation` can compute this call on `platform`
  (None: `jax.default_backend()`)."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f'implementation={implementation!r} is not one of {IMPLEMENTATIONS}.')
  if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
    raise ValueError(f'block_size={block_size!r} must be an integer >= 1.')
  if implementation == 'xla':
    return
  for name, value in (('return_weights', return_weights), ('return_logits', return_logits)):
    if value:
      raise ValueError(f"{name}=True needs implementation='xla': implementation="
                       f'{implementation!r} never materialises [batch, heads, q, kv].')
  needed = PLATFORMS[implementation]
  if needed is None:
    return
  platform = platform or jax.default_backend()
  if platform != needed:
    raise ValueError(
        f'implementation={implementation!r} needs a {needed.upper()} '
        f"backend, but this one is {platform!r}; implementation='blockwise' runs anywhere.")
  unsupported = []
  if spec.kind == 'talking_heads':
    unsupported.append("kind='talking_heads' (mixes heads around the softmax)")
  if dropout:
    unsupported.append('attention dropout')
  if cache:
    unsupported.append('a decoding cache')
  if implementation == 'cudnn':
    if spec.kind == 'collaborative':
      key_width = spec.key_dim + (spec.num_heads if spec.use_bias else 0)
      widest = max(fused.cudnn_widths(key_width, spec.head_dim, mla=False))
      if widest > fused.CUDNN_MAX_WIDTH:
        unsupported.append(
            f'head widths above {fused.CUDNN_MAX_WIDTH} (collaborative key_dim={spec.key_dim}'
            f'{f" + {spec.num_heads} content-bias columns" if spec.use_bias else ""} and '
            f'head_dim={spec.head_dim} give {widest})')
    if dtype is not None and jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
      unsupported.append(f'dtype {jnp.dtype(dtype).name} (cuDNN attention needs bfloat16 or '
                         'float16)')
  if implementation in SEGMENT_ID_IMPLEMENTATIONS and mask:
    unsupported.append(f'a boolean mask ({implementation} takes is_causal, and segment_ids '
                       '(query, key) for padding and packed sequences)')
  if unsupported:
    raise ValueError(f'implementation={implementation!r} does not support '
                     f"{', '.join(unsupported)}; use implementation='blockwise'.")


def attend(params: dict[str, Array], spec: AttentionSpec, query: Array, key: Array, value: Array,
           content_bias: Array | None, *, mask: Array | None = None, is_causal: bool = False,
           segment_ids: tuple[Array, Array] | None = None, rng: Array | None = None,
           dropout_rate: float = 0.0, broadcast_dropout: bool = True,
           implementation: str = 'blockwise', block_size: int = DEFAULT_BLOCK_SIZE,
           precision=None) -> Array:
  """Per-head attention outputs `[batch..., q, heads, head_dim]` of `spec.kind`, without ever
  materialising `[batch, heads, q, kv]`.

  query/key/value/content_bias as `kernels.project` returns them; `rng` is None unless
  dropout is active; params in the computation dtype. `segment_ids`: int (query `[batch...,
  q]`, key `[batch..., kv]`) for 'pallas' and 'splash', which take them as their kernels'
  segment ids (`multi_head_attention` turns them into `core.segment_mask` for the others). The call is
  assumed checked by `check_implementation`.
  """
  h = spec.num_heads
  key_bias = pre = post = None
  if spec.kind == 'collaborative':
    # [.., q, h, key_dim]: head i sees the shared query scaled by m_i (as `collaborative_logits`).
    query = query[..., :, None, :] * (params['mixing'] * spec.logit_scale).astype(query.dtype)
    key = key[..., :, None, :]  # one key shared by every head
    if content_bias is not None:
      key_bias = jnp.swapaxes(content_bias, -1, -2).astype(jnp.float32) * spec.logit_scale
  else:
    query = query * jnp.asarray(spec.logit_scale, query.dtype)
    if spec.kind == 'talking_heads':
      pre = params['pre_softmax_mixing'].astype(jnp.float32)
      post = params['post_softmax_mixing'].astype(jnp.float32)
  if implementation == 'blockwise':
    return blockwise.blockwise_attention(
        query, key, value, key_bias=key_bias, mask=mask, is_causal=is_causal,
        pre_mixing=pre, post_mixing=post, dropout_rng=rng, dropout_rate=dropout_rate,
        broadcast_dropout=broadcast_dropout, block_size=block_size, precision=precision)
  if implementation == 'pallas':
    return pallas_gpu.flash_attention(query, key, value, key_bias=key_bias,
                                      segment_ids=segment_ids, is_causal=is_causal)
  if key_bias is not None:  # as h extra key columns, one-hot on the query side
    one_hot = jnp.broadcast_to(jnp.eye(h, dtype=query.dtype), (*query.shape[:-1], h))
    query = jnp.concatenate([query, one_hot], axis=-1)
    key = jnp.concatenate(
        [key, jnp.swapaxes(key_bias, -1, -2)[..., :, None, :].astype(key.dtype)], axis=-1)
  if implementation == 'cudnn':
    return fused.cudnn_attention(query, key, value, mask, is_causal)
  return fused.splash_attention(query, key, value, is_causal, h, segment_ids)
