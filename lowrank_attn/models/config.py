"""Model settings as frozen dataclasses: what a notebook builds a model from, no ml_collections.

`lowrank_attn.train.config.model_config` turns a task config into a `TransformerConfig`.
"""

import dataclasses
from typing import Any

import jax.numpy as jnp

from lowrank_attn.attention import KINDS

ATTENTION_TYPES = ('encoder', 'decoder', 'cross')  # encoder self, decoder self, encoder-decoder
MIXING_INITS = ('concatenate', 'all_ones', 'random')
NORMS = ('pre', 'post')
POSITIONS = ('learned', 'sinusoidal')
ACTIVATIONS = ('gelu', 'gelu_exact', 'relu')  # gelu: tanh approximation; BERT: gelu_exact


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """One attention type's layer settings (see `lowrank_attn.nn.MultiHeadAttention`)."""

  kind: str = 'concat'  # 'concat' | 'fixed_head' | 'collaborative' | 'talking_heads'
  num_heads: int = 8
  qkv_features: int | None = None  # total query/key/value width; None: the model's emb_dim
  head_dim: int | None = None  # per-head width; required for 'fixed_head'
  key_dim: int | None = None  # collaborative: shared query/key width D_k
  mixing_init: str = 'concatenate'  # collaborative: initial mixing matrix
  logit_scale: float | None = None  # None: 1/sqrt(per-head query/key width)
  gated: bool = False  # hard-concrete head gates (Voita et al. 2019)
  gate_temperature: float = 0.33
  gate_log_alpha_init: float = 3.0
  dropout_rate: float = 0.0  # dropout on attention weights

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f'attention kind={self.kind!r} is not one of {KINDS}.')
    if self.mixing_init not in MIXING_INITS:
      raise ValueError(f'mixing_init={self.mixing_init!r} is not one of {MIXING_INITS}.')
    if not 0.0 <= self.dropout_rate < 1.0:
      raise ValueError(f'attention dropout_rate={self.dropout_rate!r} must be in [0, 1).')


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Sizes and options shared by the three models.

  The defaults are the base (Vaswani et al. 2017) sizes with pre-LayerNorm. For a BERT
  checkpoint use `norm='post', scale_embeddings=False, type_vocab_size=2,
  layer_norm_epsilon=1e-12, activation='gelu_exact'`; `lowrank_attn.models.bert` builds
  that config from a Hugging Face `config.json` and loads the weights.
  """

  vocab_size: int
  emb_dim: int = 512
  mlp_dim: int = 2048
  num_encoder_layers: int = 0
  num_decoder_layers: int = 6
  encoder_attention: AttentionConfig = AttentionConfig()
  decoder_attention: AttentionConfig = AttentionConfig()
  cross_attention: AttentionConfig = AttentionConfig()
  max_length: int = 512  # size of the learned position table / longest sequence
  positions: str = 'learned'  # 'learned' | 'sinusoidal'
  norm: str = 'pre'  # 'pre' (x + f(LN(x))) | 'post' (LN(x + f(x)), Vaswani / BERT)
  activation: str = 'gelu'  # 'gelu' (tanh approximation) | 'gelu_exact' (erf) | 'relu'
  dropout_rate: float = 0.1  # on embeddings and every residual branch
  tie_embeddings: bool = True  # output logits use the token embedding matrix
  scale_embeddings: bool = True  # multiply token embeddings by sqrt(emb_dim) (Vaswani)
  type_vocab_size: int = 0  # BERT token-type (segment A/B) embeddings; 0: none
  layer_norm_epsilon: float = 1e-6
  dtype: Any = jnp.float32  # computation dtype (bfloat16 for mixed precision)
  param_dtype: Any = jnp.float32

  def __post_init__(self):
    for name in ('vocab_size', 'emb_dim', 'mlp_dim', 'max_length'):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f'{name}={value!r} must be an integer >= 1.')
    for name in ('num_encoder_layers', 'num_decoder_layers', 'type_vocab_size'):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 0:
        raise ValueError(f'{name}={value!r} must be an integer >= 0.')
    for name, value, valid in (('positions', self.positions, POSITIONS),
                               ('norm', self.norm, NORMS),
                               ('activation', self.activation, ACTIVATIONS)):
      if value not in valid:
        raise ValueError(f'{name}={value!r} is not one of {valid}.')
    if not 0.0 <= self.dropout_rate < 1.0:
      raise ValueError(f'dropout_rate={self.dropout_rate!r} must be in [0, 1).')

  def attention(self, attention_type: str) -> AttentionConfig:
    return {'encoder': self.encoder_attention, 'decoder': self.decoder_attention,
            'cross': self.cross_attention}[attention_type]
