"""The three models: decoder-only LM, encoder-only masked LM (BERT-style), encoder-decoder.

Every model returns `(logits, aux)`:
  logits  `[batch, length, vocab]` float32;
  aux     `{'l0_penalty': scalar}` (the expected number of open head gates over all gated
          layers, 0 without gates; add `lambda * l0_penalty` to the loss, Voita et al. 2019),
          plus `'attention_weights': {type: (per-layer [batch, heads, q, kv], ...)}` when
          called with `return_weights=True`, types being 'encoder', 'decoder' and 'cross'.

`head_masks={type: [num_layers, heads] or a per-layer sequence}` multiplies each head's output;
its gradient at ones is the head importance of Michel et al. (2019), and 0/1 values prune.
Layers are a Python list, not a scanned stack: pruning leaves layers with different head
counts, and per-layer caches, weights and masks stay simple.
"""

from collections.abc import Mapping, Sequence

from flax import nnx
import jax
import jax.numpy as jnp

from lowrank_attn.attention import causal_mask, combine_masks, padding_mask, segment_mask
from lowrank_attn.models.config import TransformerConfig
from lowrank_attn.models.layers import (
    ACTIVATIONS, InputEmbedding, LayerNorm, TokenEmbedding, TransformerLayer, constrain, dense_2d,
    logical)

Array = jax.Array
HeadMasks = Mapping[str, Array | Sequence[Array | None]] | None


def _layer_mask(head_masks: HeadMasks, attention_type: str, index: int):
  if not head_masks or head_masks.get(attention_type) is None:
    return None
  return head_masks[attention_type][index]


def _positions(tokens: Array, positions: Array | None) -> Array:
  if positions is not None:
    return positions
  return jnp.broadcast_to(jnp.arange(tokens.shape[-1], dtype=jnp.int32), tokens.shape)


def _mlp_flops(cfg: TransformerConfig, tokens: int) -> int:
  return 2 * 2 * tokens * cfg.emb_dim * cfg.mlp_dim


class Stack(nnx.Module):
  """Input embedding, `num_layers` transformer layers, final LayerNorm (pre-LN only)."""

  def __init__(self, cfg: TransformerConfig, attention_type: str, num_layers: int,
               tokens: TokenEmbedding, *, cross: bool = False, rngs: nnx.Rngs):
    self.attention_type = attention_type
    self.embedding = InputEmbedding(cfg, tokens, rngs=rngs)
    self.layers = nnx.List([TransformerLayer(cfg, attention_type, cross, rngs=rngs)
                            for _ in range(num_layers)])
    self.final_norm = LayerNorm(cfg, rngs=rngs) if cfg.norm == 'pre' else None

  def __call__(self, tokens, positions, *, mask, token_types=None, encoded=None,
               cross_mask=None, deterministic=True, rngs=None, decode=False,
               head_masks: HeadMasks = None, return_weights=False):
    x = self.embedding(tokens, positions, token_types, deterministic=deterministic, rngs=rngs)
    weights = {self.attention_type: [], 'cross': []}
    for i, layer in enumerate(self.layers):
      x, layer_weights = layer(
          x, mask=mask, encoded=encoded, cross_mask=cross_mask, deterministic=deterministic,
          rngs=rngs, decode=decode, return_weights=return_weights,
          head_masks=(_layer_mask(head_masks, self.attention_type, i),
                      _layer_mask(head_masks, 'cross', i)))
      for name, w in layer_weights.items():
        weights[self.attention_type if name == 'self' else 'cross'].append(w)
    if self.final_norm is not None:
      x = self.final_norm(x)
    return x, {k: tuple(v) for k, v in weights.items() if v}

  def l0_penalty(self) -> Array:
    return sum((layer.l0_penalty() for layer in self.layers), jnp.zeros((), jnp.float32))

  def init_cache(self, batch_size: int, max_length: int, dtype) -> None:
    for layer in self.layers:
      layer.self_attention.init_cache((batch_size, max_length, layer.cfg.emb_dim), dtype)

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
    self.output = None if cfg.tie_embeddings else nnx.Linear(
        cfg.emb_dim, cfg.vocab_size, use_bias=False, dtype=cfg.dtype,
        param_dtype=cfg.param_dtype, rngs=rngs,
        kernel_metadata=logical('embed', 'vocab'))

  def _logits(self, x: Array) -> Array:
    logits = self.tokens.attend(x) if self.output is None else dense_2d(self.output, x)
    return constrain(logits.astype(jnp.float32), ('batch', 'length', 'vocab'))

  def _logits_flops(self, tokens: int) -> int:
    return 2 * tokens * self.cfg.emb_dim * self.cfg.vocab_size

  def _aux(self, weights, return_weights):
    aux = {'l0_penalty': self.l0_penalty()}
    if return_weights:
      aux['attention_weights'] = weights
    return aux


class DecoderLM(_Model):
  """Causal language model. Packed rows: `segment_ids` (0 = padding) keep documents apart."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    if cfg.num_decoder_layers < 1:
      raise ValueError(f'DecoderLM needs num_decoder_layers >= 1, got {cfg.num_decoder_layers}.')
    self._init_output(cfg, rngs)
    self.decoder = Stack(cfg, 'decoder', cfg.num_decoder_layers, self.tokens, rngs=rngs)

  def __call__(self, inputs: Array, *, positions: Array | None = None,
               segment_ids: Array | None = None, deterministic: bool = True,
               rngs: nnx.Rngs | None = None, decode: bool = False,
               head_masks: HeadMasks = None, return_weights: bool = False):
    """inputs `[batch, length]` int -> (logits `[batch, length, vocab]`, aux)."""
    if decode:
      mask = None  # the cache applies causality and hides unwritten positions
    else:
      segments = (inputs != 0).astype(jnp.int32) if segment_ids is None else segment_ids
      mask = combine_masks(segment_mask(segments, segments),
                           causal_mask(inputs.shape[-1])[None, None])
    x, weights = self.decoder(inputs, _positions(inputs, positions), mask=mask,
                              deterministic=deterministic, rngs=rngs, decode=decode,
                              head_masks=head_masks, return_weights=return_weights)
    return self._logits(x), self._aux(weights, return_weights)

  def l0_penalty(self) -> Array:
    return self.decoder.l0_penalty()

  def init_cache(self, batch_size: int, max_length: int | None = None) -> None:
    self.decoder.init_cache(batch_size, max_length or self.cfg.max_length, self.cfg.dtype)

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
        cfg.emb_dim, cfg.emb_dim, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs,
        kernel_metadata=logical(None, 'embed'), bias_metadata=logical('embed'))
    self.head_norm = LayerNorm(cfg, rngs=rngs)
    self.activation = ACTIVATIONS[cfg.activation]
    self.output_bias = nnx.Param(jnp.zeros((cfg.vocab_size,), cfg.param_dtype),
                                 **logical('vocab'))

  def __call__(self, inputs: Array, *, positions: Array | None = None,
               segment_ids: Array | None = None, token_types: Array | None = None,
               deterministic: bool = True, rngs: nnx.Rngs | None = None,
               head_masks: HeadMasks = None, return_weights: bool = False):
    """inputs `[batch, length]` int (with mask tokens) -> (logits, aux)."""
    x, weights = self.encode(inputs, positions=positions, segment_ids=segment_ids,
                             token_types=token_types, deterministic=deterministic, rngs=rngs,
                             head_masks=head_masks, return_weights=return_weights)
    h = self.head_norm(self.activation(dense_2d(self.head_dense, x)))
    logits = self._logits(h) + self.output_bias[...].astype(jnp.float32)
    return logits, self._aux(weights, return_weights)

  def encode(self, inputs: Array, *, positions: Array | None = None,
             segment_ids: Array | None = None, token_types: Array | None = None,
             deterministic: bool = True, rngs: nnx.Rngs | None = None,
             head_masks: HeadMasks = None, return_weights: bool = False):
    """Final hidden states `[batch, length, D]` (padding: token 0 / segment 0) and weights."""
    segments = (inputs != 0).astype(jnp.int32) if segment_ids is None else segment_ids
    return self.encoder(inputs, _positions(inputs, positions),
                        mask=segment_mask(segments, segments), token_types=token_types,
                        deterministic=deterministic, rngs=rngs, head_masks=head_masks,
                        return_weights=return_weights)

  def l0_penalty(self) -> Array:
    return self.encoder.l0_penalty()

  def flops(self, batch_size: int, length: int) -> int:
    tokens = batch_size * length
    return (self.encoder.flops(batch_size, length) + 2 * tokens * self.cfg.emb_dim ** 2
            + self._logits_flops(tokens))


class EncoderDecoder(_Model):
  """Translation model; source and target share one vocabulary and embedding matrix.

  Training: `model(inputs, targets)` feeds the decoder `targets` shifted right, starting with
  `bos_id`. Decoding: `encode` once, `init_cache`, then `decode(..., decode=True)` per token.
  """

  def __init__(self, cfg: TransformerConfig, *, bos_id: int, rngs: nnx.Rngs):
    if cfg.num_encoder_layers < 1 or cfg.num_decoder_layers < 1:
      raise ValueError('EncoderDecoder needs num_encoder_layers >= 1 and num_decoder_layers >= 1, '
                       f'got {cfg.num_encoder_layers} and {cfg.num_decoder_layers}.')
    self.bos_id = bos_id
    self._init_output(cfg, rngs)
    self.encoder = Stack(cfg, 'encoder', cfg.num_encoder_layers, self.tokens, rngs=rngs)
    self.decoder = Stack(cfg, 'decoder', cfg.num_decoder_layers, self.tokens, cross=True,
                         rngs=rngs)

  def encode(self, inputs: Array, *, deterministic: bool = True, rngs: nnx.Rngs | None = None,
             head_masks: HeadMasks = None, return_weights: bool = False):
    """inputs `[batch, source_length]` -> (encoded `[batch, source_length, D]`, weights)."""
    valid = inputs != 0
    return self.encoder(inputs, _positions(inputs, None), mask=padding_mask(valid, valid),
                        deterministic=deterministic, rngs=rngs, head_masks=head_masks,
                        return_weights=return_weights)

  def decode(self, encoded: Array, inputs: Array, decoder_inputs: Array, *,
             target_valid: Array | None = None, positions: Array | None = None,
             deterministic: bool = True, rngs: nnx.Rngs | None = None, decode: bool = False,
             head_masks: HeadMasks = None, return_weights: bool = False):
    """Decoder logits for `decoder_inputs` `[batch, target_length]` given the encoding.

    `inputs` (the source tokens) only provide the source padding mask. With `decode=True`,
    pass one step at a time with its `positions`; the cache handles causality.
    """
    source_valid = inputs != 0
    if target_valid is None:
      target_valid = jnp.ones(decoder_inputs.shape, bool)
    cross_mask = padding_mask(target_valid, source_valid)
    self_mask = None if decode else combine_masks(
        padding_mask(target_valid, target_valid),
        causal_mask(decoder_inputs.shape[-1])[None, None])
    x, weights = self.decoder(
        decoder_inputs, _positions(decoder_inputs, positions), mask=self_mask, encoded=encoded,
        cross_mask=cross_mask, deterministic=deterministic, rngs=rngs, decode=decode,
        head_masks=head_masks, return_weights=return_weights)
    return self._logits(x), weights

  def __call__(self, inputs: Array, targets: Array, *, deterministic: bool = True,
               rngs: nnx.Rngs | None = None, head_masks: HeadMasks = None,
               return_weights: bool = False):
    """inputs `[batch, source_length]`, targets `[batch, target_length]` -> (logits, aux)."""
    encoded, enc_weights = self.encode(inputs, deterministic=deterministic, rngs=rngs,
                                       head_masks=head_masks, return_weights=return_weights)
    decoder_inputs = jnp.concatenate(
        [jnp.full_like(targets[:, :1], self.bos_id), targets[:, :-1]], axis=1)
    logits, dec_weights = self.decode(
        encoded, inputs, decoder_inputs, target_valid=targets != 0, deterministic=deterministic,
        rngs=rngs, head_masks=head_masks, return_weights=return_weights)
    return logits, self._aux({**enc_weights, **dec_weights}, return_weights)

  def l0_penalty(self) -> Array:
    return self.encoder.l0_penalty() + self.decoder.l0_penalty()

  def init_cache(self, batch_size: int, max_length: int | None = None) -> None:
    self.decoder.init_cache(batch_size, max_length or self.cfg.max_length, self.cfg.dtype)

  def flops(self, batch_size: int, source_length: int, target_length: int) -> int:
    return (self.encoder.flops(batch_size, source_length)
            + self.decoder.flops(batch_size, target_length, source_length)
            + self._logits_flops(batch_size * target_length))
