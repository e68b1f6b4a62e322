"""lowrank_attn: what multi-head attention really needs (JAX / Flax NNX)."""

__version__ = "0.1.0"
