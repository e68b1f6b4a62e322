"""The three models: shapes, masks, caches, head masks/gates and logical axes."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_attn import models

V = 40


def cfg(**overrides):
  attention = models.AttentionSpec(num_heads=4)
  base = dict(
      vocab_size=V,
      emb_dim=32,
      mlp_dim=64,
      num_encoder_layers=2,
      num_decoder_layers=2,
      encoder_attention=attention,
      decoder_attention=attention,
      cross_attention=attention,
      max_length=16,
      dropout_rate=0.0,
  )
  base.update(overrides)
  return models.TransformerConfig(**base)


def build(kind, config=None, seed=0):
  """Built as in a notebook: no mesh, no sharding context (logical axes are metadata)."""
  config = config or cfg()
  if kind == 'lm':
    return models.DecoderLM(config, rngs=nnx.Rngs(seed))
  if kind == 'mlm':
    return models.EncoderMLM(config, rngs=nnx.Rngs(seed))
  return models.EncoderDecoder(config, bos_id=1, rngs=nnx.Rngs(seed))


def jit(fn):
  """nnx.jit: one compilation per test instead of one per eager op (much faster on CPU)."""
  return nnx.jit(fn)


def tokens(shape, seed=0, low=3):
  return jnp.asarray(np.random.RandomState(seed).randint(low, V, shape), jnp.int32)


@pytest.mark.parametrize('kind', ['lm', 'mlm', 'nmt'])
def test_every_parameter_has_logical_axes(kind):
  model = build(
      kind,
      cfg(
          encoder_attention=models.AttentionSpec(
              num_heads=4, kind='collaborative', key_dim=16, gated=True
          ),
          tie_embeddings=False,
      ),
  )
  params = nnx.state(model, nnx.Param)
  for path, variable in jax.tree_util.tree_flatten_with_path(
      params, is_leaf=lambda x: isinstance(x, nnx.Variable)
  )[0]:
    axes = variable.get_metadata().get('out_sharding')
    name = '/'.join(str(getattr(k, 'key', k)) for k in path)
    assert axes is not None, f'{name} has no logical axes'
    assert len(axes) == variable.get_value().ndim, name
    assert set(axes) <= set(models.LOGICAL_AXES) | {None}, (name, axes)


def test_lm_is_causal_and_packed_documents_do_not_see_each_other():
  model = build('lm')
  run = jit(
      lambda m, x, positions=None, segment_ids=None: m(
          x, positions=positions, segment_ids=segment_ids
      )
  )
  x = tokens((2, 12))
  logits, aux = run(model, x)
  assert logits.shape == (2, 12, V) and logits.dtype == jnp.float32
  assert float(aux['l0_penalty']) == 0.0
  changed = x.at[:, 8:].set(5)
  np.testing.assert_allclose(run(model, changed)[0][:, :8], logits[:, :8], atol=1e-5)

  # Two documents packed in one row behave as if each were alone (positions restart).
  doc_a, doc_b = tokens((1, 5), seed=1), tokens((1, 7), seed=2)
  packed = jnp.concatenate([doc_a, doc_b], axis=1)
  segments = jnp.array([[1] * 5 + [2] * 7])
  positions = jnp.array([list(range(5)) + list(range(7))])
  packed_logits, _ = run(model, packed, positions, segments)
  np.testing.assert_allclose(packed_logits[:, 5:], run(model, doc_b)[0], atol=1e-5)
  np.testing.assert_allclose(packed_logits[:, :5], run(model, doc_a)[0], atol=1e-5)


def test_mlm_ignores_padding_and_has_bert_hooks():
  config = cfg(norm='post', scale_embeddings=False, type_vocab_size=2, layer_norm_epsilon=1e-12)
  model = build('mlm', config)
  run = jit(lambda m, x, token_types=None: m(x, token_types=token_types)[0])
  x = tokens((2, 10))
  padded = jnp.concatenate([x, jnp.zeros((2, 4), jnp.int32)], axis=1)
  logits = run(model, x)
  np.testing.assert_allclose(run(model, padded)[:, :10], logits, atol=1e-5)
  assert not np.allclose(run(model, x, jnp.ones_like(x)), logits)
  assert model.encoder.embedding.norm is not None  # BERT's embedding LayerNorm
  assert model.output_bias.get_value().shape == (V,)


def test_mlm_output_layer_at_the_masked_positions_only():
  """`output_positions` (tasks/mlm.py's masked positions) gives the full logits' rows at those
  positions, and the task's loss on them equals a numpy cross-entropy over the full logits
  weighted at the masked tokens; the FLOPs count the output layer at those positions only."""
  from lowrank_attn.tasks import mlm  # pylint: disable=g-import-not-at-top

  model = build('mlm')
  x = tokens((2, 10))
  masked = jnp.asarray([[1, 4, 7, 0], [2, 3, 9, 0]], jnp.int32)
  weights = np.asarray([[1, 1, 1, 0], [1, 1, 0, 0]], np.float32)  # row 1 predicts 2 tokens
  targets = np.asarray(tokens((2, 4), seed=1)) * (weights > 0)
  full = np.asarray(jit(lambda m, x: m(x)[0])(model, x), np.float64)
  batch = {
      'inputs': x,
      'masked_positions': masked,
      'targets': jnp.asarray(targets),
      'weights': jnp.asarray(weights),
  }
  gathered = jit(lambda m, b: mlm.TASK.forward(m, b)[0])(model, batch)
  assert gathered.shape == (2, 4, V)
  np.testing.assert_allclose(gathered, full[np.arange(2)[:, None], masked], rtol=1e-5, atol=1e-5)

  log_probs = full - np.log(np.exp(full - full.max(-1, keepdims=True)).sum(-1, keepdims=True))
  log_probs -= full.max(-1, keepdims=True)
  dense_weights, dense_targets = np.zeros((2, 10)), np.zeros((2, 10), int)
  for row, column in zip(*np.nonzero(weights)):
    dense_weights[row, masked[row, column]] = 1
    dense_targets[row, masked[row, column]] = targets[row, column]
  nll = -np.take_along_axis(log_probs, dense_targets[..., None], -1)[..., 0]
  sums = mlm.TASK.loss(gathered, batch, 0.0)
  assert float(sums['weight']) == 5
  np.testing.assert_allclose(float(sums['nll']), (nll * dense_weights).sum(), rtol=1e-5)

  D, M, L, B, P = 32, 64, 10, 2, 4  # 2 layers, dense D x D head, logits D x V per output
  layers = 2 * (4 * D * D + 2 * L * D + 2 * D * M)
  shapes = {k: v.shape for k, v in batch.items()}
  assert mlm.TASK.flops(model, shapes) == 2 * B * (L * layers + P * (D * D + D * V))


@pytest.mark.parametrize('kind', ['concat', 'collaborative', 'talking_heads'])
def test_translation_cache_decoding_matches_teacher_forcing(kind):
  attention = models.AttentionSpec(num_heads=4, kind=kind)
  model = build('nmt', cfg(decoder_attention=attention, positions='sinusoidal'))
  src = tokens((2, 9)).at[1, 6:].set(0)
  tgt = tokens((2, 6), seed=3)
  full, _ = jit(lambda m, s, t: m(s, t))(model, src, tgt)
  encoded, _ = jit(lambda m, s: m.encode(s))(model, src)
  model.init_cache(2, 6)
  decoder_inputs = jnp.concatenate([jnp.ones((2, 1), jnp.int32), tgt[:, :-1]], axis=1)
  step = jit(
      lambda m, e, s, token, i: m.decode(e, s, token, positions=jnp.full((2, 1), i), decode=True)[0]
  )
  steps = [step(model, encoded, src, decoder_inputs[:, i : i + 1], i) for i in range(6)]
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=2e-5)


@pytest.mark.parametrize('kind', ['lm', 'nmt'])
def test_decoding_without_positions_continues_from_the_cache(kind):
  """decode=True without `positions`: each step's position comes from the cache, not 0.

  Learned positions, so a wrong position changes the logits; a prefill chunk of 3 tokens,
  then one token at a time.
  """
  model = build(kind, cfg(positions='learned'))
  n = 7
  if kind == 'lm':
    inputs = tokens((2, n))
    full, _ = jit(lambda m, x: m(x))(model, inputs)
    step = jit(lambda m, x: m(x, decode=True)[0])
  else:
    src = tokens((2, 9)).at[1, 6:].set(0)
    tgt = tokens((2, n), seed=3)
    full, _ = jit(lambda m, s, t: m(s, t))(model, src, tgt)
    encoded, _ = jit(lambda m, s: m.encode(s))(model, src)
    inputs = jnp.concatenate([jnp.full((2, 1), model.bos_id, jnp.int32), tgt[:, :-1]], axis=1)
    step = jit(lambda m, t: m.decode(encoded, src, t, decode=True)[0])
  model.init_cache(2, n)
  chunks = [(0, 3)] + [(t, t + 1) for t in range(3, n)]
  steps = [step(model, inputs[:, start:stop]) for start, stop in chunks]
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=2e-5)


def test_attention_kind_per_type_and_gates(numpy_reference):
  config = cfg(
      encoder_attention=models.AttentionSpec(num_heads=4, kind='collaborative', key_dim=16),
      decoder_attention=models.AttentionSpec(num_heads=4, gated=True),
      cross_attention=models.AttentionSpec(num_heads=2, kind='fixed_head', head_dim=8, gated=True),
  )
  model = build('nmt', config)
  assert model.encoder.layers[0].self_attention.spec.kind == 'collaborative'
  assert model.decoder.layers[0].self_attention.spec.kind == 'concat'
  assert model.decoder.layers[1].cross_attention.spec.num_heads == 2
  # Fresh gates are open at evaluation: a freshly gated model computes its ungated version.
  gated = [layer.self_attention for layer in model.decoder.layers] + [
      layer.cross_attention for layer in model.decoder.layers
  ]
  assert all(np.all(np.asarray(a.gate_values()) == 1.0) for a in gated)
  # The penalty with the default gate settings is Voita et al.'s (numpy reference, eq. 12),
  # for each of the 2 x (4 + 2) gated heads; log alphas set here, not the library's default.
  rng = np.random.default_rng(0)
  log_alphas = [rng.uniform(-3, 3, a.num_heads).astype(np.float32) for a in gated]
  for a, log_alpha in zip(gated, log_alphas):
    a.gate_log_alpha[...] = log_alpha
  _, aux = jit(lambda m, s, t: m(s, t))(model, tokens((2, 5)), tokens((2, 4)))
  ref = numpy_reference
  per_layer = [
      ref.hard_concrete_prob_open(a, ref.VOITA_TEMPERATURE, ref.STRETCH).sum() for a in log_alphas
  ]
  # Voita et al.'s penalty sums over heads and averages over the 4 gated attention layers.
  np.testing.assert_allclose(aux['l0_penalty_sum'], sum(per_layer), rtol=1e-5)
  np.testing.assert_allclose(aux['l0_penalty'], np.mean(per_layer), rtol=1e-5)


def test_head_masks_and_attention_weights():
  model = build('nmt')
  src, tgt = tokens((2, 7)), tokens((2, 5), seed=1)
  ones = {t: jnp.ones((2, 4)) for t in ('encoder', 'decoder', 'cross')}

  graphdef, params = nnx.split(model)

  @jax.jit
  def loss(masks):
    logits, _ = nnx.merge(graphdef, params)(src, tgt, head_masks=masks)
    return jnp.mean(jax.nn.logsumexp(logits, -1))

  np.testing.assert_allclose(loss(ones), loss(None), rtol=1e-6)
  importance = jax.jit(jax.grad(loss))(ones)  # Michel et al. (2019): |d loss / d mask| per head
  for t in ones:
    assert importance[t].shape == (2, 4) and np.all(np.isfinite(importance[t]))
    assert np.any(importance[t] != 0)
  pruned = dict(ones, cross=ones['cross'].at[0, 1].set(0.0))
  assert not np.isclose(loss(pruned), loss(ones))

  _, aux = jit(lambda m, s, t: m(s, t, return_weights=True))(model, src, tgt)
  weights = aux['attention_weights']
  assert [w.shape for w in weights['encoder']] == [(2, 4, 7, 7)] * 2
  assert [w.shape for w in weights['decoder']] == [(2, 4, 5, 5)] * 2
  assert [w.shape for w in weights['cross']] == [(2, 4, 5, 7)] * 2
  np.testing.assert_allclose(jnp.sum(weights['decoder'][0], -1), 1.0, rtol=1e-5)
  assert np.all(np.triu(np.asarray(weights['decoder'][0][0, 0]), 1) == 0)  # causal


def test_bfloat16_compute_keeps_float32_params_and_flops_are_positive():
  model = build('lm', cfg(dtype=jnp.bfloat16))
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
  logits, _ = jit(lambda m, x: m(x))(model, tokens((2, 8)))
  assert logits.dtype == jnp.float32 and np.all(np.isfinite(logits))
  # 2 layers x (4 D^2 projections + 2 L D attention + 2 D M MLP) + D V logits, x 2 per MAC.
  D, M, L, B = 32, 64, 8, 2
  expected = 2 * B * L * (2 * (4 * D * D + 2 * L * D + 2 * D * M) + D * V)
  assert model.flops(B, L) == expected


def test_dropout_uses_call_rngs_and_models_hold_no_rng_state():
  model = build('lm', cfg(dropout_rate=0.5))
  assert not jax.tree.leaves(nnx.state(model, nnx.Not(nnx.Param)))
  x = tokens((2, 8))
  # Calls on the same (stateful) module object: a stream kept inside the model would advance
  # between the two calls with key 0 and give them different masks.
  run = jit(lambda m, x, key: m(x, deterministic=False, rngs=nnx.Rngs(dropout=key))[0])
  a, b, c = (run(model, x, jax.random.key(seed)) for seed in (0, 0, 1))
  np.testing.assert_array_equal(a, b)
  assert not np.allclose(a, c)
  assert not np.allclose(a, jit(lambda m, x: m(x)[0])(model, x))  # dropout is active


def test_invalid_model_settings_are_rejected():
  with pytest.raises(ValueError, match='norm'):
    cfg(norm='sandwich')
  with pytest.raises(ValueError, match="kind='linear'"):
    models.AttentionSpec(num_heads=4, kind='linear')
  with pytest.raises(ValueError, match='num_decoder_layers'):
    build('lm', cfg(num_decoder_layers=0))
  with pytest.raises(ValueError, match='head_dim'):
    build('lm', cfg(decoder_attention=models.AttentionSpec(num_heads=4, kind='fixed_head')))
