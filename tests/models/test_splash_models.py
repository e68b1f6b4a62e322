"""The models pass segment ids; with implementation='splash' they compute what 'xla' does.

Packed rows with padding: every attention type (encoder, causal decoder, cross) gets its
(query, key) segment ids, which splash takes as its kernel's segment ids and 'xla' as a mask.
The kernel runs in Pallas' CPU interpreter (no TPU here).
"""

import functools

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lowrank_attn import models

V = 40
LENGTH = 20  # padded to splash's 128-wide blocks inside the kernel call


def config(implementation, kind='concat'):
  options = dict(key_dim=8) if kind == 'collaborative' else {}
  # platform='tpu': splash is checked as on a TPU (and runs in Pallas' interpreter here).
  attention = models.AttentionSpec(
      num_heads=2, kind=kind, implementation=implementation, platform='tpu', **options
  )
  return models.TransformerConfig(
      vocab_size=V,
      emb_dim=16,
      mlp_dim=32,
      num_encoder_layers=1,
      num_decoder_layers=1,
      encoder_attention=attention,
      decoder_attention=attention,
      cross_attention=attention,
      max_length=LENGTH,
      dropout_rate=0.0,
      dtype='float32',
  )  # not 'auto', which platform='tpu' would make bfloat16: compare kernels


def packed(lengths_per_row, seed):
  """tokens, segment ids and positions `[rows, LENGTH]` of rows packing segments of the given
  lengths, padded with 0."""
  rng = np.random.RandomState(seed)
  tokens = np.zeros((len(lengths_per_row), LENGTH), np.int32)
  segments, positions = np.zeros_like(tokens), np.zeros_like(tokens)
  for row, lengths in enumerate(lengths_per_row):
    start = 0
    for segment, length in enumerate(lengths, start=1):
      tokens[row, start : start + length] = rng.randint(3, V, length)
      segments[row, start : start + length] = segment
      positions[row, start : start + length] = np.arange(length)
      start += length
  return jnp.asarray(tokens), jnp.asarray(segments), jnp.asarray(positions)


# Row 1 of the targets has a third segment with no source segment: its cross-attention
# queries see no key.
SOURCE = packed([[6, 9], [4, 3]], seed=0)
TARGET = packed([[7, 5], [5, 4, 6]], seed=1)


def loss_fn(model, kind):
  if kind == 'nmt':
    (inputs, in_seg, in_pos), (targets, tg_seg, tg_pos) = SOURCE, TARGET
    logits, _ = model(
        inputs,
        targets,
        inputs_segment_ids=in_seg,
        targets_segment_ids=tg_seg,
        inputs_positions=in_pos,
        targets_positions=tg_pos,
    )
  else:
    targets, segments, positions = TARGET
    logits, _ = model(targets, segment_ids=segments, positions=positions)
  weights = (targets != 0).astype(jnp.float32)
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  return jnp.sum(losses * weights) / jnp.sum(weights)


def build(kind, cfg):
  if kind == 'lm':
    return models.DecoderLM(cfg, rngs=nnx.Rngs(0))
  if kind == 'mlm':
    return models.EncoderMLM(cfg, rngs=nnx.Rngs(0))
  return models.EncoderDecoder(cfg, bos_id=1, rngs=nnx.Rngs(0))


# nmt (three attention types in the interpreter, 30-75 s each on 2 cores) runs in `make test-all`.
@pytest.mark.parametrize(
    'kind,attention_kind',
    [
        pytest.param('nmt', 'concat', marks=pytest.mark.slow),
        pytest.param('nmt', 'collaborative', marks=pytest.mark.slow),
        ('lm', 'concat'),
        ('mlm', 'concat'),
    ],
)
def test_splash_model_matches_xla(monkeypatch, kind, attention_kind):
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

  monkeypatch.setattr(
      splash, 'make_splash_mha', functools.partial(splash.make_splash_mha, interpret=True)
  )
  model = build(kind, config('xla', attention_kind))
  expected, expected_grads = nnx.value_and_grad(loss_fn)(model, kind)
  # The same parameters, only the attention implementation changed.
  model = build(kind, config('splash', attention_kind))
  loss, grads = nnx.value_and_grad(loss_fn)(model, kind)
  np.testing.assert_allclose(loss, expected, rtol=1e-5)
  for g, g_ref in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads), strict=True):
    np.testing.assert_allclose(g, g_ref, atol=2e-5, rtol=2e-4)


def test_packed_pairs_translate_as_if_alone():
  """The segment ids the translation model passes (encoder, causal decoder, cross): each
  packed pair's logits are those of the pair alone in a row."""
  model = build('nmt', config('xla'))
  (inputs, in_seg, in_pos), (targets, tg_seg, tg_pos) = SOURCE, TARGET
  packed_logits, _ = model(
      inputs,
      targets,
      inputs_segment_ids=in_seg,
      targets_segment_ids=tg_seg,
      inputs_positions=in_pos,
      targets_positions=tg_pos,
  )
  alone = lambda tokens: jnp.pad(tokens, (0, LENGTH - len(tokens)))[None]
  for segment in (1, 2):
    source = inputs[0][in_seg[0] == segment]
    target = targets[0][tg_seg[0] == segment]
    logits, _ = model(alone(source), alone(target))
    np.testing.assert_allclose(
        packed_logits[0][tg_seg[0] == segment], logits[0, : len(target)], atol=1e-5
    )
