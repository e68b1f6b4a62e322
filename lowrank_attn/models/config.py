"""Model settings as one frozen dataclass: what a notebook builds a model from, and the schema
from which the training config's `model` fields are derived (`lowrank_attn.train.config`).
"""

import dataclasses
import inspect

import jax
import jax.numpy as jnp

from lowrank_attn.attention import AttentionSpec

ATTENTION_TYPES = ('encoder', 'decoder', 'cross')  # encoder self, decoder self, encoder-decoder
NORMS = ('pre', 'post')
POSITIONS = ('learned', 'sinusoidal')
ACTIVATIONS = ('gelu', 'gelu_exact', 'relu')  # gelu: tanh approximation; BERT: gelu_exact
DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}
# dtype='auto' per backend: bfloat16 where the matrix units run it at full rate (TPU MXU, GPU
# tensor cores: 2x float32's TF32 rate and half its bytes), float32 on CPU, where XLA computes
# bfloat16 products no faster (and converts around them).
AUTO_DTYPES = {'tpu': 'bfloat16', 'gpu': 'bfloat16', 'cpu': 'float32'}


def _is_policy(name: str) -> bool:
  """Whether `jax.checkpoint_policies.<name>` is a policy itself, called as
  `policy(prim, *avals, **params)`, not a factory of policies (`save_only_these_names(*names)`,
  whose arguments a name cannot give)."""
  parameters = inspect.signature(getattr(jax.checkpoint_policies, name)).parameters.values()
  return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


# remat: 'none' (keep every activation for the backward pass), 'full' (keep only each block's
# input; recompute the rest), or a jax checkpoint policy by name: what it may keep
# ('dots_saveable': matrix products' outputs, recomputing the elementwise work between them).
REMAT_POLICIES = (
    'none',
    'full',
    *sorted(
        name
        for name in dir(jax.checkpoint_policies)
        if not name.startswith('_') and _is_policy(name)
    ),
)
DEFAULT_ATTENTION = AttentionSpec(num_heads=8)


def remat_policy(remat: str):
  """`jax.checkpoint`'s policy for a `remat` setting other than 'none' (None: save nothing)."""
  if remat not in REMAT_POLICIES:
    raise ValueError(f'remat={remat!r} is not one of {REMAT_POLICIES}.')
  return None if remat in ('none', 'full') else getattr(jax.checkpoint_policies, remat)


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Sizes and options shared by the three models.

  The defaults are the base (Vaswani et al. 2017) sizes with pre-LayerNorm. For a BERT
  checkpoint use `norm='post', scale_embeddings=False, type_vocab_size=2,
  layer_norm_epsilon=1e-12, activation='gelu_exact'`; `lowrank_attn.models.bert` builds
  that config from a Hugging Face `config.json` and loads the weights.
  """

  vocab_size: int
  emb_dim: int = 512  # D, the residual stream width
  mlp_dim: int = 2048  # hidden width of the feed-forward blocks
  num_encoder_layers: int = 0
  num_decoder_layers: int = 6
  # Attention options per type, as `AttentionSpec` templates (sizes come from emb_dim;
  # num_heads may be a tuple, one count per layer).
  encoder_attention: AttentionSpec = DEFAULT_ATTENTION
  decoder_attention: AttentionSpec = DEFAULT_ATTENTION
  cross_attention: AttentionSpec = DEFAULT_ATTENTION
  max_length: int = 512  # size of the learned position table / longest sequence
  positions: str = 'learned'  # 'learned' | 'sinusoidal'
  norm: str = 'pre'  # 'pre' (x + f(LN(x))) | 'post' (LN(x + f(x)), Vaswani / BERT)
  activation: str = 'gelu'  # 'gelu' (tanh approximation) | 'gelu_exact' (erf) | 'relu'
  dropout_rate: float = 0.1  # on embeddings and every residual branch
  tie_embeddings: bool = True  # output logits use the token embedding matrix
  scale_embeddings: bool = True  # multiply token embeddings by sqrt(emb_dim) (Vaswani)
  type_vocab_size: int = 0  # BERT token-type (segment A/B) embeddings; 0: none
  layer_norm_epsilon: float = 1e-6
  # Computation dtype: 'auto' | 'float32' | 'bfloat16'. 'auto': bfloat16 on TPU and GPU,
  # float32 on CPU (`AUTO_DTYPES`), for the backend of `platform`. Under bfloat16 the
  # parameters (param_dtype), output logits, softmax and LayerNorm statistics and the loss stay
  # float32 (mixed precision).
  dtype: str = 'auto'
  param_dtype: str = 'float32'
  # Rematerialisation around each transformer block (`REMAT_POLICIES`): 'none', 'full' or the
  # name of a `jax.checkpoint_policies` policy such as 'dots_saveable'. Less activation memory
  # for a recomputed forward pass in the backward pass; the same loss and gradients.
  remat: str = 'none'

  def __post_init__(self):
    for name in ('vocab_size', 'emb_dim', 'mlp_dim', 'max_length'):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f'{name}={value!r} must be an integer >= 1.')
    for name in ('num_encoder_layers', 'num_decoder_layers', 'type_vocab_size'):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 0:
        raise ValueError(f'{name}={value!r} must be an integer >= 0.')
    for name, value, valid in (
        ('positions', self.positions, POSITIONS),
        ('norm', self.norm, NORMS),
        ('activation', self.activation, ACTIVATIONS),
    ):
      if value not in valid:
        raise ValueError(f'{name}={value!r} is not one of {valid}.')
    if not 0.0 <= self.dropout_rate < 1.0:
      raise ValueError(f'dropout_rate={self.dropout_rate!r} must be in [0, 1).')
    for name, valid in (('dtype', ('auto', *DTYPES)), ('param_dtype', tuple(DTYPES))):
      value = getattr(self, name)
      if not isinstance(value, str):  # a jnp dtype: store its name (JSON, hashing)
        object.__setattr__(self, name, jnp.dtype(value).name)
      if getattr(self, name) not in valid:
        raise ValueError(f'{name}={value!r} is not one of {valid}.')
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f'remat={self.remat!r} is not one of {REMAT_POLICIES}.')
    # Every layer's attention must be buildable: fail here, not deep inside a model.
    for attention_type in ATTENTION_TYPES:
      field = f'{attention_type}_attention'
      template = getattr(self, field)
      if isinstance(template, dict):
        template = AttentionSpec(**template)
        object.__setattr__(self, field, template)
      if not isinstance(template, AttentionSpec):
        raise ValueError(f'{field} must be an AttentionSpec, got {type(template).__name__}.')
      num_layers = self.num_layers(attention_type)
      for name in ('num_heads', 'num_logit_heads'):
        counts = getattr(template, name)
        if isinstance(counts, tuple) and len(counts) != num_layers:
          raise ValueError(
              f'{field}.{name}={counts} gives {len(counts)} layers, the model has '
              f'{num_layers}; give one head count per layer, or an int.'
          )
      for layer in range(num_layers):
        try:
          self.attention(attention_type, layer)
        except ValueError as e:
          raise ValueError(f'{field} (layer {layer}): {e}') from None

  @property
  def platform(self) -> str:
    """The backend the model is built for: its attention's `platform` where set (AOT
    compilation for a TPU, tpu/compile.py), else `jax.default_backend()`."""
    for attention_type in ATTENTION_TYPES:
      platform = getattr(self, f'{attention_type}_attention').platform
      if platform is not None:
        return platform
    return jax.default_backend()

  @property
  def resolved_dtype(self) -> str:
    """The computation dtype's name, 'auto' resolved for `platform`."""
    return AUTO_DTYPES[self.platform] if self.dtype == 'auto' else self.dtype

  @property
  def compute_dtype(self):
    return DTYPES[self.resolved_dtype]

  def describe_numerics(self) -> str:
    """One line for the start of a run: 'compute bfloat16 (dtype=auto on gpu), parameters
    float32, logits, softmax statistics and loss float32; remat none'."""
    how = f'dtype=auto on {self.platform}' if self.dtype == 'auto' else f'dtype={self.dtype}'
    return (
        f'compute {self.resolved_dtype} ({how}), parameters {self.param_dtype}, logits, '
        f'softmax statistics and loss float32; remat {self.remat}'
    )

  @property
  def parameter_dtype(self):
    return DTYPES[self.param_dtype]

  def num_layers(self, attention_type: str) -> int:
    return self.num_encoder_layers if attention_type == 'encoder' else self.num_decoder_layers

  def attention(self, attention_type: str, layer: int) -> AttentionSpec:
    """The complete spec of layer `layer`'s attention of type 'encoder'|'decoder'|'cross'."""
    if attention_type not in ATTENTION_TYPES:
      raise ValueError(f'attention_type={attention_type!r} is not one of {ATTENTION_TYPES}.')
    template = getattr(self, f'{attention_type}_attention')
    return template.resolve(self.emb_dim, layer)
