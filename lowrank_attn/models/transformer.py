"""The three models: decoder-only LM, encoder-only masked LM (BERT-style), encoder-decoder.

Every model returns `(logits, aux)`:
  logits  `[batch, length, vocab]` float32;
  aux     `{'l0_penalty': scalar, 'l0_penalty_sum': scalar}`: the expected number of open head
          gates, summed over heads and averaged over gated attention layers (Voita et al. 2019,
          whose lambda multiplies this), and summed over layers too; 0 without gates. Plus
          `'attention_weights'` / `'attention_logits'`: `{type: (per-layer [batch, heads, q,
          kv], ...)}` when called with `return_weights=True` / `return_logits=True` (logits
          before the softmax and masking), types being 'encoder', 'decoder' and 'cross'.

`head_masks={type: [num_layers, heads] or a per-layer sequence}` multiplies each head's output;
its gradient at ones is the head importance of Michel et al. (2019), and 0/1 values prune.
Layers are a Python list, not a scanned stack: pruning leaves layers with different head
counts, and per-layer caches, weights and masks stay simple.

Decoder self-attention is causal by `is_causal=True`, not by a `[q, kv]` causal mask: with
`implementation='blockwise'` each block builds its part from positions and the blocks above
the diagonal are skipped ('xla' builds the full mask itself). Padding and packed sequences
reach the attention layers as (query, key) segment ids, not as masks: the mask
`segment_mask` builds from them for every implementation but 'pallas' and 'splash', whose
kernels take the ids themselves.
"""

from collections.abc import Iterator, Mapping, Sequence
from typing import NamedTuple

from flax import nnx
import jax
import jax.numpy as jnp

from lowrank_attn.models.config import TransformerConfig, remat_policy
from lowrank_attn.models.layers import (
    ACTIVATIONS,
    InputEmbedding,
    LayerNorm,
    TokenEmbedding,
    TransformerLayer,
    dense_2d,
)
from lowrank_attn.nn import MultiHeadAttention
from lowrank_attn.sharding import constrain, logical_metadata as logical

Array = jax.Array
HeadMasks = Mapping[str, Array | Sequence[Array | None]] | None


class AttentionSite(NamedTuple):
  """One attention layer of a model, and where it sits."""

  attention_type: str  # 'encoder' | 'decoder' (that stack's self-attention) | 'cross'
  index: int  # of its layer in the stack
  path: tuple[str | int, ...]  # in the parameter tree: ('decoder', 'layers', 1, 'cross_attention')
  layer: MultiHeadAttention


def _layer_mask(head_masks: HeadMasks, attention_type: str, index: int):
  if not head_masks or head_masks.get(attention_type) is None:
    return None
  return head_masks[attention_type][index]


def _positions(tokens: Array, positions: Array | None, start=0) -> Array:
  """`positions`, or `start, start + 1, ...` along the length axis."""
  if positions is not None:
    return positions
  return jnp.broadcast_to(start + jnp.arange(tokens.shape[-1], dtype=jnp.int32), tokens.shape)


def _mlp_flops(cfg: TransformerConfig, tokens: int) -> int:
  return 2 * 2 * tokens * cfg.emb_dim * cfg.mlp_dim


class Stack(nnx.Module):
  """Input embedding, `num_layers` transformer layers, final LayerNorm (pre-LN only).

  A 'decoder' stack's self-attention is causal. With `cfg.remat` other than 'none' each layer
  runs under `nnx.remat` (`jax.checkpoint`) with that policy, except when decoding.
  """

  def __init__(
      self,
      cfg: TransformerConfig,
      attention_type: str,
      num_layers: int,
      tokens: TokenEmbedding,
      *,
      cross: bool = False,
      rngs: nnx.Rngs,
  ):
    self.attention_type = attention_type
    self.remat = cfg.remat
    self.embedding = InputEmbedding(cfg, tokens, rngs=rngs)
    self.layers = nnx.List(
        [TransformerLayer(cfg, attention_type, i, cross, rngs=rngs) for i in range(num_layers)]
    )
    self.final_norm = LayerNorm(cfg, rngs=rngs) if cfg.norm == 'pre' else None

  def __call__(
      self,
      tokens,
      positions,
      *,
      mask=None,
      segment_ids=None,
      token_types=None,
      encoded=None,
      cross_mask=None,
      cross_segment_ids=None,
      deterministic=True,
      rngs=None,
      decode=False,
      head_masks: HeadMasks = None,
      return_weights=False,
      return_logits=False,
  ):
    """Final activations and `{'attention_weights'|'attention_logits': {type: per-layer}}`.

    Masks and (query, key) segment ids as `TransformerLayer`'s.
    """
    x = self.embedding(tokens, positions, token_types, deterministic=deterministic, rngs=rngs)
    names = {'self': self.attention_type, 'cross': 'cross'}
    collected = {'attention_weights': {}, 'attention_logits': {}}

    def run(layer, x, arrays, rngs):  # arrays as arguments, Python values closed over
      return layer(
          x,
          **arrays,
          is_causal=self.attention_type == 'decoder',
          deterministic=deterministic,
          rngs=rngs,
          decode=decode,
          return_weights=return_weights,
          return_logits=return_logits,
      )

    if self.remat != 'none' and not decode:  # recomputed in the backward pass, block by block
      run = nnx.remat(run, policy=remat_policy(self.remat))

    for i, layer in enumerate(self.layers):
      arrays = dict(
          mask=mask,
          segment_ids=segment_ids,
          encoded=encoded,
          cross_mask=cross_mask,
          cross_segment_ids=cross_segment_ids,
          head_masks=(
              _layer_mask(head_masks, self.attention_type, i),
              _layer_mask(head_masks, 'cross', i),
          ),
      )
      x, extras = run(layer, x, arrays, rngs)
      for what, per_name in (
          ('attention_weights', extras['weights']),
          ('attention_logits', extras['logits']),
      ):
        for name, value in per_name.items():
          collected[what].setdefault(names[name], []).append(value)
    if self.final_norm is not None:
      x = self.final_norm(x)
    return x, {
        what: {k: tuple(v) for k, v in per_type.items()}
        for what, per_type in collected.items()
        if per_type
    }

  def attention_sites(self) -> Iterator[AttentionSite]:
    """Every attention layer of the stack, layer by layer, self- before cross-attention.

    The one walk over attention layers: everything else that visits them (the L0 penalty,
    pruning, re-parametrization) goes through it, so they agree on order and paths.
    """
    # A model holds its stacks as attributes named after their attention type.
    for i, layer in enumerate(self.layers):
      yield AttentionSite(
          self.attention_type,
          i,
          (self.attention_type, 'layers', i, 'self_attention'),
          layer.self_attention,
      )
      if layer.cross_attention is not None:
        yield AttentionSite(
            'cross', i, (self.attention_type, 'layers', i, 'cross_attention'), layer.cross_attention
        )

  def attention_layers(self) -> Iterator[MultiHeadAttention]:
    """Every attention layer of the stack, self-attention and (if any) cross-attention."""
    return (site.layer for site in self.attention_sites())

  def init_cache(self, batch_size: int, max_length: int, dtype) -> None:
    for layer in self.layers:
      layer.self_attention.init_cache((batch_size, max_length, layer.cfg.emb_dim), dtype)

  def cache_index(self) -> Array:
    """The decoding position: how many positions the self-attention caches hold."""
    return self.layers[0].self_attention.cache_index[...]

  def flops(self, batch_size: int, length: int, source_length: int | None = None) -> int:
    total = 0
    for layer in self.layers:
      total += layer.self_attention.spec.flops(batch_size, length, length)
      if layer.cross_attention is not None:
        total += layer.cross_attention.spec.flops(batch_size, length, source_length)
      total += _mlp_flops(layer.cfg, batch_size * length)
    return total


class _Model(nnx.Module):
  """Shared output layer and aux bookkeeping."""

  def _init_output(self, cfg: TransformerConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.tokens = TokenEmbedding(cfg, rngs=rngs)
    # Logits in float32 under any computation dtype: the products accumulate in float32 and
    # are not rounded to bfloat16 on the way out.
    self.output = (
        None
        if cfg.tie_embeddings
        else nnx.Linear(
            cfg.emb_dim,
            cfg.vocab_size,
            use_bias=False,
            dtype=cfg.compute_dtype,
            param_dtype=cfg.parameter_dtype,
            preferred_element_type=jnp.float32,
            rngs=rngs,
            kernel_metadata=logical('embed', 'vocab'),
        )
    )

  def _logits(self, x: Array) -> Array:
    logits = self.tokens.attend(x) if self.output is None else dense_2d(self.output, x)
    return constrain(logits.astype(jnp.float32), ('batch', 'length', 'vocab'))

  def _logits_flops(self, tokens: int) -> int:
    return 2 * tokens * self.cfg.emb_dim * self.cfg.vocab_size

  def stacks(self) -> tuple[Stack, ...]:
    return tuple(getattr(self, name) for name in ('encoder', 'decoder') if hasattr(self, name))

  def attention_sites(self) -> list[AttentionSite]:
    """Every attention layer: the encoder's, then the decoder's (self before cross)."""
    return [site for stack in self.stacks() for site in stack.attention_sites()]

  def attention_layers(self) -> dict[str, list[MultiHeadAttention]]:
    """`{attention type: [layer 0's attention, layer 1's, ...]}`, types in model order."""
    layers = {}
    for site in self.attention_sites():
      layers.setdefault(site.attention_type, []).append(site.layer)
    return layers

  def l0_penalties(self) -> list[Array]:
    """Expected number of open gates of every gated attention layer (sum over its heads)."""
    return [
        layer.l0_penalty()
        for stack in self.stacks()
        for layer in stack.attention_layers()
        if layer.spec.gated
    ]

  def l0_penalty(self) -> Array:
    """Voita et al.'s penalty: open gates summed over heads, averaged over gated layers."""
    penalties = self.l0_penalties()
    return sum(penalties) / len(penalties) if penalties else jnp.zeros((), jnp.float32)

  def _aux(self, extras):
    penalties = self.l0_penalties()
    total = sum(penalties) if penalties else jnp.zeros((), jnp.float32)
    return {'l0_penalty': total / max(len(penalties), 1), 'l0_penalty_sum': total, **extras}


def _merge(*extras: dict) -> dict:
  """Per-type attention weights/logits of several stacks, merged by kind of extra."""
  out = {}
  for extra in extras:
    for what, per_type in extra.items():
      out.setdefault(what, {}).update(per_type)
  return out


class DecoderLM(_Model):
  """Causal language model. Packed rows: `segment_ids` (0 = padding) keep documents apart."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    if cfg.num_decoder_layers < 1:
      raise ValueError(f'DecoderLM needs num_decoder_layers >= 1, got {cfg.num_decoder_layers}.')
    self._init_output(cfg, rngs)
    self.decoder = Stack(cfg, 'decoder', cfg.num_decoder_layers, self.tokens, rngs=rngs)

  def __call__(
      self,
      inputs: Array,
      *,
      positions: Array | None = None,
      segment_ids: Array | None = None,
      deterministic: bool = True,
      rngs: nnx.Rngs | None = None,
      decode: bool = False,
      head_masks: HeadMasks = None,
      return_weights: bool = False,
      return_logits: bool = False,
  ):
    """inputs `[batch, length]` int -> (logits `[batch, length, vocab]`, aux).

    With `decode=True` (after `init_cache`) the call continues the cached sequence: positions
    default to the cache position onwards.
    """
    if decode:
      segments = None  # the cache applies causality and hides unwritten positions
      positions = _positions(inputs, positions, start=self.decoder.cache_index())
    else:
      segments = (inputs != 0).astype(jnp.int32) if segment_ids is None else segment_ids
      segments = (segments, segments)  # and causal: a decoder stack
    x, extras = self.decoder(
        inputs,
        _positions(inputs, positions),
        segment_ids=segments,
        deterministic=deterministic,
        rngs=rngs,
        decode=decode,
        head_masks=head_masks,
        return_weights=return_weights,
        return_logits=return_logits,
    )
    return self._logits(x), self._aux(extras)

  def init_cache(self, batch_size: int, max_length: int | None = None) -> None:
    self.decoder.init_cache(batch_size, max_length or self.cfg.max_length, self.cfg.compute_dtype)

  def flops(self, batch_size: int, length: int) -> int:
    """Forward matmul FLOPs of one call (training step: about 3x)."""
    return self.decoder.flops(batch_size, length) + self._logits_flops(batch_size * length)


class EncoderMLM(_Model):
  """BERT-style masked LM: encoder, then Dense + activation + LayerNorm + tied logits + bias.

  With `lowrank_attn.models.bert.bert_config`, the parameters are BERT's one for one and
  `lowrank_attn.models.bert.load_bert_weights` loads a Hugging Face checkpoint; `encode`
  gives the final hidden states (what a sentence encoder pools).
  """

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    if cfg.num_encoder_layers < 1:
      raise ValueError(f'EncoderMLM needs num_encoder_layers >= 1, got {cfg.num_encoder_layers}.')
    self._init_output(cfg, rngs)
    self.encoder = Stack(cfg, 'encoder', cfg.num_encoder_layers, self.tokens, rngs=rngs)
    self.head_dense = nnx.Linear(
        cfg.emb_dim,
        cfg.emb_dim,
        dtype=cfg.compute_dtype,
        param_dtype=cfg.parameter_dtype,
        rngs=rngs,
        kernel_metadata=logical(None, 'embed'),
        bias_metadata=logical('embed'),
    )
    self.head_norm = LayerNorm(cfg, rngs=rngs)
    self.activation = ACTIVATIONS[cfg.activation]
    self.output_bias = nnx.Param(
        jnp.zeros((cfg.vocab_size,), cfg.parameter_dtype), **logical('vocab')
    )

  def __call__(
      self,
      inputs: Array,
      *,
      positions: Array | None = None,
      segment_ids: Array | None = None,
      token_types: Array | None = None,
      deterministic: bool = True,
      rngs: nnx.Rngs | None = None,
      head_masks: HeadMasks = None,
      return_weights: bool = False,
      return_logits: bool = False,
      output_positions: Array | None = None,
  ):
    """inputs `[batch, length]` int (with mask tokens) -> (logits `[batch, length, vocab]`,
    aux); with `output_positions` `[batch, P]` int, the logits at those positions only
    (`[batch, P, vocab]`: BERT's gather of the masked positions before the output layer)."""
    x, extras = self.encode(
        inputs,
        positions=positions,
        segment_ids=segment_ids,
        token_types=token_types,
        deterministic=deterministic,
        rngs=rngs,
        head_masks=head_masks,
        return_weights=return_weights,
        return_logits=return_logits,
    )
    if output_positions is not None:
      x = jnp.take_along_axis(x, output_positions[..., None], axis=1)
    h = self.head_norm(self.activation(dense_2d(self.head_dense, x)))
    logits = self._logits(h) + self.output_bias[...].astype(jnp.float32)
    return logits, self._aux(extras)

  def encode(
      self,
      inputs: Array,
      *,
      positions: Array | None = None,
      segment_ids: Array | None = None,
      token_types: Array | None = None,
      deterministic: bool = True,
      rngs: nnx.Rngs | None = None,
      head_masks: HeadMasks = None,
      return_weights: bool = False,
      return_logits: bool = False,
  ):
    """Final hidden states `[batch, length, D]` (padding: token 0 / segment 0) and extras."""
    segments = (inputs != 0).astype(jnp.int32) if segment_ids is None else segment_ids
    return self.encoder(
        inputs,
        _positions(inputs, positions),
        segment_ids=(segments, segments),
        token_types=token_types,
        deterministic=deterministic,
        rngs=rngs,
        head_masks=head_masks,
        return_weights=return_weights,
        return_logits=return_logits,
    )

  def flops(self, batch_size: int, length: int, predictions: int | None = None) -> int:
    """Forward matmul FLOPs; the output layer at `predictions` positions per row (default:
    every position)."""
    outputs = batch_size * (length if predictions is None else predictions)
    return (
        self.encoder.flops(batch_size, length)
        + 2 * outputs * self.cfg.emb_dim**2
        + self._logits_flops(outputs)
    )


class EncoderDecoder(_Model):
  """Translation model; source and target share one vocabulary and embedding matrix.

  Training: `model(inputs, targets)` feeds the decoder `targets` shifted right, starting with
  `bos_id`. Packed rows (several pairs per row) pass `inputs_segment_ids`/`targets_segment_ids`
  (0 = padding) and positions that restart in each segment: attention stays within a pair
  and every target segment starts from `bos_id`. Decoding: `encode` once, `init_cache`, then
  `decode(..., decode=True)` per token.
  """

  def __init__(self, cfg: TransformerConfig, *, bos_id: int, rngs: nnx.Rngs):
    if cfg.num_encoder_layers < 1 or cfg.num_decoder_layers < 1:
      raise ValueError(
          'EncoderDecoder needs num_encoder_layers >= 1 and num_decoder_layers >= 1, '
          f'got {cfg.num_encoder_layers} and {cfg.num_decoder_layers}.'
      )
    self.bos_id = bos_id
    self._init_output(cfg, rngs)
    self.encoder = Stack(cfg, 'encoder', cfg.num_encoder_layers, self.tokens, rngs=rngs)
    self.decoder = Stack(cfg, 'decoder', cfg.num_decoder_layers, self.tokens, cross=True, rngs=rngs)

  def constructor_kwargs(self) -> dict:
    """The arguments besides the config that build this model again (e.g. re-parametrized)."""
    return {'bos_id': self.bos_id}

  def encode(
      self,
      inputs: Array,
      *,
      segment_ids: Array | None = None,
      positions: Array | None = None,
      deterministic: bool = True,
      rngs: nnx.Rngs | None = None,
      head_masks: HeadMasks = None,
      return_weights: bool = False,
      return_logits: bool = False,
  ):
    """inputs `[batch, source_length]` -> (encoded `[batch, source_length, D]`, extras)."""
    segments = (inputs != 0).astype(jnp.int32) if segment_ids is None else segment_ids
    return self.encoder(
        inputs,
        _positions(inputs, positions),
        segment_ids=(segments, segments),
        deterministic=deterministic,
        rngs=rngs,
        head_masks=head_masks,
        return_weights=return_weights,
        return_logits=return_logits,
    )

  def decode(
      self,
      encoded: Array,
      inputs: Array,
      decoder_inputs: Array,
      *,
      target_segment_ids: Array | None = None,
      source_segment_ids: Array | None = None,
      positions: Array | None = None,
      deterministic: bool = True,
      rngs: nnx.Rngs | None = None,
      decode: bool = False,
      head_masks: HeadMasks = None,
      return_weights: bool = False,
      return_logits: bool = False,
  ):
    """Decoder logits for `decoder_inputs` `[batch, target_length]` given the encoding.

    `inputs` (the source tokens) only provide the source padding mask (or pass
    `source_segment_ids`). With `decode=True`, pass one step (or chunk) at a time; positions
    default to the cache position onwards and the cache handles causality.
    """
    source = (inputs != 0).astype(jnp.int32) if source_segment_ids is None else source_segment_ids
    if target_segment_ids is None:
      target_segment_ids = jnp.ones(decoder_inputs.shape, jnp.int32)
    if decode:
      self_segments = None
      positions = _positions(decoder_inputs, positions, start=self.decoder.cache_index())
    else:
      self_segments = (target_segment_ids, target_segment_ids)  # and causal
    x, extras = self.decoder(
        decoder_inputs,
        _positions(decoder_inputs, positions),
        segment_ids=self_segments,
        encoded=encoded,
        cross_segment_ids=(target_segment_ids, source),
        deterministic=deterministic,
        rngs=rngs,
        decode=decode,
        head_masks=head_masks,
        return_weights=return_weights,
        return_logits=return_logits,
    )
    return self._logits(x), extras

  def __call__(
      self,
      inputs: Array,
      targets: Array,
      *,
      inputs_segment_ids: Array | None = None,
      targets_segment_ids: Array | None = None,
      inputs_positions: Array | None = None,
      targets_positions: Array | None = None,
      deterministic: bool = True,
      rngs: nnx.Rngs | None = None,
      head_masks: HeadMasks = None,
      return_weights: bool = False,
      return_logits: bool = False,
  ):
    """inputs `[batch, source_length]`, targets `[batch, target_length]` -> (logits, aux)."""
    options = dict(
        deterministic=deterministic,
        rngs=rngs,
        head_masks=head_masks,
        return_weights=return_weights,
        return_logits=return_logits,
    )
    encoded, enc_extras = self.encode(
        inputs, segment_ids=inputs_segment_ids, positions=inputs_positions, **options
    )
    shifted = jnp.concatenate([jnp.full_like(targets[:, :1], self.bos_id), targets[:, :-1]], axis=1)
    if targets_positions is not None:  # packed: each target segment starts from BOS
      shifted = jnp.where(targets_positions == 0, self.bos_id, shifted)
    target_segments = (
        (targets != 0).astype(jnp.int32) if targets_segment_ids is None else targets_segment_ids
    )
    logits, dec_extras = self.decode(
        encoded,
        inputs,
        shifted,
        target_segment_ids=target_segments,
        source_segment_ids=inputs_segment_ids,
        positions=targets_positions,
        **options,
    )
    return logits, self._aux(_merge(enc_extras, dec_extras))

  def init_cache(self, batch_size: int, max_length: int | None = None) -> None:
    self.decoder.init_cache(batch_size, max_length or self.cfg.max_length, self.cfg.compute_dtype)

  def flops(self, batch_size: int, source_length: int, target_length: int) -> int:
    return (
        self.encoder.flops(batch_size, source_length)
        + self.decoder.flops(batch_size, target_length, source_length)
        + self._logits_flops(batch_size * target_length)
    )
