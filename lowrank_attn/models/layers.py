"""Transformer building blocks: embeddings, MLP, one encoder/decoder layer.

Every parameter names its logical axes (`vocab, embed, mlp, heads, kv, key`) in its
`out_sharding` metadata; `lowrank_attn.sharding` maps them to mesh axes. Randomness at
call time (dropout, gate noise) comes from the `rngs` argument, so a model holds no RNG state
and a training step is a pure function of (parameters, batch, key).
"""

import math

from flax import nnx
import jax
import jax.numpy as jnp

from lowrank_attn.models.config import TransformerConfig
from lowrank_attn.nn import MultiHeadAttention
from lowrank_attn.sharding import constrain, logical_metadata as logical

Array = jax.Array


ACTIVATIONS = {
    'gelu': jax.nn.gelu,  # tanh approximation (cheaper on CPU)
    'gelu_exact': lambda x: jax.nn.gelu(x, approximate=False),  # erf, as BERT
    'relu': jax.nn.relu,
}


def dense_2d(layer: nnx.Linear, x: Array) -> Array:
  """`layer(x)` with batch and length merged into one dimension.

  Same result; XLA:CPU then computes the weight gradient as one plain matrix product
  instead of a two-dimension contraction it lays out badly (2x faster output layer).
  """
  y = layer(x.reshape(-1, x.shape[-1]))
  return y.reshape(*x.shape[:-1], y.shape[-1])


def sinusoidal_positions(positions: Array, features: int) -> Array:
  """Vaswani et al. (2017) section 3.5: `[..., length]` int -> `[..., length, features]`."""
  half = features // 2
  inv_freq = jnp.exp(-math.log(10_000.0) * jnp.arange(half, dtype=jnp.float32) / max(half, 1))
  angles = positions.astype(jnp.float32)[..., None] * inv_freq
  table = jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)
  if features % 2:
    table = jnp.pad(table, [(0, 0)] * (table.ndim - 1) + [(0, 1)])
  return table


def _param(init, rngs: nnx.Rngs, shape, dtype, axes) -> nnx.Param:
  return nnx.Param(init(rngs.params(), shape, dtype), **logical(*axes))


class LayerNorm(nnx.LayerNorm):
  """`nnx.LayerNorm` whose scale and bias carry the logical axis 'embed'."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    super().__init__(
        cfg.emb_dim,
        epsilon=cfg.layer_norm_epsilon,
        dtype=cfg.compute_dtype,
        param_dtype=cfg.parameter_dtype,
        rngs=rngs,
        scale_metadata=logical('embed'),
        bias_metadata=logical('embed'),
    )


class TokenEmbedding(nnx.Module):
  """Token embeddings, and their transpose as the output layer when tied."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    self.scale = math.sqrt(cfg.emb_dim) if cfg.scale_embeddings else 1.0
    # N(0, 1/D): tied logits of a unit-variance (LayerNormed) input start with unit variance;
    # scale_embeddings brings the input embeddings back to unit variance (Vaswani et al.).
    self.embed = nnx.Embed(
        cfg.vocab_size,
        cfg.emb_dim,
        dtype=cfg.compute_dtype,
        param_dtype=cfg.parameter_dtype,
        embedding_init=nnx.initializers.normal(cfg.emb_dim**-0.5),
        rngs=rngs,
        embedding_metadata=logical('vocab', 'embed'),
    )

  def __call__(self, tokens: Array) -> Array:
    return self.embed(tokens) * jnp.asarray(self.scale, self.embed.dtype or jnp.float32)

  def attend(self, x: Array) -> Array:
    """float32 logits `[..., vocab]`: `embed.attend`, accumulated and returned in float32
    whatever the computation dtype (bfloat16 logits would be rounded to 3 significant digits)."""
    query, embedding = self.embed.promote_dtype(
        (x.reshape(-1, x.shape[-1]), self.embed.embedding[...]),  # 2-D: dense_2d
        dtype=self.embed.dtype,
    )
    y = jnp.dot(query, embedding.T, preferred_element_type=jnp.float32)
    return y.reshape(*x.shape[:-1], y.shape[-1])


class InputEmbedding(nnx.Module):
  """Token (+ token type) + position embeddings, [LayerNorm for post-LN,] dropout."""

  def __init__(self, cfg: TransformerConfig, tokens: TokenEmbedding, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.tokens = tokens  # shared with the output layer and, in translation, the other stack
    # Optional parts are assigned once, module or None (NNX fixes an attribute's kind then).
    self.position_table = (
        _param(
            nnx.initializers.normal(0.02),
            rngs,
            (cfg.max_length, cfg.emb_dim),
            cfg.parameter_dtype,
            (None, 'embed'),
        )
        if cfg.positions == 'learned'
        else None
    )
    self.token_types = (
        nnx.Embed(
            cfg.type_vocab_size,
            cfg.emb_dim,
            dtype=cfg.compute_dtype,
            param_dtype=cfg.parameter_dtype,
            embedding_init=nnx.initializers.normal(0.02),
            rngs=rngs,
            embedding_metadata=logical(None, 'embed'),
        )
        if cfg.type_vocab_size
        else None
    )
    # BERT normalises the embedding sum; pre-LN models normalise inside every layer instead.
    self.norm = LayerNorm(cfg, rngs=rngs) if cfg.norm == 'post' else None
    self.dropout = nnx.Dropout(cfg.dropout_rate)

  def __call__(
      self,
      tokens: Array,
      positions: Array,
      token_types: Array | None = None,
      *,
      deterministic: bool,
      rngs: nnx.Rngs | None,
  ) -> Array:
    cfg = self.cfg
    x = self.tokens(tokens)
    if self.position_table is not None:
      x = x + jnp.take(self.position_table[...], positions, axis=0).astype(x.dtype)
    else:
      x = x + sinusoidal_positions(positions, cfg.emb_dim).astype(x.dtype)
    if self.token_types is not None:
      types = jnp.zeros_like(tokens) if token_types is None else token_types
      x = x + self.token_types(types)
    if self.norm is not None:
      x = self.norm(x)
    x = self.dropout(x, deterministic=deterministic, rngs=rngs)
    return constrain(x.astype(cfg.compute_dtype), ('batch', 'length', 'embed'))


class Mlp(nnx.Module):
  """Position-wise feed-forward block: Dense(D->M), activation, dropout, Dense(M->D)."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    self.activation = ACTIVATIONS[cfg.activation]
    dense = lambda d_in, d_out, axes: nnx.Linear(
        d_in,
        d_out,
        dtype=cfg.compute_dtype,
        param_dtype=cfg.parameter_dtype,
        rngs=rngs,
        kernel_init=nnx.initializers.xavier_uniform(),
        kernel_metadata=logical(*axes),
        bias_metadata=logical(*axes[1:]),
    )
    self.wi = dense(cfg.emb_dim, cfg.mlp_dim, ('embed', 'mlp'))
    self.wo = dense(cfg.mlp_dim, cfg.emb_dim, ('mlp', 'embed'))
    self.dropout = nnx.Dropout(cfg.dropout_rate)

  def __call__(self, x: Array, *, deterministic: bool, rngs: nnx.Rngs | None) -> Array:
    h = self.activation(dense_2d(self.wi, x))
    h = constrain(h, ('batch', 'length', 'mlp'))
    h = self.dropout(h, deterministic=deterministic, rngs=rngs)
    return dense_2d(self.wo, h)


# What each attention type's 'auto' implementation is logged as.
ATTENTION_NAMES = {
    'encoder': 'encoder self-attention',
    'decoder': 'decoder self-attention',
    'cross': 'cross-attention',
}


def make_attention(
    cfg: TransformerConfig, attention_type: str, layer: int, *, rngs: nnx.Rngs
) -> MultiHeadAttention:
  return MultiHeadAttention.from_spec(
      cfg.attention(attention_type, layer),
      dtype=cfg.compute_dtype,
      param_dtype=cfg.parameter_dtype,
      broadcast_dropout=False,
      keep_rngs=False,
      log_name=ATTENTION_NAMES[attention_type],
      rngs=rngs,
  )  # rngs come with each call


class TransformerLayer(nnx.Module):
  """Self-attention [+ encoder-decoder attention] + MLP, each a residual branch.

  Pre-LN: `x + f(LN(x))`; post-LN (Vaswani, BERT): `LN(x + f(x))`.
  """

  def __init__(
      self,
      cfg: TransformerConfig,
      self_attention_type: str,
      index: int,
      cross: bool,
      *,
      rngs: nnx.Rngs,
  ):
    self.cfg = cfg
    self.self_attention = make_attention(cfg, self_attention_type, index, rngs=rngs)
    self.self_attention_norm = LayerNorm(cfg, rngs=rngs)
    self.cross_attention = make_attention(cfg, 'cross', index, rngs=rngs) if cross else None
    self.cross_attention_norm = LayerNorm(cfg, rngs=rngs) if cross else None
    self.mlp = Mlp(cfg, rngs=rngs)
    self.mlp_norm = LayerNorm(cfg, rngs=rngs)
    self.dropout = nnx.Dropout(cfg.dropout_rate)

  def _residual(self, x, norm, branch, deterministic, rngs):
    if self.cfg.norm == 'pre':
      x = x + self.dropout(branch(norm(x)), deterministic=deterministic, rngs=rngs)
    else:
      x = norm(x + self.dropout(branch(x), deterministic=deterministic, rngs=rngs))
    return constrain(x, ('batch', 'length', 'embed'))

  def __call__(
      self,
      x: Array,
      *,
      mask: Array | None = None,
      is_causal: bool = False,
      segment_ids: tuple[Array, Array] | None = None,
      encoded: Array | None = None,
      cross_mask: Array | None = None,
      cross_segment_ids: tuple[Array, Array] | None = None,
      deterministic: bool,
      rngs: nnx.Rngs | None,
      decode: bool = False,
      head_masks: tuple[Array | None, Array | None] = (None, None),
      return_weights: bool = False,
      return_logits: bool = False,
  ) -> tuple[Array, dict[str, dict[str, Array]]]:
    """The new activations, and `{'weights'|'logits': {'self'|'cross': [b, h, q, k]}}` of what
    was requested. `is_causal`: self-attention also hides later positions (not when decoding:
    the cache does). `segment_ids`/`cross_segment_ids`: (query, key) segment ids, 0 = padding,
    of self- and cross-attention (see `MultiHeadAttention.__call__`); the masks AND with them."""
    extras = {'weights': {}, 'logits': {}}

    def attend(
        layer, name, head_mask, kv=None, kv_mask=None, segments=None, is_causal=False, decode=False
    ):
      def branch(h):
        out = layer(
            h,
            kv,
            mask=kv_mask,
            segment_ids=segments,
            is_causal=is_causal,
            deterministic=deterministic,
            rngs=rngs,
            decode=decode,
            head_mask=head_mask,
            return_weights=return_weights,
            return_logits=return_logits,
        )
        if return_logits:
          out, weights, extras['logits'][name] = out
          if return_weights:
            extras['weights'][name] = weights
        elif return_weights:
          out, extras['weights'][name] = out
        return out

      return branch

    x = self._residual(
        x,
        self.self_attention_norm,
        attend(
            self.self_attention,
            'self',
            head_masks[0],
            kv_mask=mask,
            segments=segment_ids,
            is_causal=is_causal,
            decode=decode,
        ),
        deterministic,
        rngs,
    )
    if self.cross_attention is not None:
      x = self._residual(
          x,
          self.cross_attention_norm,
          attend(
              self.cross_attention,
              'cross',
              head_masks[1],
              kv=encoded,
              kv_mask=cross_mask,
              segments=cross_segment_ids,
          ),
          deterministic,
          rngs,
      )
    x = self._residual(
        x,
        self.mlp_norm,
        lambda h: self.mlp(h, deterministic=deterministic, rngs=rngs),
        deterministic,
        rngs,
    )
    return x, extras

  def l0_penalty(self) -> Array:
    total = self.self_attention.l0_penalty()
    if self.cross_attention is not None:
      total = total + self.cross_attention.l0_penalty()
    return total
