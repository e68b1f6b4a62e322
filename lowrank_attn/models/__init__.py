"""Transformer models on the low-rank attention layers (Flax NNX).

- `DecoderLM`: causal language model (packed rows via segment ids).
- `EncoderMLM`: BERT-style masked language model, with the switches a pretrained BERT needs.
- `EncoderDecoder`: translation model with a decoding cache.
- `TransformerConfig`: their settings, with one `lowrank_attn.attention.AttentionSpec` template
  per attention type ('encoder' self, 'decoder' self, 'cross' encoder-decoder).
- `lowrank_attn.models.bert`: Hugging Face BERT checkpoints into `EncoderMLM`.

All return `(logits, aux)`; see `lowrank_attn.models.transformer`.
"""

from lowrank_attn.attention import AttentionSpec
from lowrank_attn.models.config import ATTENTION_TYPES, TransformerConfig
from lowrank_attn.models.layers import sinusoidal_positions
from lowrank_attn.models.transformer import DecoderLM, EncoderDecoder, EncoderMLM, Stack

# The logical axis names the models use; sharding rules must cover all of them.
LOGICAL_AXES = ('batch', 'length', 'vocab', 'embed', 'mlp', 'heads', 'kv', 'key', 'layers')
