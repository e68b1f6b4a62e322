"""`MultiHeadAttention`: an NNX drop-in for `flax.nnx.MultiHeadAttention` with our kinds.

The layer owns parameters (with logical axis names for sharding) and the decoding cache; the
computation is `lowrank_attn.attention.multi_head_attention`, so layer and kernel cannot
drift apart.
"""

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn import dtypes, initializers
from flax.nnx.nn.linear import default_kernel_init

from lowrank_attn import attention
from lowrank_attn import sharding
from lowrank_attn.attention import AttentionSpec
from lowrank_attn.attention.spec import MIXING_INITS, init_mixing

Array = jax.Array
_EMPTY = MappingProxyType({})
# The size arguments a layer shares with flax's (and its AttentionSpec).
_SPEC_SIZES = (
    'num_heads',
    'in_features',
    'qkv_features',
    'out_features',
    'num_kv_heads',
    'in_kv_features',
)


def _gate_init(log_alpha_init: float | str, num_heads: int):
  """Initializer of the gates' log-alpha (see `AttentionSpec.gate_log_alpha_init`)."""
  if log_alpha_init == 'glorot':
    # TF's glorot_uniform over Voita et al.'s gate shape [1, h, 1, 1]: fan_in = fan_out = h.
    limit = (3.0 / max(num_heads, 1)) ** 0.5
    return lambda rng, shape, dtype: jax.random.uniform(rng, shape, dtype, -limit, limit)
  return initializers.constant(log_alpha_init)


class MultiHeadAttention(nnx.Module):
  """Multi-head attention: concat, fixed-head-size, collaborative or talking heads, optionally gated.

  Takes the constructor and call arguments of `flax.nnx.MultiHeadAttention` (and draws the same
  initial parameters from the same `rngs` for kind='concat'), except those that replace its
  computation or layout, which raise a ValueError: `attention_fn`, the `*_dot_general(_cls)` and
  `*_promote_dtype` hooks, and the call's `out_sharding`/`qkv_sharding`. Our options are
  the fields of `lowrank_attn.attention.AttentionSpec`, passed as keywords (`**options`) and
  documented there once: `kind`, `head_dim` (fixed_head, Bhojanapalli et al. 2020), `key_dim`
  and `mixing_init` (collaborative, Cordonnier et al. 2020), `logit_scale`, `gated` and the
  `gate_*` settings (Voita et al. 2019; `l0_penalty()` is the expected number of open gates),
  `implementation`, `block_size` and `platform` ('auto', the default: the fastest
  implementation that can compute each call; 'blockwise': O(length) memory; attention weights
  and logits need 'xla' (or 'auto'), and decoding with a cache computes as 'xla').
  `log_name` ('encoder self-attention'): the layer's 'auto' choice is logged under this name
  (once per process for each choice); None: not logged.
  Talking-heads mixing starts at the identity, where the layer equals concat.
  `MultiHeadAttention.from_spec(spec, rngs=...)` builds the layer a spec describes.
  """

  def __init__(
      self,
      num_heads: int,
      in_features: int,
      qkv_features: int | None = None,
      out_features: int | None = None,
      num_kv_heads: int | None = None,
      in_kv_features: int | None = None,
      *,
      dtype=None,
      param_dtype=jnp.float32,
      broadcast_dropout: bool = True,
      dropout_rate: float = 0.0,
      deterministic: bool | None = None,
      precision=None,
      kernel_init=default_kernel_init,
      out_kernel_init=None,
      bias_init=initializers.zeros_init(),
      out_bias_init=None,
      use_bias: bool = True,
      attention_fn=None,
      decode: bool | None = None,
      normalize_qk: bool = False,
      qkv_promote_dtype=dtypes.promote_dtype,
      out_promote_dtype=dtypes.promote_dtype,
      ln_promote_dtype=dtypes.promote_dtype,
      qkv_dot_general=None,
      out_dot_general=None,
      qkv_dot_general_cls=None,
      out_dot_general_cls=None,
      rngs: nnx.Rngs,
      keep_rngs: bool = True,
      kernel_metadata: Mapping[str, Any] = _EMPTY,
      out_kernel_metadata: Mapping[str, Any] = _EMPTY,
      bias_metadata: Mapping[str, Any] = _EMPTY,
      out_bias_metadata: Mapping[str, Any] = _EMPTY,
      query_ln_scale_metadata: Mapping[str, Any] = _EMPTY,
      key_ln_scale_metadata: Mapping[str, Any] = _EMPTY,
      log_name: str | None = None,
      **options,
  ):
    # flax arguments that swap out the computation itself: ours is defined by `kind`.
    if attention_fn not in (None, nnx.dot_product_attention):
      raise ValueError(
          'attention_fn is not supported: the attention computation is chosen by '
          f'kind= (one of {attention.KINDS}).'
      )
    for name, value, default in (
        ('qkv_promote_dtype', qkv_promote_dtype, dtypes.promote_dtype),
        ('out_promote_dtype', out_promote_dtype, dtypes.promote_dtype),
        ('ln_promote_dtype', ln_promote_dtype, dtypes.promote_dtype),
        ('qkv_dot_general', qkv_dot_general, None),
        ('out_dot_general', out_dot_general, None),
        ('qkv_dot_general_cls', qkv_dot_general_cls, None),
        ('out_dot_general_cls', out_dot_general_cls, None),
    ):
      if value is not default:
        raise ValueError(f'{name} is not supported; use dtype= and precision= instead.')
    unknown = set(options) - set(AttentionSpec.__dataclass_fields__)
    if unknown:
      raise TypeError(
          f'MultiHeadAttention got unexpected arguments {sorted(unknown)}; our '
          'options are the fields of lowrank_attn.attention.AttentionSpec.'
      )
    self.spec = spec = AttentionSpec(
        num_heads=num_heads,
        in_features=in_features,
        qkv_features=qkv_features,
        out_features=out_features,
        in_kv_features=in_kv_features,
        num_kv_heads=num_kv_heads,
        use_bias=use_bias,
        normalize_qk=normalize_qk,
        dropout_rate=dropout_rate,
        **options,
    )
    # The attributes flax's layer exposes, for code written against it.
    self.num_heads, self.in_features = num_heads, in_features
    self.qkv_features, self.out_features = spec.qkv_features, spec.out_features
    self.in_kv_features, self.num_kv_heads = spec.in_kv_features, spec.num_kv_heads
    self.head_dim, self.kind = spec.head_dim, spec.kind
    self.dtype, self.param_dtype, self.precision = dtype, param_dtype, precision
    self.broadcast_dropout, self.dropout_rate = broadcast_dropout, dropout_rate
    self.deterministic, self.decode = deterministic, decode
    self.use_bias, self.normalize_qk = use_bias, normalize_qk
    self.log_name = log_name

    shapes, axes = spec.param_shapes(), spec.logical_axes()
    out_kernel_init = out_kernel_init or kernel_init
    out_bias_init = out_bias_init or bias_init

    def param(name, init, metadata=_EMPTY, flat_shape=None):
      """Initialise `name` like flax's LinearGeneral: from a 2-D (kernels) or 1-D (biases)
      shape, so fan-in/fan-out match the equivalent dense layer, then reshape."""
      if name not in shapes:  # a layer pruned to 0 heads has only its output bias
        return
      shape = shapes[name]
      value = init(rngs.params(), flat_shape or (int(np.prod(shape)),), param_dtype)
      if isinstance(value, nnx.VariableMetadata):  # user's nnx.with_partitioning wins
        value.raw_value = jnp.reshape(value.raw_value, shape)
        setattr(self, name, nnx.Param(value))
      else:
        metadata = {**sharding.logical_metadata(*axes[name]), **metadata}
        setattr(self, name, nnx.Param(jnp.reshape(value, shape), **metadata))

    def dense(prefix, in_width, kernel_meta=kernel_metadata, bias_meta=bias_metadata):
      if f'{prefix}_kernel' not in shapes:
        return
      kernel_shape = shapes[f'{prefix}_kernel']
      param(
          f'{prefix}_kernel', kernel_init, kernel_meta, (in_width, int(np.prod(kernel_shape[1:])))
      )
      if f'{prefix}_bias' in shapes:
        param(f'{prefix}_bias', bias_init, bias_meta)

    D, Dkv = in_features, spec.in_kv_features
    if spec.is_dot_product:  # the order flax draws its parameters in
      dense('query', D)
      dense('key', Dkv)
      dense('value', Dkv)
      if normalize_qk:
        param('query_ln_scale', initializers.ones_init(), query_ln_scale_metadata)
        param('key_ln_scale', initializers.ones_init(), key_ln_scale_metadata)
    else:
      param('query_kernel', kernel_init, kernel_metadata, (D, spec.key_dim))
      param('key_kernel', kernel_init, kernel_metadata, (Dkv, spec.key_dim))
      param(
          'mixing',
          lambda rng, shape, dtype: init_mixing(
              spec.mixing_init, rng, num_heads, spec.key_dim, dtype
          ),
      )
      if use_bias:  # zero content bias: what a layer with zero query bias has
        param('content_bias', bias_init, bias_metadata)
      dense('value', Dkv)
    param(
        'out_kernel',
        out_kernel_init,
        out_kernel_metadata or kernel_metadata,
        (num_heads * spec.head_dim, spec.out_features),
    )
    if use_bias:
      param('out_bias', out_bias_init, out_bias_metadata or bias_metadata)
    if spec.kind == 'talking_heads':
      identity = lambda name: lambda rng, shape, dtype: jnp.eye(*shapes[name], dtype=dtype)
      param('pre_softmax_mixing', identity('pre_softmax_mixing'))
      param('post_softmax_mixing', identity('post_softmax_mixing'))
    if spec.gated:
      param('gate_log_alpha', _gate_init(spec.gate_log_alpha_init, num_heads))

    stochastic = dropout_rate > 0.0 or spec.gated
    self.rngs = rngs.dropout.fork() if keep_rngs and stochastic else None
    self.cached_key: nnx.Cache | None = nnx.data(None)
    self.cached_value: nnx.Cache | None = nnx.data(None)
    self.cached_content_bias: nnx.Cache | None = nnx.data(None)
    self.cache_index: nnx.Cache | None = nnx.data(None)

  # ------------------------------------------------------------------ parameters

  def kernel_params(self) -> dict[str, Array]:
    """The parameter arrays, named as `lowrank_attn.attention.multi_head_attention` reads them."""
    return {name: getattr(self, name)[...] for name in self.spec.param_shapes()}

  def l0_penalty(self) -> Array:
    """Expected number of open gates, sum_i P(g_i != 0) (Louizos et al. eq. 12); 0 if ungated."""
    if not self.spec.gated or self.num_heads == 0:
      return jnp.zeros((), jnp.float32)
    return self.spec.gate.expected_l0(self.gate_log_alpha[...])

  def gate_values(self) -> Array:
    """Evaluation-time gate of every head, in [0, 1] (ones if ungated)."""
    if not self.spec.gated or self.num_heads == 0:
      return jnp.ones((self.num_heads,), jnp.float32)
    return self.spec.gate.deterministic(self.gate_log_alpha[...])

  def pruning_mask(self) -> Array:
    """Boolean `[heads]`: the heads a gated layer keeps (evaluation gate > 0)."""
    if not self.spec.gated or self.num_heads == 0:
      return jnp.ones((self.num_heads,), bool)
    return self.spec.gate.binary_mask(self.gate_log_alpha[...])

  # ------------------------------------------------------------------ forward

  def __call__(
      self,
      inputs_q: Array,
      inputs_k: Array | None = None,
      inputs_v: Array | None = None,
      *,
      mask: Array | None = None,
      deterministic: bool | None = None,
      rngs: nnx.Rngs | nnx.RngStream | None = None,
      sow_weights: bool = False,
      decode: bool | None = None,
      is_causal: bool = False,
      segment_ids: tuple[Array, Array] | None = None,
      out_sharding=None,
      qkv_sharding=None,
      head_mask: Array | None = None,
      return_weights: bool = False,
      return_logits: bool = False,
  ):
    """Attention of `inputs_q` over `inputs_k`/`inputs_v` (self-attention when both are None).

    Args as `flax.nnx.MultiHeadAttention.__call__`, plus:
      segment_ids: int (query `[batch..., q]`, key `[batch..., kv]`) segment ids of packed
        sequences, 0 = padding: the mask `attention.segment_mask` builds (ANDed with `mask`),
        which implementation='pallas' or 'splash' takes as its kernel's segment ids.
      head_mask: `[heads]` or `[batch..., heads]` factors on each head's output (pruning masks;
        its gradient at ones is Michel et al.'s head importance).
      return_weights: return `(out, weights)`, weights float32 `[batch..., heads, q, kv]`.
      return_logits: return `(out, weights, logits)`, logits float32 `[batch..., heads, q, kv]`
        before the softmax and masking (weights None unless also requested).
    In decode mode the call may hold one position or a chunk of several; it computes as
    implementation='xla' whatever the spec says (see `multi_head_attention`).
    """
    if out_sharding is not None or qkv_sharding is not None:
      raise ValueError(
          'out_sharding/qkv_sharding are not supported: the layer is sharded '
          "through its parameters' logical axes (embed, heads, kv, key)."
      )
    if inputs_k is None:
      if inputs_v is not None:
        raise ValueError(
            'inputs_k cannot be None if inputs_v is given; pass the same array '
            'as inputs_k to use it for both.'
        )
      inputs_k = inputs_q
    decode = bool(decode if decode is not None else self.decode)

    spec = self.spec
    if sow_weights and not decode and spec.implementation not in ('xla', 'auto'):
      raise ValueError(
          "sow_weights=True needs implementation='xla', not "
          f'{spec.implementation!r}: only it materialises the attention weights.'
      )
    stochastic_parts = self.dropout_rate > 0.0 or spec.gated
    if stochastic_parts:
      deterministic = deterministic if deterministic is not None else self.deterministic
      if deterministic is None:
        raise ValueError(
            'deterministic must be given (to the constructor or the call) when '
            'dropout_rate > 0 or gated=True.'
        )
    else:
      deterministic = True
    rng = None
    if not deterministic:
      stream = rngs.dropout if isinstance(rngs, nnx.Rngs) else (rngs or self.rngs)
      if stream is None:
        raise ValueError(
            'rngs must be passed to the call when keep_rngs=False and the layer '
            'is not deterministic.'
        )
      rng = stream()

    cache = None
    if decode:
      if self.cache_index is None:
        raise ValueError('decode=True needs a cache: call init_cache(input_shape) first.')
      cache = {
          'key': self.cached_key[...],
          'value': self.cached_value[...],
          'index': self.cache_index[...],
      }
      if self.cached_content_bias is not None:
        cache['content_bias'] = self.cached_content_bias[...]

    result = attention.multi_head_attention(
        self.kernel_params(),
        inputs_q,
        inputs_k,
        inputs_v,
        spec=spec,
        mask=mask,
        is_causal=is_causal and not decode,
        segment_ids=segment_ids,
        head_mask=head_mask,
        cache=cache,
        rng=rng,
        dropout_rate=self.dropout_rate,
        broadcast_dropout=self.broadcast_dropout,
        deterministic=deterministic,
        return_weights=return_weights or sow_weights,
        return_logits=return_logits,
        dtype=self.dtype,
        precision=self.precision,
        name=self.log_name,
    )

    if decode:
      self.cached_key[...] = result.cache['key']
      self.cached_value[...] = result.cache['value']
      self.cache_index[...] = result.cache['index']
      if self.cached_content_bias is not None:
        self.cached_content_bias[...] = result.cache['content_bias']
    if sow_weights:
      self.sow(nnx.Intermediate, 'attention_weights', result.weights)
    if return_logits:
      return result.out, result.weights if return_weights else None, result.logits
    return (result.out, result.weights) if return_weights else result.out

  # ------------------------------------------------------------------ decoding cache

  def init_cache(self, input_shape, dtype=jnp.float32):
    """Allocate the decoding cache for inputs of shape `[batch..., max_length, features]`."""
    cache = attention.init_cache(self.spec, tuple(input_shape[:-2]), input_shape[-2], dtype)
    self.cached_key = nnx.Cache(cache['key'])
    self.cached_value = nnx.Cache(cache['value'])
    self.cache_index = nnx.Cache(cache['index'])
    if 'content_bias' in cache:
      self.cached_content_bias = nnx.Cache(cache['content_bias'])

  def set_view(
      self,
      deterministic: bool | None = None,
      decode: bool | None = None,
      batch_size: int | tuple[int, ...] | None = None,
      max_length: int | None = None,
  ):
    """Used by `nnx.view`: set modes, allocating the cache when decode is switched on."""
    if deterministic is not None:
      self.deterministic = deterministic
    if decode is not None:
      self.decode = decode
      if decode and self.cache_index is None:
        if batch_size is None or max_length is None:
          raise TypeError("'batch_size' and 'max_length' are needed to initialise the cache.")
        batch = (batch_size,) if isinstance(batch_size, int) else tuple(batch_size)
        self.init_cache((*batch, max_length, self.in_features), self.dtype or jnp.float32)

  # ------------------------------------------------------------------ conversion

  @classmethod
  def from_spec(cls, spec: AttentionSpec, *, rngs: nnx.Rngs, **layer_args) -> 'MultiHeadAttention':
    """The layer `spec` describes; `layer_args`: flax's non-spec arguments (dtype, decode, ...)."""
    if spec.is_template:
      raise ValueError(f'{spec} is a template: resolve(in_features, layer=...) it first.')
    options = {
        name: getattr(spec, name) for name in spec.__dataclass_fields__ if name not in _SPEC_SIZES
    }
    # Sized by head_dim; qkv_features = num_heads * head_dim and (without grouped keys)
    # num_kv_heads = num_heads follow, also for a layer pruned to 0 heads.
    num_kv_heads = None if spec.num_kv_heads == spec.num_heads else spec.num_kv_heads
    return cls(
        spec.num_heads,
        spec.in_features,
        None,
        spec.out_features,
        num_kv_heads,
        spec.in_kv_features,
        rngs=rngs,
        **options,
        **layer_args,
    )

  @classmethod
  def from_flax(
      cls,
      module: nnx.MultiHeadAttention,
      *,
      kind: str = 'concat',
      key_dim: int | None = None,
      rescale_logits: bool = False,
      **options,
  ) -> 'MultiHeadAttention':
    """Our layer computing what an existing `flax.nnx.MultiHeadAttention` computes.

    kind='concat', 'fixed_head' and 'talking_heads' (identity mixing) copy the weights.
    kind='collaborative' re-parametrizes the query/key projections by
    `lowrank_attn.reparam.concat_to_collaborative`: exactly at full key width (key_dim None
    or num_heads * head_dim: stacked per-head projections, block one-hot mixing), by the CP
    decomposition of the per-head W_Q^(i) W_K^(i)T below it (Cordonnier et al. 2020). At
    any width the query bias becomes the exact key-content bias c_i = W_K^(i) b_Q^(i) and the
    key bias is dropped (the softmax cancels it); the logit scale stays the original
    1/sqrt(head_dim) unless `rescale_logits=True` (the paper's code: 1/sqrt(key_dim / heads)).

    `options`: the CP options (`num_iterations`, `tol`, `num_starts`, `check_every`, `seed`
    of `lowrank_attn.reparam.collaborative_factors`) go to the decomposition; the others (e.g.
    gated=True) to the constructor.
    """
    return _reparam_convert().from_flax(
        module,
        kind=kind,
        key_dim=key_dim,
        rescale_logits=rescale_logits,
        layer_class=cls,
        **options,
    )

  def to_collaborative(
      self,
      key_dim: int | None = None,
      *,
      rescale_logits: bool = False,
      return_error: bool = False,
      **cp_options,
  ):
    """This concat or fixed_head layer re-parametrized as a collaborative one (a new layer).

    As `from_flax(..., kind='collaborative')`, for one of our layers (a loaded BERT is made
    of them): exact at full key width, CP decomposition below it (`cp_options`: those of
    `lowrank_attn.reparam.collaborative_factors`). Values, output, gates and the layer's
    settings (dtype, dropout, ...) are kept. With `return_error=True` returns
    `(layer, relative_error)`, the error |T - T^|_F / |T|_F of the per-head bilinear forms.
    """
    return _reparam_convert().layer_to_collaborative(
        self, key_dim, rescale_logits=rescale_logits, return_error=return_error, **cp_options
    )

  def set_params(self, params: Mapping[str, Array]) -> None:
    """Overwrites parameters by name; a name the layer lacks or a wrong shape is a ValueError."""
    shapes = self.spec.param_shapes()
    for name, value in params.items():
      if name not in shapes or tuple(value.shape) != shapes[name]:
        raise ValueError(
            f'parameter {name} {tuple(value.shape)} does not fit this layer '
            f'({self.spec.kind}): its parameters are {shapes}.'
        )
      getattr(self, name)[...] = jnp.asarray(value, self.param_dtype)


def _reparam_convert():
  """`lowrank_attn.reparam.convert`, imported at the call: re-parametrization sits above the
  layers (it imports them, and its package the training stack), so the layers never import it
  at module level (tests/test_layering.py)."""
  from lowrank_attn.reparam import convert  # pylint: disable=g-import-not-at-top

  return convert


def dot_product_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    broadcast_dropout=True,
    dropout_rng=None,
    dropout_rate=0.0,
    deterministic=False,
    dtype=None,
    precision=None,
    module=None,
    promote_dtype=dtypes.promote_dtype,
    is_causal=False,
):
  """An `attention_fn` for flax's own attention layers, built on our core.

  Same signature as `flax.nnx.dot_product_attention`; logits and softmax in float32, and a
  query whose keys are all masked outputs 0 (flax's gives a uniform average).
  """
  query, key, value = promote_dtype((query, key, value), dtype=dtype)
  scores = attention.dot_product_logits(query, key, query.shape[-1] ** -0.5, precision)
  if bias is not None:
    scores = scores + bias
  if is_causal:
    mask = attention.combine_masks(mask, attention.causal_mask(scores.shape[-2], scores.shape[-1]))
  weights = attention.masked_softmax(scores, mask)
  if module is not None:
    module.sow(nnx.Intermediate, 'attention_weights', weights)
  if not deterministic and dropout_rate > 0.0:
    weights = attention.dropout(weights, dropout_rng, dropout_rate, broadcast_dropout)
  return attention.weighted_sum(weights, value, precision)
