"""Attention kernels: pure `jnp` functions, no Flax.

- `AttentionSpec`: a layer's kind and sizes, validated; parameter shapes, logical axes,
  analytic parameter count and FLOPs; `init_mixing`, `concatenate_mixing`: collaborative mixing.
- `multi_head_attention(params, x, spec=...)`: the whole layer as a function of a dict of
  arrays; `init_cache` for autoregressive decoding.
- the per-kind logits (`dot_product_logits`, `collaborative_logits`, `mix_heads`) and the shared
  core (`masked_softmax`, `dropout`, `weighted_sum`, masks) for use in other code.
- `HardConcrete`: the head-gate distribution of Voita et al. (2019).

The implementations of softmax(QK^T)V: `dispatch` (the op: checks and picks one), `blockwise`
(O(length) memory, pure JAX), `fused` (cuDNN, splash). Conversions between kinds live above,
in `lowrank_attn.reparam`.
"""

from lowrank_attn.attention.core import (
    causal_mask,
    combine_masks,
    dropout,
    masked_softmax,
    padding_mask,
    segment_mask,
    weighted_sum,
)
from lowrank_attn.attention.gates import HardConcrete
from lowrank_attn.attention.kernels import (
    AttentionOutput,
    collaborative_logits,
    dot_product_logits,
    init_cache,
    logits,
    mix_heads,
    multi_head_attention,
    project,
)
from lowrank_attn.attention.spec import KINDS, AttentionSpec, concatenate_mixing, init_mixing
