"""implementation='blockwise' computes what the materialising path computes, in O(L) memory.

Outputs and gradients (w.r.t. parameters and inputs) of every kind agree with
implementation='xla' under every mask type, causal or not, with fully masked rows, on random
shapes and block sizes that do and do not divide the lengths.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lowrank_attn import attention as A
from lowrank_attn.attention import blockwise, dispatch

# Each example compiles two gradients: keep the counts small.
SETTINGS = settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

KINDS = {  # label -> AttentionSpec options
    'concat': dict(),
    'grouped_query': dict(num_kv_heads=1),
    'fixed_head': dict(kind='fixed_head', head_dim=3),
    'collaborative': dict(kind='collaborative', key_dim=5),
    'talking_heads': dict(kind='talking_heads'),
    'talking_heads_grouped': dict(kind='talking_heads', num_kv_heads=1),
    'gated': dict(gated=True),
}
MASKS = (None, 'full', 'per_head', 'padding', 'query_key')


def make_mask(kind, rng, batch, heads, q_length, kv_length):
  """A boolean mask of the given broadcast type, with fully masked query rows."""
  if kind is None:
    return None
  shape = {
      'full': (batch, 1, q_length, kv_length),
      'per_head': (batch, heads, q_length, kv_length),
      'padding': (batch, 1, 1, kv_length),
      'query_key': (q_length, kv_length),
  }[kind]
  mask = rng.random(shape) < 0.7
  if kind == 'padding':
    mask[0] = False  # example 0 sees no key at all
  else:
    mask[..., q_length // 2, :] = False  # a query that sees no key
  return mask


@functools.partial(jax.jit, static_argnames=('spec', 'implementation', 'is_causal', 'block_size'))
def value_and_grads(params, x, y, mask, *, spec, implementation, is_causal, block_size):
  def loss(params, x, y):
    out = A.multi_head_attention(
        params,
        x,
        y,
        spec=spec,
        mask=mask,
        is_causal=is_causal,
        implementation=implementation,
        block_size=block_size,
    ).out
    # sin: a loss whose gradient differs per output element
    return jnp.sum(jnp.sin(out)), out

  (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(params, x, y)
  return out, grads


def assert_same(params, spec, x, y, mask, is_causal, block_size):
  common = dict(spec=spec, is_causal=is_causal, block_size=block_size)
  out, grads = value_and_grads(params, x, y, mask, implementation='xla', **common)
  out_b, grads_b = value_and_grads(params, x, y, mask, implementation='blockwise', **common)
  np.testing.assert_allclose(out_b, out, atol=2e-5, rtol=1e-4)
  names = (*(f'd/d{name}' for name in params), 'd/dx', 'd/dy')
  flat = jax.tree.leaves(grads[0]) + list(grads[1:])
  flat_b = jax.tree.leaves(grads_b[0]) + list(grads_b[1:])
  for name, g, g_b in zip(names, flat, flat_b, strict=True):
    assert np.all(np.isfinite(g_b)), name
    np.testing.assert_allclose(g_b, g, atol=5e-5, rtol=5e-4, err_msg=name)


@st.composite
def cases(draw):
  heads = draw(st.sampled_from([1, 2, 4]))
  batch = draw(st.integers(1, 2))
  q_length, kv_length = draw(st.integers(1, 11)), draw(st.integers(1, 11))
  return dict(
      kind=draw(st.sampled_from(sorted(KINDS))),
      mask=draw(st.sampled_from(MASKS)),
      is_causal=draw(st.booleans()),
      heads=heads,
      batch=batch,
      q_length=q_length,
      kv_length=kv_length,
      block_size=draw(st.integers(1, 8)),
      use_bias=draw(st.booleans()),
      in_features=draw(st.integers(1, 8)),
      seed=draw(st.integers(0, 2**16)),
  )


def build(c, make_params):
  options = KINDS[c['kind']]
  spec = A.AttentionSpec(
      num_heads=c['heads'],
      in_features=c['in_features'],
      qkv_features=2 * c['heads'] if 'head_dim' not in options else None,
      use_bias=c['use_bias'],
      **options,
  )
  rng = np.random.default_rng(c['seed'])
  x = rng.standard_normal((c['batch'], c['q_length'], c['in_features'])).astype(np.float32)
  y = rng.standard_normal((c['batch'], c['kv_length'], c['in_features'])).astype(np.float32)
  mask = make_mask(c['mask'], rng, c['batch'], c['heads'], c['q_length'], c['kv_length'])
  return spec, make_params(spec, c['seed']), x, y, mask


def check_kind_and_mask(make_params, kind, mask_kind):
  """Causal cross-attention in blocks that divide neither length."""
  c = dict(
      kind=kind,
      mask=mask_kind,
      is_causal=True,
      heads=2,
      batch=2,
      q_length=7,
      kv_length=9,
      block_size=3,
      use_bias=True,
      in_features=6,
      seed=1,
  )
  spec, params, x, y, mask = build(c, make_params)
  assert_same(params, spec, x, y, mask, c['is_causal'], c['block_size'])


# Every kind and every mask type, each at least once (the full grid is the slow test below);
# talking heads with per-head masks: its post-softmax mix moves weight across heads.
@pytest.mark.parametrize(
    'kind, mask_kind',
    [
        ('concat', None),
        ('grouped_query', 'padding'),
        ('fixed_head', 'query_key'),
        ('collaborative', 'full'),
        ('talking_heads', 'per_head'),
        ('talking_heads_grouped', 'full'),
        ('gated', 'per_head'),
    ],
)
def test_blockwise_equals_materialising_every_kind_and_mask(make_params, kind, mask_kind):
  check_kind_and_mask(make_params, kind, mask_kind)


@pytest.mark.slow
@pytest.mark.parametrize('mask_kind', MASKS)
@pytest.mark.parametrize('kind', sorted(KINDS))
def test_blockwise_equals_materialising_every_kind_times_every_mask(make_params, kind, mask_kind):
  check_kind_and_mask(make_params, kind, mask_kind)


@SETTINGS
@given(cases())
def test_blockwise_equals_materialising_on_random_shapes(make_params, c):
  spec, params, x, y, mask = build(c, make_params)
  assert_same(params, spec, x, y, mask, c['is_causal'], c['block_size'])


def test_fully_masked_rows_give_zero(make_params):
  spec = A.AttentionSpec(num_heads=2, in_features=4, kind='talking_heads')
  params = make_params(spec)
  x = jnp.ones((1, 5, 4))
  mask = jnp.ones((1, 2, 5, 5), bool).at[:, :, 1, :].set(False)
  heads = dispatch.attend(params, spec, *A.project(params, spec, x, x, x), mask=mask, block_size=2)
  np.testing.assert_array_equal(heads[:, 1], 0.0)
  assert np.all(np.abs(heads[:, 0]) > 0)


# ------------------------------------------------------------------ memory


def temp_bytes(implementation, length, block_size=128):
  spec = A.AttentionSpec(num_heads=4, in_features=64)
  params = {n: jnp.zeros(s) for n, s in spec.param_shapes().items()}
  x = jax.ShapeDtypeStruct((1, length, 64), jnp.float32)

  def loss(params, x):
    return jnp.sum(
        A.multi_head_attention(
            params,
            x,
            spec=spec,
            is_causal=True,
            implementation=implementation,
            block_size=block_size,
        ).out
    )

  compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_blockwise_memory_grows_linearly_in_length():
  blockwise_bytes = [temp_bytes('blockwise', length) for length in (512, 1024, 2048)]
  xla_bytes = [temp_bytes('xla', length) for length in (512, 1024, 2048)]
  for shorter, longer in zip(blockwise_bytes, blockwise_bytes[1:]):
    assert longer <= 2.2 * shorter, blockwise_bytes
  # The materialising path's [batch, heads, q, kv] buffers: 4x per doubling.
  assert xla_bytes[-1] >= 12 * xla_bytes[0], xla_bytes
  assert blockwise_bytes[-1] * 10 < xla_bytes[-1]


# ------------------------------------------------------------------ dropout


def _dropout_out(params, spec, x, rng, rate, block_size=3, broadcast=True, mask=None):
  return A.multi_head_attention(
      params,
      x,
      spec=spec,
      mask=mask,
      rng=rng,
      dropout_rate=rate,
      deterministic=False,
      broadcast_dropout=broadcast,
      implementation='blockwise',
      block_size=block_size,
  ).out


def test_dropout_is_reproducible_and_drops(make_params):
  spec = A.AttentionSpec(num_heads=2, in_features=6)
  params, x = make_params(spec), jnp.asarray(np.random.default_rng(0).normal(size=(2, 7, 6)))
  run = jax.jit(_dropout_out, static_argnames=('spec', 'rate', 'block_size', 'broadcast'))
  first = run(params, spec, x, jax.random.key(0), 0.5)
  np.testing.assert_array_equal(run(params, spec, x, jax.random.key(0), 0.5), first)
  assert not np.allclose(run(params, spec, x, jax.random.key(1), 0.5), first)
  assert not np.allclose(run(params, spec, x, jax.random.key(0), 0.0), first)


@pytest.mark.parametrize(
    'kind, broadcast', [('concat', True), ('collaborative', False), ('talking_heads', False)]
)
def test_dropout_gradients_equal_autodiff_of_the_forward(make_params, monkeypatch, kind, broadcast):
  """The recomputing backward regenerates each block's dropout mask: its gradients equal
  those of differentiating the blockwise forward pass itself (non-causal: static loops)."""
  spec = A.AttentionSpec(num_heads=2, in_features=6, **KINDS[kind])
  params = make_params(spec, 3)
  x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 7, 6)), jnp.float32)
  mask = jnp.asarray(np.random.default_rng(2).random((2, 1, 7, 7)) < 0.7).at[:, :, 3].set(False)

  def grads():
    loss = lambda p, x: jnp.sum(
        jnp.sin(_dropout_out(p, spec, x, jax.random.key(5), 0.4, broadcast=broadcast, mask=mask))
    )
    return jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)

  custom = grads()
  monkeypatch.setattr(blockwise, '_attention', lambda *args: blockwise._forward(*args)[0])
  autodiff = grads()
  for g, g_ref in zip(jax.tree.leaves(custom), jax.tree.leaves(autodiff), strict=True):
    np.testing.assert_allclose(g, g_ref, atol=5e-5, rtol=5e-4)


# ------------------------------------------------------------------ dtype, cache, errors


def test_bfloat16_is_close_to_materialising(make_params):
  spec = A.AttentionSpec(num_heads=4, in_features=32, kind='collaborative', key_dim=16)
  params = make_params(spec, dtype=jnp.bfloat16)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 40, 32)), jnp.bfloat16)
  outs = [
      A.multi_head_attention(
          params, x, spec=spec, is_causal=True, implementation=impl, block_size=16
      ).out
      for impl in ('xla', 'blockwise')
  ]
  assert outs[1].dtype == jnp.bfloat16
  np.testing.assert_allclose(np.float32(outs[1]), np.float32(outs[0]), atol=0.05, rtol=0.05)


def test_decoding_with_a_cache_equals_materialising(make_params):
  spec = A.AttentionSpec(num_heads=2, in_features=8, kind='collaborative', key_dim=6)
  params = make_params(spec)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 6, 8)), jnp.float32)
  for implementation in ('xla', 'blockwise'):
    cache = A.init_cache(spec, (1,), 6)
    outs = []
    for chunk in (x[:, :4], x[:, 4:]):
      result = A.multi_head_attention(
          params, chunk, spec=spec, cache=cache, block_size=3, implementation=implementation
      )
      cache = result.cache
      outs.append(result.out)
    if implementation == 'xla':
      expected = jnp.concatenate(outs, axis=1)
  np.testing.assert_allclose(jnp.concatenate(outs, axis=1), expected, atol=1e-5)


def test_invalid_implementation_settings_name_the_setting(make_params):
  spec = A.AttentionSpec(num_heads=2, in_features=4, kind='talking_heads')
  params, x = make_params(spec), jnp.ones((1, 3, 4))
  call = functools.partial(A.multi_head_attention, params, x, spec=spec)
  with pytest.raises(ValueError, match="implementation='flash' is not one of"):
    call(implementation='flash')
  with pytest.raises(ValueError, match='block_size=0'):
    call(implementation='blockwise', block_size=0)
  with pytest.raises(ValueError, match='return_weights=True needs'):
    call(implementation='blockwise', return_weights=True)
  with pytest.raises(ValueError, match="needs a GPU backend, but this one is 'cpu'"):
    call(implementation='cudnn')
  with pytest.raises(ValueError, match="needs a TPU backend, but this one is 'gpu'"):
    call(implementation='splash', platform='gpu')
  with pytest.raises(ValueError, match="does not support kind='talking_heads'"):
    call(implementation='splash', platform='tpu')
  concat = dataclasses.replace(spec, kind='concat', num_logit_heads=None, platform='tpu')
  concat_params = {k: v for k, v in params.items() if 'mixing' not in k}
  with pytest.raises(ValueError, match='a boolean mask'):  # the spec's platform
    A.multi_head_attention(
        concat_params, x, spec=concat, mask=jnp.ones((3, 3), bool), implementation='splash'
    )
  with pytest.raises(ValueError, match="platform='cuda' is not None or one of"):
    dataclasses.replace(spec, platform='cuda')


@pytest.mark.parametrize('length', [6, 7])
@pytest.mark.parametrize(
    'mask_shape', [(3, 1, 1, None), (3, 1, None, None)], ids=['padding', 'full']
)
def test_cudnn_wrapper_with_xla_standing_in_for_cudnn(make_params, monkeypatch, length, mask_shape):
  """Only our wrapper (batch flattening, masks, odd lengths, fully masked rows): there is no
  GPU here, so jax's XLA implementation stands in for cuDNN, refusing what cuDNN refuses
  (tests/gpu run the real kernel): a mask not of full [q, kv] shape and odd lengths."""
  real = jax.nn.dot_product_attention

  def stand_in(query, key, value, *args, mask=None, implementation, **kw):
    assert query.shape[1] % 2 == 0 and key.shape[1] % 2 == 0, (query.shape, key.shape)
    assert mask is None or mask.shape[-2:] == (query.shape[1], key.shape[1]), mask.shape
    return real(query, key, value, *args, mask=mask, implementation='xla', **kw)

  monkeypatch.setattr(jax.nn, 'dot_product_attention', stand_in)
  spec = A.AttentionSpec(num_heads=4, in_features=8, num_kv_heads=2)
  params = make_params(spec, dtype=jnp.bfloat16)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(2, 3, length, 8)), jnp.bfloat16)
  shape = tuple(length if n is None else n for n in mask_shape)
  mask = rng.random(shape) < 0.7
  mask[1] = False  # the second example of each row sees no key at all
  call = functools.partial(
      A.multi_head_attention, params, x, spec=spec, mask=jnp.asarray(mask), is_causal=True
  )
  out = call(implementation='cudnn', platform='gpu').out
  expected = call(implementation='xla').out
  np.testing.assert_allclose(np.float32(out), np.float32(expected), atol=0.03, rtol=0.03)
  np.testing.assert_array_equal(np.float32(out[:, 1]), np.float32(expected[:, 1]))


@pytest.mark.parametrize(
    'options',
    [dict(num_kv_heads=1), dict(kind='collaborative', key_dim=64)],
    ids=['grouped_query', 'collaborative'],
)
def test_splash_kernel_in_interpret_mode(make_params, monkeypatch, options):
  """The TPU splash kernel run by Pallas' interpreter on CPU: checks our operands (head-major
  layout, grouped keys, collaborative as shared keys with one-hot bias columns) and gradients,
  not TPU compilation or speed."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

  monkeypatch.setattr(
      splash, 'make_splash_mha', functools.partial(splash.make_splash_mha, interpret=True)
  )
  spec = A.AttentionSpec(num_heads=2, in_features=128, **options)
  params = make_params(spec)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 128, 128)), jnp.float32)

  def loss(params, x, implementation):
    out = A.multi_head_attention(
        params, x, spec=spec, is_causal=True, implementation=implementation, platform='tpu'
    ).out
    return jnp.sum(jnp.sin(out)), out

  grad = jax.grad(loss, argnums=(0, 1), has_aux=True)
  expected_grads, expected = grad(params, x, 'xla')
  grads, out = grad(params, x, 'splash')
  np.testing.assert_allclose(out, expected, atol=5e-5, rtol=1e-4)
  for g, g_ref in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads), strict=True):
    np.testing.assert_allclose(g, g_ref, atol=2e-3, rtol=2e-3)
