"""What an attention layer is: its kind, sizes, parameter shapes, logical axes, size and cost.

`AttentionSpec` validates every setting once, at construction, so a bad setting fails with a
message naming it instead of a deep XLA shape error later. Kernels and layers read it.
`init_mixing` gives the initial collaborative mixing each `mixing_init` names.
"""

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_attn.attention.gates import HardConcrete

Kind = Literal['concat', 'fixed_head', 'collaborative', 'talking_heads']
KINDS: tuple[str, ...] = ('concat', 'fixed_head', 'collaborative', 'talking_heads')
DOT_PRODUCT_KINDS = ('concat', 'fixed_head', 'talking_heads')


def _require_int(name: str, value, minimum: int = 1, note: str = '') -> None:
  if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
    raise ValueError(f'{name}={value!r} must be an integer >= {minimum}{note}.')


MIXING_INITS = ('concatenate', 'all_ones', 'random')
# How the softmax(QK^T)V part is computed (see `lowrank_attn.attention.dispatch`); 'auto'
# stands for one of the others, chosen per call.
IMPLEMENTATIONS = ('auto', 'xla', 'blockwise', 'cudnn', 'pallas', 'splash')
# The backends `jax.default_backend()` names, which 'cudnn', 'pallas' and 'splash' are checked
# against.
PLATFORMS = ('cpu', 'gpu', 'tpu')
# Queries and keys per block: 128 was the fastest forward+backward of 64/128/256/512 on 2
# XLA:CPU cores at L = 512 and 4096 (batch 2, D = 512, 8 heads); fused GPU/TPU kernels choose
# their own blocks.
DEFAULT_BLOCK_SIZE = 128
GATE_INITS = ('glorot',)  # gate_log_alpha_init: a number, or one of these
SIZE_FIELDS = ('in_features', 'out_features', 'in_kv_features')  # set by the model, not a config


def concatenate_mixing(num_heads: int, key_dim: int, dtype=jnp.float32) -> jax.Array:
  """Block one-hot mixing `[num_heads, key_dim]`: head i owns its own slice of the key width.

  With key_dim = num_heads * head_dim a collaborative layer then computes exactly the logits
  of concatenated heads (Cordonnier et al. 2020, sec. 3.1). When key_dim is not a multiple
  of num_heads the slices differ in size by at most one column.
  """
  owner = np.arange(key_dim) * num_heads // key_dim  # the head owning each column
  return jnp.asarray(owner[None, :] == np.arange(num_heads)[:, None], dtype)


def init_mixing(mixing_init: str, rng, num_heads: int, key_dim: int, dtype) -> jax.Array:
  """The initial collaborative mixing `[num_heads, key_dim]` named by `mixing_init`."""
  if mixing_init == 'concatenate':
    return concatenate_mixing(num_heads, key_dim, dtype)
  if mixing_init == 'all_ones':
    return jnp.ones((num_heads, key_dim), dtype)
  if mixing_init == 'random':  # N(0, 0.2^2), the scale of Cordonnier et al.'s code
    return 0.2 * jax.random.normal(rng, (num_heads, key_dim), dtype)
  raise ValueError(f'mixing_init={mixing_init!r} is not one of {MIXING_INITS}.')


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
  """Every setting of one multi-head attention layer: the one schema of attention options.

  The kernels read it, the NNX layer builds its parameters from it, models hold one per
  attention type, and the training config derives its `model.*_attention` fields from it (so
  a new option is one field here plus its use in the kernel). All values are checked here.

  A spec without `in_features` is a template, as a model config holds it: sizes come from the
  model and `num_heads` may be a per-layer tuple (a pruned model); `resolve(in_features,
  layer=i)` gives layer i's complete spec.

  Attributes:
    num_heads: h, number of heads (a template may give one per layer). 0 is a fully pruned
      layer: it needs head_dim, has only its output bias as parameter, and outputs it.
    in_features: D, width of the query input.
    kind: how per-head logits are computed:
      'concat': standard attention, head size qkv_features / num_heads (Vaswani et al.).
      'fixed_head': head size `head_dim` chosen independently of num_heads, to lift the
        low-rank bottleneck (Bhojanapalli et al. 2020).
      'collaborative': one shared query/key projection of width `key_dim`; head i scales it
        by its mixing vector m_i (Cordonnier et al. 2020, eq. 7).
      'talking_heads': concat plus learned h x h mixing of the logits before and of the
        weights after the softmax (Shazeer et al. 2020).
    num_logit_heads: talking_heads only: the heads that compute logits and softmaxes (h_k = h
      of Shazeer et al.), each output head mixing all of them; num_heads counts the output
      (value) heads, which head masks, gates and pruning address. Default num_heads; fewer
      output heads than logit heads is what pruning a talking-heads layer leaves. A template
      may give one per layer.
    qkv_features: total query/key/value width, num_heads * head_dim; defaults to in_features
      (or to num_heads * head_dim when head_dim is given).
    out_features: output width; defaults to in_features.
    in_kv_features: width of the key/value inputs; defaults to in_features.
    num_kv_heads: key/value heads for grouped-query attention (dot-product kinds only);
      defaults to num_heads.
    head_dim: per-head width of values (and of queries/keys for dot-product kinds). Required
      for 'fixed_head'; otherwise defaults to qkv_features // num_heads.
    key_dim: D_k, the shared query/key width of 'collaborative'; defaults to
      num_heads * head_dim (full width, where it can reproduce 'concat' exactly).
    use_bias: biases on the projections. 'collaborative' has no query/key biases; their only
      softmax-relevant effect, the key-content term x_k . c_i, is its `content_bias`.
    normalize_qk: LayerNorm on per-head queries and keys (dot-product kinds).
    logit_scale: multiplies the logits. Default 1/sqrt(head_dim) for dot-product kinds and
      1/sqrt(key_dim / num_heads) for 'collaborative' (the paper's choice for training from
      scratch). A re-parametrized layer must keep the scale of the layer it came from, which
      is why this is a setting of the layer and not recomputed from key_dim.
    mixing_init: initial collaborative mixing: 'concatenate' (block one-hot; reproduces
      concat at full key_dim), 'all_ones' or 'random' (N(0, 0.2^2), Cordonnier et al.'s code).
    dropout_rate: dropout on the attention weights, in [0, 1).
    gated: multiply each head's output by a hard-concrete gate (Voita et al. 2019).
    gate_temperature, gate_stretch: the gates' `HardConcrete` settings.
    gate_log_alpha_init: initial log-alpha of the gates: a number for all of them, or
      'glorot': uniform in +-sqrt(3 / num_heads), Voita et al.'s code (TF's default
      glorot-uniform initializer over their gate variable of shape [1, heads, 1, 1]). The
      default 3.0 > log(11) makes every evaluation gate exactly 1, so a freshly gated layer
      computes what its ungated kind does; near 0 (glorot) the L0 penalty's gradient is ~10x
      stronger and evaluation gates start near 0.5.
    implementation: how the attention weights and their weighted sum are computed; every
      implementation gives the same outputs and gradients (up to rounding), only time and
      memory differ (`lowrank_attn.attention.dispatch`):
      'auto' (default): per call, the fastest of the others that can compute it on `platform`
        for its dtype, shapes and options (the table in `dispatch`: 'splash' on TPU, 'cudnn'
        then 'pallas' on GPU, 'xla' for short rows and what needs the weights, 'blockwise'
        where the weights would not fit), logged once per model.
      'xla': materialises the logits `[batch, heads, q_length, kv_length]` (the only one that
        can return attention weights or logits).
      'blockwise': any backend, in O(length) memory: key blocks with an online softmax and a
        recomputing backward pass; causal attention skips the blocks above the diagonal.
        Attention dropout draws different (per-block) masks than 'xla'.
      'cudnn' (GPU), 'pallas' (GPU: our own Pallas/Triton flash kernel) and 'splash' (TPU):
        fused kernels, for the kinds and options they support (checked when called, on the
        backend that runs them).
      Decoding with a cache always computes as 'xla' (a step's logits are O(length)).
    block_size: queries and keys per block of 'blockwise'.
    platform: the backend 'auto' chooses for and 'cudnn', 'pallas' and 'splash' are checked
      against, one of PLATFORMS; None: `jax.default_backend()` at the call. 'tpu' to compile
      for a TPU on a machine without one (tpu/compile.py); 'gpu'/'tpu' to run 'pallas'/'splash'
      in Pallas' CPU interpreter (tests). The models' 'auto' dtype follows it too.
  """

  num_heads: int | tuple[int, ...]
  in_features: int | None = None
  kind: Kind = 'concat'
  qkv_features: int | None = None
  out_features: int | None = None
  in_kv_features: int | None = None
  num_kv_heads: int | None = None
  head_dim: int | None = None
  key_dim: int | None = None
  use_bias: bool = True
  normalize_qk: bool = False
  logit_scale: float | None = None
  mixing_init: str = 'concatenate'
  dropout_rate: float = 0.0
  gated: bool = False
  gate_temperature: float = HardConcrete.temperature
  gate_stretch: tuple[float, float] = HardConcrete.stretch
  gate_log_alpha_init: float | str = 3.0
  num_logit_heads: int | tuple[int, ...] | None = None
  implementation: str = 'auto'
  block_size: int = DEFAULT_BLOCK_SIZE
  platform: str | None = None

  def __post_init__(self):
    for name in ('num_heads', 'num_logit_heads', 'gate_stretch'):  # lists from JSON: hashable
      if isinstance(getattr(self, name), list):
        object.__setattr__(self, name, tuple(getattr(self, name)))
    if self.kind not in KINDS:
      raise ValueError(f'kind={self.kind!r} is not one of {KINDS}.')
    if self.mixing_init not in MIXING_INITS:
      raise ValueError(f'mixing_init={self.mixing_init!r} is not one of {MIXING_INITS}.')
    if self.implementation not in IMPLEMENTATIONS:
      raise ValueError(f'implementation={self.implementation!r} is not one of {IMPLEMENTATIONS}.')
    _require_int('block_size', self.block_size)
    if self.platform not in (None, *PLATFORMS):
      raise ValueError(f'platform={self.platform!r} is not None or one of {PLATFORMS}.')
    if not (isinstance(self.dropout_rate, (int, float)) and 0.0 <= self.dropout_rate < 1.0):
      raise ValueError(f'dropout_rate={self.dropout_rate!r} must be in [0, 1).')
    init = self.gate_log_alpha_init
    if not (
        init in GATE_INITS
        if isinstance(init, str)
        else isinstance(init, (int, float)) and not isinstance(init, bool)
    ):
      raise ValueError(f'gate_log_alpha_init={init!r} must be a number or one of {GATE_INITS}.')
    self.gate  # validates the gate settings
    if self.logit_scale is not None and not (
        isinstance(self.logit_scale, (int, float)) and self.logit_scale > 0
    ):
      raise ValueError(f'logit_scale={self.logit_scale!r} must be a number > 0.')
    for name in ('num_heads', 'num_logit_heads'):
      value = getattr(self, name)
      counts = value if isinstance(value, tuple) else (value,)
      if not counts:
        raise ValueError(f'{name}=() must name at least one layer.')
      for h in counts:
        if h is not None or name == 'num_heads':
          _require_int(name, h, 0, ' (0: a fully pruned layer)')
    if self.num_logit_heads is not None and self.kind != 'talking_heads':
      raise ValueError(
          f'num_logit_heads={self.num_logit_heads} is only used by '
          f"kind='talking_heads' (got kind={self.kind!r})."
      )
    for name in ('qkv_features', 'head_dim', 'key_dim', 'num_kv_heads', *SIZE_FIELDS):
      if getattr(self, name) is not None:
        _require_int(name, getattr(self, name))
    if self.kind == 'fixed_head' and self.head_dim is None:
      raise ValueError(
          "kind='fixed_head' needs head_dim (an integer >= 1): the head size is chosen "
          'independently of num_heads, e.g. the sequence length (Bhojanapalli et al.).'
      )
    if self.kind != 'collaborative' and self.key_dim is not None:
      raise ValueError(
          f"key_dim={self.key_dim} is only used by kind='collaborative' (got kind={self.kind!r})."
      )
    if self.is_template:
      return
    self._resolve_sizes()

  @property
  def is_template(self) -> bool:
    """True until the sizes are known: no in_features, or head counts per layer."""
    return (
        self.in_features is None
        or isinstance(self.num_heads, tuple)
        or isinstance(self.num_logit_heads, tuple)
    )

  @property
  def gate(self) -> HardConcrete:
    """The gates' distribution."""
    return HardConcrete(temperature=self.gate_temperature, stretch=tuple(self.gate_stretch))

  def num_heads_of_layer(self, layer: int) -> int:
    if isinstance(self.num_heads, tuple):
      return self.num_heads[layer]
    return self.num_heads

  def resolve(self, in_features: int, layer: int = 0, **sizes) -> 'AttentionSpec':
    """Layer `layer`'s complete spec for inputs of width `in_features` (sizes: out_features,
    in_kv_features). A complete spec with the same sizes is returned as is."""
    per_layer = {}
    for name in ('num_heads', 'num_logit_heads'):
      value = getattr(self, name)
      if isinstance(value, tuple):
        if len(value) <= layer:
          raise ValueError(f'{name}={value} has no entry for layer {layer}.')
        value = value[layer]
      per_layer[name] = value
    return dataclasses.replace(self, **per_layer, in_features=in_features, **sizes)

  def options(self) -> dict:
    """The fields a template carries (everything but the sizes a model sets)."""
    return {
        f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in SIZE_FIELDS
    }

  def _resolve_sizes(self):
    resolve = lambda name, value: object.__setattr__(self, name, value)
    for name in ('out_features', 'in_kv_features'):
      if getattr(self, name) is None:
        resolve(name, self.in_features)

    # head_dim and qkv_features = num_heads * head_dim: give either one, or both consistently.
    h = self.num_heads
    if h == 0 and self.head_dim is None:
      raise ValueError(
          'num_heads=0 (a fully pruned layer) needs head_dim: the width its '
          'output projection expects per head.'
      )
    if self.head_dim is None:
      qkv = self.in_features if self.qkv_features is None else self.qkv_features
      if qkv % h:
        raise ValueError(
            f'qkv_features={qkv} must be divisible by num_heads={h} (valid num_heads: '
            f"divisors of {qkv}); kind='fixed_head' with head_dim=... sets the head size "
            'freely.'
        )
      resolve('head_dim', qkv // h)
    if self.qkv_features is not None and self.qkv_features != h * self.head_dim:
      raise ValueError(
          f'qkv_features={self.qkv_features} conflicts with num_heads * head_dim = '
          f'{h} * {self.head_dim}; give only one of qkv_features and head_dim.'
      )
    resolve('qkv_features', h * self.head_dim)

    if self.kind == 'collaborative':
      if self.key_dim is None:
        resolve('key_dim', h * self.head_dim)
      if self.num_kv_heads not in (None, h):
        raise ValueError(
            f"num_kv_heads={self.num_kv_heads} is not supported by kind='collaborative': its "
            'keys are already shared by all heads; leave num_kv_heads=None.'
        )
      if self.normalize_qk:
        raise ValueError(
            'normalize_qk=True is only defined for dot-product kinds '
            f'{DOT_PRODUCT_KINDS}, not collaborative.'
        )

    if self.num_kv_heads is None:
      resolve('num_kv_heads', h)
    if h % max(self.num_kv_heads, 1):
      raise ValueError(
          f'num_heads={h} must be divisible by num_kv_heads={self.num_kv_heads} '
          f'(valid num_kv_heads: divisors of {h}).'
      )

    if self.kind == 'talking_heads':
      if self.num_logit_heads is None:
        resolve('num_logit_heads', h)
      if self.num_logit_heads != h and self.num_kv_heads != h:
        raise ValueError(
            f'num_logit_heads={self.num_logit_heads} != num_heads={h} needs num_kv_heads=None '
            f'(got {self.num_kv_heads}): grouped keys/values are not defined for it.'
        )

    if self.logit_scale is None:
      width = self.key_dim / max(h, 1) if self.kind == 'collaborative' else self.head_dim
      resolve('logit_scale', 1.0 / math.sqrt(width))

  # ---------------------------------------------------------------- parameters

  @property
  def is_dot_product(self) -> bool:
    return self.kind in DOT_PRODUCT_KINDS

  @property
  def query_heads(self) -> int:
    """Heads of the query projection: num_heads, or talking heads' num_logit_heads."""
    return self.num_logit_heads if self.kind == 'talking_heads' else self.num_heads

  @property
  def key_heads(self) -> int:
    """Heads of the key projection (dot-product kinds): num_kv_heads, or the logit heads of
    a talking-heads layer with fewer output heads."""
    return self.num_kv_heads if self.query_heads == self.num_heads else self.query_heads

  def param_shapes(self) -> dict[str, tuple[int, ...]]:
    """Shape of every parameter, by name (the names the kernels and the NNX layer use)."""
    h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
    D, Dkv, Dout = self.in_features, self.in_kv_features, self.out_features
    if h == 0:  # a fully pruned layer keeps only its output bias
      return {'out_bias': (Dout,)} if self.use_bias else {}
    shapes = {}
    if self.is_dot_product:
      hq, hk = self.query_heads, self.key_heads
      shapes['query_kernel'] = (D, hq, d)
      if self.use_bias:
        shapes['query_bias'] = (hq, d)
      shapes['key_kernel'] = (Dkv, hk, d)
      if self.use_bias:
        shapes['key_bias'] = (hk, d)
    else:
      shapes['query_kernel'] = (D, self.key_dim)
      shapes['key_kernel'] = (Dkv, self.key_dim)
      shapes['mixing'] = (h, self.key_dim)
      if self.use_bias:
        shapes['content_bias'] = (Dkv, h)
    value_heads = hkv if self.is_dot_product else h
    shapes['value_kernel'] = (Dkv, value_heads, d)
    if self.use_bias:
      shapes['value_bias'] = (value_heads, d)
    if self.normalize_qk:
      shapes['query_ln_scale'] = (d,)
      shapes['key_ln_scale'] = (d,)
    shapes['out_kernel'] = (h, d, Dout)
    if self.use_bias:
      shapes['out_bias'] = (Dout,)
    if self.kind == 'talking_heads':
      shapes['pre_softmax_mixing'] = (self.num_logit_heads, self.num_logit_heads)
      shapes['post_softmax_mixing'] = (self.num_logit_heads, h)
    if self.gated:
      shapes['gate_log_alpha'] = (h,)
    return shapes

  def logical_axes(self) -> dict[str, tuple[str | None, ...]]:
    """Logical axis names of every parameter, for sharding rules (maxtext style)."""
    axes = {
        'query_bias': ('heads', 'kv'),
        'key_bias': ('heads', 'kv'),
        'value_kernel': ('embed', 'heads', 'kv'),
        'value_bias': ('heads', 'kv'),
        'out_kernel': ('heads', 'kv', 'embed'),
        'out_bias': ('embed',),
        'mixing': ('heads', 'key'),
        'content_bias': ('embed', 'heads'),
        'query_ln_scale': ('kv',),
        'key_ln_scale': ('kv',),
        # Mixing across heads needs all heads anyway: shard only the output-head axis.
        'pre_softmax_mixing': (None, 'heads'),
        'post_softmax_mixing': (None, 'heads'),
        'gate_log_alpha': ('heads',),
    }
    if self.is_dot_product:
      axes['query_kernel'] = axes['key_kernel'] = ('embed', 'heads', 'kv')
    else:
      axes['query_kernel'] = axes['key_kernel'] = ('embed', 'key')
    return {name: axes[name] for name in self.param_shapes()}

  def num_params(self) -> int:
    """Analytic parameter count."""
    return sum(math.prod(shape) for shape in self.param_shapes().values())

  def flops(self, batch: int, q_length: int, kv_length: int | None = None) -> int:
    """Forward FLOPs of the matrix products (2 x multiply-adds) for a full, uncached call.

    Elementwise work (softmax, masking, the collaborative mixing product, gates) is left out:
    it is O(1/head_dim) of the total. Training (forward + backward) costs about 3x this.
    """
    kv_length = q_length if kv_length is None else kv_length
    h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
    if h == 0:
      return 0
    D, Dkv, Dout = self.in_features, self.in_kv_features, self.out_features
    nq, nk = batch * q_length, batch * kv_length
    pairs = batch * q_length * kv_length  # query-key pairs
    if self.is_dot_product:
      projections = nq * D * self.query_heads * d + nk * Dkv * (self.key_heads + hkv) * d
      logits = pairs * self.query_heads * d
    else:
      projections = nq * D * self.key_dim + nk * Dkv * self.key_dim + nk * Dkv * h * d
      if self.use_bias:
        projections += nk * Dkv * h  # content bias x_k . c_i
      logits = pairs * h * self.key_dim
    weighted_sum = pairs * h * d
    out = nq * h * d * Dout
    talking = 0
    if self.kind == 'talking_heads':  # [hk, hk] before and [hk, h] after the softmax
      talking = pairs * self.num_logit_heads * (self.num_logit_heads + h)
    return 2 * (projections + logits + weighted_sum + out + talking)
