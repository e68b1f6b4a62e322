"""The model's building blocks against their papers: sinusoidal positions (Vaswani et al.
2017, sec. 3.5) as a closed form, and the input embedding adding them at the given positions."""

from flax import nnx
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_attn import models
from lowrank_attn.models import layers


def vaswani(positions, features):
  """float64 `[..., length, features]`: feature i < d/2 is sin(pos / 10000^(2i / d)), feature
  d/2 + i its cosine (tensor2tensor's [sin | cos] layout of the paper's interleaved one); an
  odd width ends with a zero column."""
  half = features // 2
  pos = np.asarray(positions, np.float64)[..., None]
  angles = pos / 10000.0 ** (2 * np.arange(half) / (2 * half))
  table = np.concatenate([np.sin(angles), np.cos(angles)], -1)
  return np.concatenate([table, np.zeros((*table.shape[:-1], features - 2 * half))], -1)


@pytest.mark.parametrize('features', [8, 7, 2])
def test_sinusoidal_positions_are_vaswanis_closed_form(features):
  positions = np.array([[0, 1, 2, 3, 49], [5, 0, 1, 31, 2]])
  got = np.asarray(layers.sinusoidal_positions(jnp.asarray(positions), features))
  # float32: the angle pos x 10000^(-2i/d) is off by a few ulp of itself (<= 50 rad), its
  # sine and cosine by that much.
  np.testing.assert_allclose(
      got, vaswani(positions, features), rtol=0, atol=50 * 8 * np.finfo(np.float32).eps
  )
  # Position 0 is [0..0 | 1..1]; the first pair turns at 1 rad per position.
  np.testing.assert_array_equal(got[0, 0, : features // 2], 0.0)
  np.testing.assert_array_equal(got[0, 0, features // 2 : 2 * (features // 2)], 1.0)


def test_input_embedding_adds_the_sinusoid_of_each_given_position():
  cfg = models.TransformerConfig(
      vocab_size=11,
      emb_dim=6,
      mlp_dim=8,
      num_decoder_layers=1,
      decoder_attention=models.AttentionSpec(num_heads=2),
      encoder_attention=models.AttentionSpec(num_heads=2),
      cross_attention=models.AttentionSpec(num_heads=2),
      max_length=16,
      positions='sinusoidal',
      dropout_rate=0.0,
  )
  tokens_layer = layers.TokenEmbedding(cfg, rngs=nnx.Rngs(0))
  embed = layers.InputEmbedding(cfg, tokens_layer, rngs=nnx.Rngs(0))
  tokens = jnp.asarray([[3, 4, 5, 6, 7], [8, 9, 3, 4, 0]])
  positions = np.array([[0, 1, 2, 0, 1], [3, 4, 5, 6, 0]])  # packed rows restart at 0
  x = embed(tokens, jnp.asarray(positions), deterministic=True, rngs=None)
  added = np.asarray(x - tokens_layer(tokens), np.float64)
  np.testing.assert_allclose(added, vaswani(positions, 6), rtol=0, atol=1e-6)
