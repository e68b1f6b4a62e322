"""Head importance against forward-mode derivatives of each example's masked loss,
streaming and token weighting, layer normalisation; confidence against a numpy loop over real tokens.
"""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_attn import models
from lowrank_attn.analysis import head_confidence, head_importance
from lowrank_attn.pruning import prune_heads

V, D, H, LAYERS = 30, 16, 4, 2
TYPES = ('encoder', 'decoder', 'cross')


def small_model(seed=0):
  spec = models.AttentionSpec(num_heads=H)
  cfg = models.TransformerConfig(
      vocab_size=V,
      emb_dim=D,
      mlp_dim=32,
      num_encoder_layers=LAYERS,
      num_decoder_layers=LAYERS,
      encoder_attention=spec,
      decoder_attention=spec,
      cross_attention=spec,
      max_length=16,
      dropout_rate=0.0,
  )
  model = models.EncoderDecoder(cfg, bos_id=1, rngs=nnx.Rngs(seed))
  rng = np.random.default_rng(seed)
  state = nnx.state(model, nnx.Param)
  nnx.update(
      model,
      jax.tree.map(lambda x: x + 0.3 * jnp.asarray(rng.standard_normal(x.shape), x.dtype), state),
  )
  return model


def translation_batch(seed=0, rows=3):
  """Rows of different lengths (0 = padding), EOS = 2 at the end of each side."""
  rng = np.random.default_rng(seed)
  inputs = np.zeros((rows, 8), np.int32)
  targets = np.zeros((rows, 6), np.int32)
  for row in range(rows):
    n, m = rng.integers(3, 8), rng.integers(2, 6)
    inputs[row, :n] = [*rng.integers(3, V, n - 1), 2]
    targets[row, :m] = [*rng.integers(3, V, m - 1), 2]
  return {'inputs': inputs, 'targets': targets, 'weights': (targets != 0).astype(np.float32)}


def mask_derivatives(example_losses, types) -> dict[str, np.ndarray]:
  """{type: [layers, heads, examples]} dL_x / d xi_h at xi = 1, by forward-mode
  differentiation (`jax.jvp`) of each example's loss along one head's mask at a time: an
  algorithm independent of `head_importance`'s reverse-mode gradient of the summed |.|.

  Not central differences: in float32 a loss L carries rounding of a few ulp(L), which a
  difference quotient divides by its step (|L| ~ 3, step 1e-2: errors ~ 7e-5 on scores down
  to 0.01), and a larger step trades that for truncation error."""
  ones = {t: np.ones((LAYERS, H), np.float32) for t in types}
  out = {}
  for t in types:
    rows = []
    for layer in range(LAYERS):
      for head in range(H):
        tangent = {u: np.zeros((LAYERS, H), np.float32) for u in types}
        tangent[t][layer, head] = 1.0
        _, derivative = jax.jvp(example_losses, (ones,), (tangent,))
        rows.append(np.asarray(derivative, np.float64))
    out[t] = np.stack(rows).reshape(LAYERS, H, -1)
  return out


def assert_float32_close(actual, expected):
  """Two float32 evaluations of the same derivatives (forward and reverse mode): each sums
  O(10^2) rounded terms no larger than the largest score, so they agree to a few hundred
  ulps of that score (float32 ulp ~ 1.2e-7 relative)."""
  scale = np.max(np.abs(expected))
  np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5 * scale)


def test_importance_equals_each_example_loss_derivative():
  """Michel et al.: I_h = sum_x |dL_x/d xi_h| / tokens, the loss being each example's summed
  token cross entropy."""
  model = small_model()
  batch = translation_batch(rows=2)
  graphdef, params = nnx.split(model)

  @jax.jit
  def example_losses(masks):
    logits, _ = nnx.merge(graphdef, params)(batch['inputs'], batch['targets'], head_masks=masks)
    log_probs = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(log_probs, batch['targets'][..., None], -1)[..., 0]
    return jnp.sum(nll * batch['weights'], axis=1)  # [examples]

  derivatives = mask_derivatives(example_losses, TYPES)
  tokens = batch['weights'].sum()
  importance = head_importance(model, [batch])
  for t in TYPES:
    expected = np.sum(np.abs(derivatives[t]), axis=-1) / tokens
    assert_float32_close(importance[t], expected)


def test_importance_streams_over_batches_weighting_examples_by_tokens():
  model = small_model()
  first, second = translation_batch(1, rows=2), translation_batch(2, rows=3)
  joined = {k: np.concatenate([first[k], second[k]]) for k in first}
  streamed, whole = head_importance(model, [first, second]), head_importance(model, [joined])
  for t in TYPES:
    assert_float32_close(streamed[t], whole[t])  # small scores err as much as the largest
  normalised = head_importance(model, [first, second], normalize_layers=True)
  for t in TYPES:
    np.testing.assert_allclose(np.linalg.norm(normalised[t], axis=1), 1.0, rtol=1e-6)
    assert_float32_close(normalised[t] * np.linalg.norm(whole[t], axis=1)[:, None], whole[t])


def numpy_confidence(weights, query_tokens, key_tokens, eos_id=None):
  """Mean over real query tokens of the largest weight on a real key token, per head."""
  real = lambda t: (t != 0) & (t != (eos_id if eos_id is not None else -1))
  total, count = np.zeros(weights.shape[1]), 0
  for b in range(weights.shape[0]):
    for q in np.flatnonzero(real(query_tokens[b])):
      keys = np.flatnonzero(real(key_tokens[b]))
      total += weights[b][:, q, keys].max(axis=-1)
      count += 1
  return total / count


@pytest.mark.parametrize('eos_id', [None, 2])
def test_confidence_is_the_mean_top_weight_over_real_tokens(eos_id):
  model = small_model()
  batch = translation_batch(3)
  _, aux = model(batch['inputs'], batch['targets'], return_weights=True)
  weights = aux['attention_weights']
  shifted = np.concatenate([np.ones((3, 1), np.int32), batch['targets'][:, :-1]], axis=1)
  shifted = np.where(batch['targets'] != 0, shifted, 0)
  tokens = {
      'encoder': (batch['inputs'], batch['inputs']),
      'decoder': (shifted, shifted),
      'cross': (shifted, batch['inputs']),
  }
  confidence = head_confidence(model, [batch], eos_id=eos_id)
  for t in TYPES:
    for layer in range(LAYERS):
      expected = numpy_confidence(np.asarray(weights[t][layer]), *tokens[t], eos_id=eos_id)
      np.testing.assert_allclose(confidence[t][layer], expected, rtol=1e-5)


def test_statistics_of_a_pruned_model_with_ragged_layers():
  model = small_model()
  keep = {'encoder': np.array([[1, 1, 0, 1], [0, 0, 0, 0]], bool)}
  pruned = prune_heads(model, keep)
  batch = translation_batch(4)
  importance = head_importance(pruned, [batch])
  assert [len(x) for x in importance['encoder']] == [3, 0]
  assert importance['decoder'].shape == (LAYERS, H)
  assert head_confidence(pruned, [batch])['encoder'][1].shape == (0,)


def test_empty_batches_are_a_value_error():
  with pytest.raises(ValueError, match='batches is empty'):
    head_importance(small_model(), [])


@pytest.mark.parametrize('num_outputs', [1, 2], ids=['regression', 'classification'])
def test_glue_importance_is_each_example_loss_derivative(num_outputs):
  """A GLUE classifier's importance is the task's own per-example loss (squared error of the
  score, or cross entropy of the class) differentiated per example; padding rows weigh 0."""
  from lowrank_attn.tasks import glue  # pylint: disable=g-import-not-at-top

  spec = models.AttentionSpec(num_heads=H)
  cfg = models.TransformerConfig(
      vocab_size=V,
      emb_dim=D,
      mlp_dim=32,
      num_encoder_layers=LAYERS,
      num_decoder_layers=0,
      encoder_attention=spec,
      max_length=16,
      dropout_rate=0.0,
      type_vocab_size=2,
      norm='post',
  )
  model = glue.SentenceClassifier(
      cfg, num_outputs=num_outputs, pooling='mean', classifier_dropout=0.0, rngs=nnx.Rngs(0)
  )
  rng = np.random.default_rng(3)
  nnx.update(
      model,
      jax.tree.map(
          lambda x: x + 0.3 * jnp.asarray(rng.standard_normal(x.shape), x.dtype),
          nnx.state(model, nnx.Param),
      ),
  )
  rows, length = 3, 8
  inputs = rng.integers(3, V, (rows, length)).astype(np.int32)
  lengths = np.array([8, 5, 3])
  inputs[np.arange(length)[None, :] >= lengths[:, None]] = 0
  segment_ids = (inputs != 0).astype(np.int32)
  batch = {
      'inputs': inputs,
      'segment_ids': segment_ids,
      'positions': np.where(segment_ids > 0, np.arange(length)[None, :], 0).astype(np.int32),
      'token_types': (np.arange(length)[None, :] >= 2).astype(np.int32) * segment_ids,
      'weights': np.array([1.0, 1.0, 0.0], np.float32),
  }  # the last row: padding
  batch['targets'] = (
      rng.random(rows).astype(np.float32) * 5
      if num_outputs == 1
      else rng.integers(0, 2, rows).astype(np.int32)
  )
  graphdef, params = nnx.split(model)

  @jax.jit
  def example_losses(masks):
    outputs, _ = glue._forward(nnx.merge(graphdef, params), batch, head_masks=masks)  # pylint: disable=protected-access
    outputs = outputs.astype(jnp.float32)
    if num_outputs == 1:
      return jnp.square(outputs - batch['targets'])
    log_probs = jax.nn.log_softmax(outputs)
    return -jnp.take_along_axis(log_probs, batch['targets'][:, None], -1)[:, 0]

  derivatives = mask_derivatives(example_losses, ('encoder',))['encoder']
  expected = np.sum(batch['weights'] * np.abs(derivatives), axis=-1) / batch['weights'].sum()
  assert_float32_close(head_importance(model, [batch])['encoder'], expected)
