"""The NNX layer: agreement with flax.nnx.MultiHeadAttention, conversions, params, decoding."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowrank_attn import nn as lnn

D, H = 32, 4


def flax_layer(seed=0, **kwargs):
  kwargs = {'decode': False, 'bias_init': nnx.initializers.normal(0.5), **kwargs}
  return nnx.MultiHeadAttention(H, D, rngs=nnx.Rngs(seed), **kwargs)


def inputs(shape=(2, 7, D), seed=1):
  return jax.random.normal(jax.random.key(seed), shape)


def tolerance(numpy_reference, layer, x, y=None, mask=None):
  """How far two float32 programs for `layer`'s output (ours and flax's, a cached and a full
  pass) may differ: this computation's rounding measured on this machine, from the layer's
  parameters (`numpy_reference.float32_tolerance`)."""
  params = {name: np.asarray(getattr(layer, name)[...]) for name in layer.spec.param_shapes()}
  return numpy_reference.float32_tolerance(
      params, x, y, kind=layer.spec.kind, mask=mask, normalize_qk=layer.spec.normalize_qk
  )[0]


CAUSAL = lambda n: np.tril(np.ones((n, n), bool))


# ------------------------------------------------------------------ agreement with flax


def test_same_seed_draws_the_same_parameters_as_flax():
  ours = lnn.MultiHeadAttention(H, D, rngs=nnx.Rngs(0))
  theirs = nnx.MultiHeadAttention(H, D, decode=False, rngs=nnx.Rngs(0))
  for name in ('query', 'key', 'value', 'out'):
    np.testing.assert_array_equal(
        getattr(ours, f'{name}_kernel')[...], getattr(theirs, name).kernel[...]
    )


@pytest.mark.parametrize('case', ['self', 'cross', 'causal', 'padding', 'gqa', 'normalize_qk'])
def test_outputs_and_gradients_match_flax(case, numpy_reference):
  kwargs = {'gqa': dict(num_kv_heads=2), 'normalize_qk': dict(normalize_qk=True)}.get(case, {})
  if case == 'cross':
    kwargs = dict(in_kv_features=24)
  theirs = flax_layer(**kwargs)
  ours = lnn.MultiHeadAttention.from_flax(theirs)
  x = inputs()
  y = inputs((2, 5, 24), seed=2) if case == 'cross' else None
  call, mask = {}, None
  if case == 'causal':
    call, mask = dict(is_causal=True), CAUSAL(7)
  if case == 'padding':
    # Key padding, flax's float mask. (Rows with no visible key differ by design: flax
    # averages all values there, we output 0.)
    valid = jnp.arange(7) < jnp.array([[7], [4]])
    call = dict(mask=nnx.make_attention_mask(jnp.ones_like(valid), valid))
    mask = np.asarray(call['mask'], bool)

  def loss(module, x):
    return jnp.sum(jnp.sin(module(x, y, **call)))

  ref_loss, (ref_grad_params, ref_grad_x) = jax.value_and_grad(
      lambda m, x: loss(m, x), argnums=(0, 1)
  )(theirs, x)
  our_loss, (our_grad_params, our_grad_x) = jax.value_and_grad(
      lambda m, x: loss(m, x), argnums=(0, 1)
  )(ours, x)
  np.testing.assert_allclose(our_loss, ref_loss, rtol=1e-5)
  np.testing.assert_allclose(our_grad_x, ref_grad_x, atol=1e-5)
  numpy_reference.assert_within(
      ours(x, y, **call), theirs(x, y, **call), tolerance(numpy_reference, ours, x, y, mask)
  )
  flax_names = {'query': 'query', 'key': 'key', 'value': 'value', 'out': 'out'}
  for ours_prefix, theirs_name in flax_names.items():
    for part in ('kernel', 'bias'):
      np.testing.assert_allclose(
          getattr(our_grad_params, f'{ours_prefix}_{part}')[...],
          getattr(getattr(ref_grad_params, theirs_name), part)[...],
          atol=1e-5,
      )


def test_dropout_matches_flax_for_the_same_rng_stream():
  theirs = flax_layer(dropout_rate=0.3)
  ours = lnn.MultiHeadAttention.from_flax(theirs)
  x = inputs()
  for _ in range(2):  # both streams advance in step
    np.testing.assert_allclose(
        ours(x, deterministic=False), theirs(x, deterministic=False), atol=2e-6
    )


def test_our_core_as_flax_attention_fn(numpy_reference):
  theirs = flax_layer()
  patched = flax_layer(attention_fn=lnn.dot_product_attention)
  x = inputs()
  limit = tolerance(numpy_reference, lnn.MultiHeadAttention.from_flax(theirs), x, None, CAUSAL(7))
  numpy_reference.assert_within(patched(x, is_causal=True), theirs(x, is_causal=True), limit)
  no_keys = jnp.zeros((2, 1, 7, 7))
  np.testing.assert_allclose(
      patched(x, mask=no_keys), jnp.broadcast_to(patched.out.bias[...], (2, 7, D)), atol=1e-6
  )


# ------------------------------------------------------------------ conversion from flax


@pytest.mark.parametrize('kind', ['concat', 'fixed_head', 'talking_heads', 'collaborative'])
def test_from_flax_reproduces_the_original(kind, numpy_reference):
  theirs = flax_layer(in_kv_features=24, out_features=16)
  ours = lnn.MultiHeadAttention.from_flax(theirs, kind=kind)
  x, y = inputs(), inputs((2, 9, 24), seed=3)
  mask = jax.random.bernoulli(jax.random.key(4), 0.7, (2, 1, 7, 9))
  numpy_reference.assert_within(
      ours(x, y, mask=mask),
      theirs(x, y, mask=mask),
      tolerance(numpy_reference, ours, x, y, np.asarray(mask)),
  )
  if kind == 'collaborative':
    assert ours.spec.key_dim == D and ours.spec.logit_scale == pytest.approx(1 / math.sqrt(8))


def test_from_flax_gated_starts_with_open_gates(numpy_reference):
  theirs = flax_layer()
  ours = lnn.MultiHeadAttention.from_flax(
      theirs, kind='collaborative', gated=True, deterministic=True
  )
  limit = tolerance(numpy_reference, ours, inputs())
  numpy_reference.assert_within(ours(inputs()), theirs(inputs()), limit)


def test_key_width_only_for_collaborative():
  # Reduced widths (CP decomposition) are tested in tests/reparam/test_layers.py.
  with pytest.raises(ValueError, match="only used by kind='collaborative'"):
    lnn.MultiHeadAttention.from_flax(flax_layer(), kind='concat', key_dim=8)


# ------------------------------------------------------------------ parameters


LAYERS = {
    'concat': dict(),
    'fixed_head': dict(kind='fixed_head', head_dim=20),
    'collaborative': dict(kind='collaborative', key_dim=12),
    'collaborative_nobias': dict(kind='collaborative', key_dim=12, use_bias=False),
    'talking_heads': dict(kind='talking_heads'),
    'gated_gqa_qknorm': dict(gated=True, num_kv_heads=2, normalize_qk=True),
    'cross': dict(in_kv_features=24, out_features=16, qkv_features=64),
}

# Logical axes of every parameter (golden, as flaxformer checks them): sharding rules key on these.
GOLDEN_AXES = {
    'concat': {
        'query_kernel': ('embed', 'heads', 'kv'),
        'query_bias': ('heads', 'kv'),
        'key_kernel': ('embed', 'heads', 'kv'),
        'key_bias': ('heads', 'kv'),
        'value_kernel': ('embed', 'heads', 'kv'),
        'value_bias': ('heads', 'kv'),
        'out_kernel': ('heads', 'kv', 'embed'),
        'out_bias': ('embed',),
    },
    'collaborative': {
        'query_kernel': ('embed', 'key'),
        'key_kernel': ('embed', 'key'),
        'mixing': ('heads', 'key'),
        'content_bias': ('embed', 'heads'),
        'value_kernel': ('embed', 'heads', 'kv'),
        'value_bias': ('heads', 'kv'),
        'out_kernel': ('heads', 'kv', 'embed'),
        'out_bias': ('embed',),
    },
}


@pytest.mark.parametrize('name', LAYERS)
def test_analytic_parameter_count_equals_the_real_tree(name):
  layer = lnn.MultiHeadAttention(H, D, rngs=nnx.Rngs(0), **LAYERS[name])
  real = sum(x.size for x in jax.tree.leaves(nnx.state(layer, nnx.Param)))
  assert layer.spec.num_params() == real
  shapes = {k: v.shape for k, v in layer.kernel_params().items()}
  assert shapes == layer.spec.param_shapes()


@pytest.mark.parametrize('name', GOLDEN_AXES)
def test_parameters_carry_logical_axis_names(name):
  layer = lnn.MultiHeadAttention(H, D, rngs=nnx.Rngs(0), **LAYERS[name])
  axes = {
      path[-1]: param.out_sharding for path, param in nnx.to_flat_state(nnx.state(layer, nnx.Param))
  }
  assert axes == GOLDEN_AXES[name]


def test_parameters_shard_by_logical_rules_on_a_mesh():
  mesh = jax.make_mesh((2, 4), ('data', 'tensor'), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  rules = (('heads', 'tensor'), ('embed', None), ('kv', None), ('key', 'tensor'))
  layer = nnx.eval_shape(
      lambda: lnn.MultiHeadAttention(8, D, kind='collaborative', key_dim=16, rngs=nnx.Rngs(0))
  )
  with nnx.logical_axis_rules(rules):
    specs = nnx.get_partition_spec(nnx.state(layer, nnx.Param))
  specs = {path[-1]: p for path, p in nnx.to_flat_state(specs)}
  assert specs['mixing'] == jax.P('tensor', 'tensor')
  assert specs['out_kernel'] == jax.P('tensor', None, None)
  del mesh


# ------------------------------------------------------------------ decoding, weights, gates


@pytest.mark.parametrize('name', ['concat', 'collaborative', 'talking_heads', 'gated_gqa_qknorm'])
def test_layer_decoding_equals_full_causal_pass(name, numpy_reference):
  layer = lnn.MultiHeadAttention(H, D, rngs=nnx.Rngs(0), deterministic=True, **LAYERS[name])
  x = inputs((2, 6, D))
  full = layer(x, is_causal=True)
  layer.init_cache(x.shape)
  steps = [layer(x[:, t : t + 1], decode=True) for t in range(6)]
  limit = tolerance(numpy_reference, layer, x, None, CAUSAL(6))
  numpy_reference.assert_within(jnp.concatenate(steps, 1), full, limit)
  with pytest.raises(ValueError, match='exceeds the cache length'):
    layer.init_cache((2, 2, D))
    layer(x[:, :3], decode=True)


def test_decode_without_cache_says_what_to_do():
  with pytest.raises(ValueError, match='call init_cache'):
    lnn.MultiHeadAttention(H, D, rngs=nnx.Rngs(0))(inputs(), decode=True)


def test_attention_weights_on_request_and_sown():
  layer = lnn.MultiHeadAttention(H, D, kind='collaborative', key_dim=8, rngs=nnx.Rngs(0))
  x = inputs()
  out, weights = layer(x, is_causal=True, return_weights=True)
  assert weights.shape == (2, H, 7, 7)
  np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
  assert np.all(np.triu(np.asarray(weights), k=1) == 0)
  _, sown = nnx.capture(lambda m: m(x, is_causal=True, sow_weights=True), nnx.Intermediate)(layer)
  np.testing.assert_array_equal(sown['attention_weights'][0], weights)


def test_gated_layer_penalty_mask_and_modes(numpy_reference):
  """Gates with the layer's default settings follow Voita et al.'s code (numpy reference)."""
  ref = numpy_reference
  layer = lnn.MultiHeadAttention(H, D, gated=True, rngs=nnx.Rngs(0))
  np.testing.assert_array_equal(layer.gate_values(), 1.0)  # fresh: computes the ungated layer
  log_alpha = np.array([-6.0, 3.0, 1.2, 0.0], np.float32)
  layer.gate_log_alpha[...] = log_alpha
  np.testing.assert_allclose(
      layer.l0_penalty(),
      ref.hard_concrete_prob_open(log_alpha, ref.VOITA_TEMPERATURE, ref.STRETCH).sum(),
      rtol=1e-6,
  )
  np.testing.assert_array_equal(layer.pruning_mask(), [False, True, True, True])
  expected_gates = ref.hard_concrete_eval(log_alpha, ref.STRETCH)
  np.testing.assert_allclose(layer.gate_values(), expected_gates, atol=1e-6)
  x = inputs()
  with pytest.raises(ValueError, match='deterministic must be given'):
    layer(x)
  # Evaluation: each head's output scaled by its eq.-13 gate, i.e. the open layer with those
  # factors as a head mask.
  gated_out = layer(x, deterministic=True)
  layer.gate_log_alpha[...] = jnp.full((H,), 10.0)
  np.testing.assert_allclose(
      gated_out,
      layer(x, deterministic=True, head_mask=expected_gates.astype(np.float32)),
      atol=1e-6,
  )
  assert not np.allclose(gated_out, layer(x, deterministic=True), atol=1e-3)
  layer.gate_log_alpha[...] = log_alpha
  assert not np.allclose(layer(x, deterministic=False), layer(x, deterministic=False))
  assert float(lnn.MultiHeadAttention(H, D, rngs=nnx.Rngs(0)).l0_penalty()) == 0.0


def test_l0_penalty_trains_gates_closed():
  layer = lnn.MultiHeadAttention(H, D, gated=True, rngs=nnx.Rngs(0))
  grads = nnx.grad(lambda m: m.l0_penalty())(layer)
  assert np.all(grads.gate_log_alpha[...] > 0)


def test_head_mask_gradient_through_the_layer():
  layer = lnn.MultiHeadAttention(H, D, rngs=nnx.Rngs(0))
  x = inputs()
  importance = jax.grad(lambda m: jnp.sum(layer(x, head_mask=m) ** 2))(jnp.ones(H))
  assert importance.shape == (H,) and np.all(np.isfinite(importance))


def test_nnx_jit_and_bfloat16():
  layer = lnn.MultiHeadAttention(
      H,
      D,
      kind='collaborative',
      key_dim=16,
      dtype=jnp.bfloat16,
      param_dtype=jnp.bfloat16,
      rngs=nnx.Rngs(0),
  )
  x = inputs().astype(jnp.bfloat16)
  out = nnx.jit(lambda m, x: m(x, is_causal=True))(layer, x)
  assert out.dtype == jnp.bfloat16 and np.all(np.isfinite(out.astype(np.float32)))


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    'kwargs, message',
    [
        (dict(attention_fn=lambda *a, **k: None), 'attention_fn is not supported'),
        (dict(qkv_dot_general=jax.lax.dot_general), 'qkv_dot_general is not supported'),
        (dict(out_promote_dtype=lambda *arrays, **_: arrays), 'out_promote_dtype is not supported'),
        (dict(mixing_init='orthogonal'), "mixing_init='orthogonal' is not one of"),
        (dict(dropout_rate=1.0), r'dropout_rate=1.0 must be in \[0, 1\)'),
        (dict(kind='nope'), "kind='nope' is not one of"),
        (dict(qkv_features=30), 'qkv_features=30 must be divisible by num_heads=4'),
    ],
)
def test_invalid_layer_settings(kwargs, message):
  with pytest.raises(ValueError, match=message):
    lnn.MultiHeadAttention(H, D, rngs=nnx.Rngs(0), **kwargs)


def test_invalid_call():
  layer = lnn.MultiHeadAttention(H, D, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match='inputs_k cannot be None'):
    layer(inputs(), None, inputs())
  with pytest.raises(ValueError, match=r'inputs_q has shape \(2, 7, 31\)'):
    layer(inputs((2, 7, 31)))
  # flax's call-time shardings: ours come from the parameters' logical axes (the README says so)
  with pytest.raises(ValueError, match='out_sharding/qkv_sharding are not supported'):
    layer(inputs(), out_sharding=jax.sharding.PartitionSpec())
