"""Flax NNX layers on top of the kernels in `lowrank_attn.attention`."""

from lowrank_attn.nn.attention import MIXING_INITS, MultiHeadAttention, dot_product_attention
