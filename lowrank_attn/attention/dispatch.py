"""The attention op: per-kind operands, then the implementation that computes softmax(QK^T)V.

    heads = attend(params, spec, query, key, value, content_bias, mask=..., is_causal=...,
                   implementation='blockwise')

`multi_head_attention(..., implementation=...)` calls this after the projections; everything
before (projections, decoding cache) and after (head masks, gates, output projection) is shared
with the materialising path of `kernels.py` ('xla'), which never comes here.

Implementations (`PLATFORMS`: the backend each needs):
  'auto'       the default: `choose_implementation` picks one of the others per call (the
               'auto' table below), checked by `check_implementation`, logged once.
  'xla'        materialises the weights `[batch, heads, q, kv]` (`kernels.py`).
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
    `blockwise.py`). Its cost, measured on an H200 (benchmarks/results/attention_long_gpu.md,
    bfloat16, L = 4096, forward+backward): blockwise talking heads 125 ms, 2.87x blockwise
    concat (44 ms), 7.5x flax's materialising layer (17 ms), 51x concat through cuDNN.
    A pruned layer (num_logit_heads != num_heads: the post-softmax mix leaves fewer heads than
    it mixes) only 'xla' computes: blockwise keeps its accumulators per logit head.

Masks: a boolean mask broadcastable to `[batch..., heads, q, kv]`; pass `is_causal=True` rather
than a causal mask (the kernels build it per block). Segment ids (query, key; 0 = padding) stand
for `core.segment_mask` of them: 'splash' takes the ids, the others that mask. A query that sees
no key outputs 0, never NaN.

The 'auto' table (`choose_implementation`): the rows in order; in a row the candidates in order;
the first candidate that `check_implementation` accepts for the call computes it:

  1. needs the weights, logits or a decoding cache    'xla' (the only one that can)
  2. rows of >= FUSED_MIN_LENGTH queries and keys:
       TPU                                            'splash'
       GPU                                            'cudnn': bfloat16/float16, head widths
                                                        <= 256 (128 before Hopper: jax's
                                                        check); collaborative only where cuDNN
                                                        takes values of their own width
                                                      'pallas': what cuDNN refuses (float32,
                                                        collaborative, wider heads)
  3. float32 weights [batch, heads, q, kv] of         'xla'
     <= MATERIALISE_MAX_BYTES (CPU: and rows of
     < CPU_BLOCKWISE_MIN_LENGTH keys)
  4. otherwise                                        'blockwise' ('xla' for a pruned
                                                        talking-heads layer)

What no fused kernel computes (talking_heads, attention dropout, a boolean mask for 'splash' or
'pallas', which take segment ids) falls to rows 3-4. Why these rows:
- Fused before 'xla' on GPU: on an H200 (benchmarks/results/attention_long_gpu.md, bfloat16,
  causal fwd+bwd, D = 512, 8 heads) cuDNN took 0.69-0.13x the time of 'xla' at L = 512-4096 and
  'pallas' 0.63-0.17x (0.65-0.14x for cuDNN on an H100, attention_long_h100.md). 'cudnn' before
  'pallas': from L = 1024 cuDNN took 0.85-0.64x of 'pallas'' time for concat and 0.67-0.61x for
  collaborative at D~k = D/4; at L = 512 (about 1 ms a call) 'pallas' was 10% faster for both,
  one run of 5 repetitions, too little to reorder the table on. Below 512 keys and for
  'splash': not measured; FUSED_MIN_LENGTH = 128 is one splash block (shorter rows are mostly
  padding there) and two of 'pallas'' 64-key blocks: below it a fused kernel has next to
  nothing to tile.
- 'xla' before 'blockwise' off CPU: on the H200 'xla' was 2.2-2.6x faster than 'blockwise' at
  every length it fit (512-4096), so 'blockwise' is only for memory.
- CPU: 'blockwise' was 1.4x faster than 'xla' at L = 512 and 1.8x at 4096 on 2 x86 cores
  (benchmarks/results/attention_long.md); at the 128-256 rows of our CPU configs 'xla' stays
  (their losses are bitwise those of implementation='xla').
- MATERIALISE_MAX_BYTES = 1 GiB of float32 weights `[batch, heads, q, kv]` per layer: training
  keeps logits and weights of every layer for the backward pass (~2x this per layer, 'xla' at
  L = 4096, batch 8, 8 heads needed 10 GB of temporaries for one layer), so beyond it a
  6-layer model's attention alone would fill a 16 GiB v5e.
"""

from absl import logging
import jax
import jax.numpy as jnp

from lowrank_attn.attention import blockwise, fused, pallas_gpu
from lowrank_attn.attention.spec import DEFAULT_BLOCK_SIZE, IMPLEMENTATIONS, AttentionSpec

Array = jax.Array

# implementation -> the backend it needs (None: any).
PLATFORMS = {'xla': None, 'blockwise': None, 'cudnn': 'gpu', 'pallas': 'gpu', 'splash': 'tpu'}
# Take padding and packing as segment ids, not as a boolean mask.
SEGMENT_ID_IMPLEMENTATIONS = ('pallas', 'splash')


def check_implementation(
    implementation: str,
    spec: AttentionSpec,
    *,
    block_size: int = 1,
    return_weights: bool = False,
    return_logits: bool = False,
    dropout: bool = False,
    mask: bool = False,
    cache: bool = False,
    dtype=None,
    platform: str | None = None,
) -> None:
  """ValueError naming the setting unless `implementation` can compute this call on `platform`
  (None: `jax.default_backend()`)."""
  if implementation == 'auto':
    raise ValueError(
        "implementation='auto' stands for another implementation: resolve it with "
        'choose_implementation first.'
    )
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f'implementation={implementation!r} is not one of {IMPLEMENTATIONS}.')
  if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
    raise ValueError(f'block_size={block_size!r} must be an integer >= 1.')
  if implementation == 'xla':
    return
  if implementation == 'blockwise' and 0 < spec.num_heads != spec.query_heads:
    raise ValueError(
        f"implementation='blockwise' does not support num_logit_heads={spec.query_heads} "
        f'with num_heads={spec.num_heads} (a pruned talking-heads layer: its accumulators '
        "are per logit head); use implementation='xla'."
    )
  for name, value in (('return_weights', return_weights), ('return_logits', return_logits)):
    if value:
      raise ValueError(
          f"{name}=True needs implementation='xla': implementation="
          f'{implementation!r} never materialises [batch, heads, q, kv].'
      )
  needed = PLATFORMS[implementation]
  if needed is None:
    return
  platform = platform or jax.default_backend()
  if platform != needed:
    raise ValueError(
        f'implementation={implementation!r} needs a {needed.upper()} '
        f"backend, but this one is {platform!r}; implementation='blockwise' runs anywhere."
    )
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
      widths = (
          f'collaborative key_dim={spec.key_dim}'
          f'{f" + {spec.num_heads} content-bias columns" if spec.use_bias else ""} and '
          f'head_dim={spec.head_dim}'
      )
    else:
      key_width, widths = spec.head_dim, f'head_dim={spec.head_dim}'
    widest = max(fused.cudnn_widths(key_width, spec.head_dim, mla=False))
    limit = fused.cudnn_max_width()
    if widest > limit:
      unsupported.append(f'head widths above {limit} on this GPU ({widths} give {widest})')
    if dtype is not None and jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
      unsupported.append(
          f'dtype {jnp.dtype(dtype).name} (cuDNN attention needs bfloat16 or ' 'float16)'
      )
  if implementation in SEGMENT_ID_IMPLEMENTATIONS and mask:
    unsupported.append(
        f'a boolean mask ({implementation} takes is_causal, and segment_ids '
        '(query, key) for padding and packed sequences)'
    )
  if unsupported:
    raise ValueError(
        f'implementation={implementation!r} does not support '
        f"{', '.join(unsupported)}; use implementation='blockwise'."
    )


# The 'auto' table (see the module docstring): thresholds, and the candidates per platform.
FUSED_MIN_LENGTH = 128  # keys per row from which a fused kernel is preferred
CPU_BLOCKWISE_MIN_LENGTH = 512  # keys per row from which 'blockwise' beats 'xla' on XLA:CPU
MATERIALISE_MAX_BYTES = 2**30  # float32 weights [batch, heads, q, kv] 'xla' may materialise
FUSED = {'tpu': ('splash',), 'gpu': ('cudnn', 'pallas'), 'cpu': ()}


def weights_bytes(spec: AttentionSpec, batch: int, q_length: int, kv_length: int) -> int:
  """Bytes of the float32 weights `[batch, heads, q, kv]` 'xla' materialises (talking heads:
  the larger of its logit and output head counts)."""
  heads = max(spec.num_heads, spec.query_heads)
  return 4 * batch * heads * q_length * kv_length


def choose_implementation(
    spec: AttentionSpec,
    *,
    q_length: int,
    kv_length: int,
    batch: int = 1,
    dtype=None,
    platform: str | None = None,
    mask: bool = False,
    return_weights: bool = False,
    return_logits: bool = False,
    dropout: bool = False,
    cache: bool = False,
) -> str:
  """The implementation 'auto' stands for: the first row of the 'auto' table (module
  docstring) that holds and that `check_implementation` accepts for this call.

  batch: the product of the batch dimensions; q_length, kv_length: the call's lengths (with a
  cache, the cache's); dtype: the computation dtype (None: float32); platform: the backend
  compiled for (None: `jax.default_backend()`); the flags as `check_implementation`'s.
  """
  platform = platform or jax.default_backend()
  checked = dict(
      return_weights=return_weights,
      return_logits=return_logits,
      dropout=dropout,
      mask=mask,
      cache=cache,
      dtype=dtype,
      platform=platform,
  )
  if return_weights or return_logits or cache:
    return 'xla'
  candidates = []
  if min(q_length, kv_length) >= FUSED_MIN_LENGTH:
    candidates += [
        name for name in FUSED.get(platform, ()) if name != 'cudnn' or _cudnn_is_fastest(spec)
    ]
  fits = weights_bytes(spec, batch, q_length, kv_length) <= MATERIALISE_MAX_BYTES
  if fits and (platform != 'cpu' or kv_length < CPU_BLOCKWISE_MIN_LENGTH):
    candidates.append('xla')
  for name in (*candidates, 'blockwise'):
    try:
      check_implementation(name, spec, **checked)
    except ValueError:
      continue
    return name
  return 'xla'  # only a call 'blockwise' cannot compute comes here; 'xla' computes any


def _cudnn_is_fastest(spec: AttentionSpec) -> bool:
  """cuDNN for collaborative attention only where it computes the values at their own width:
  otherwise it pads the narrower of keys and values to the wider (exact, but the product pays
  for the zero columns) and 'pallas' computes the same without them."""
  if spec.kind != 'collaborative':
    return True
  key_width = spec.key_dim + (spec.num_heads if spec.use_bias else 0)
  widths = fused.cudnn_widths(key_width, spec.head_dim, mla=False)
  return widths == fused.cudnn_widths(key_width, spec.head_dim, mla=True) or (
      fused.cudnn_accepts_value_width()
  )


_logged: set[str] = set()


def log_choice(
    name: str, implementation: str, *, platform: str | None, dtype, q_length: int, kv_length: int
) -> None:
  """Logs 'attention: encoder self-attention -> cudnn (gpu, bfloat16, L=512)', once per
  process for each distinct line (every layer of a model makes the same choice)."""
  lengths = f'L={q_length}' if q_length == kv_length else f'q={q_length}, kv={kv_length}'
  dtype_name = jnp.dtype(dtype).name if dtype is not None else 'float32'
  line = (
      f'attention: {name} -> {implementation} ({platform or jax.default_backend()}, '
      f'{dtype_name}, {lengths})'
  )
  if line not in _logged:
    _logged.add(line)
    logging.info('%s', line)


def attend(
    params: dict[str, Array],
    spec: AttentionSpec,
    query: Array,
    key: Array,
    value: Array,
    content_bias: Array | None,
    *,
    mask: Array | None = None,
    is_causal: bool = False,
    segment_ids: tuple[Array, Array] | None = None,
    rng: Array | None = None,
    dropout_rate: float = 0.0,
    broadcast_dropout: bool = True,
    implementation: str = 'blockwise',
    block_size: int = DEFAULT_BLOCK_SIZE,
    precision=None,
) -> Array:
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
        query,
        key,
        value,
        key_bias=key_bias,
        mask=mask,
        is_causal=is_causal,
        pre_mixing=pre,
        post_mixing=post,
        dropout_rng=rng,
        dropout_rate=dropout_rate,
        broadcast_dropout=broadcast_dropout,
        block_size=block_size,
        precision=precision,
    )
  if implementation == 'pallas':
    return pallas_gpu.flash_attention(
        query, key, value, key_bias=key_bias, segment_ids=segment_ids, is_causal=is_causal
    )
  if key_bias is not None:  # as h extra key columns, one-hot on the query side
    one_hot = jnp.broadcast_to(jnp.eye(h, dtype=query.dtype), (*query.shape[:-1], h))
    query = jnp.concatenate([query, one_hot], axis=-1)
    key = jnp.concatenate(
        [key, jnp.swapaxes(key_bias, -1, -2)[..., :, None, :].astype(key.dtype)], axis=-1
    )
  if implementation == 'cudnn':
    return fused.cudnn_attention(query, key, value, mask, is_causal)
  return fused.splash_attention(query, key, value, is_causal, h, segment_ids)
