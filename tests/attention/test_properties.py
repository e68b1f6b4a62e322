"""Property tests over random shapes: the equivalences between kinds hold everywhere."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from lowrank_attn import attention as A
from lowrank_attn.reparam import concat_to_collaborative

SETTINGS = settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@st.composite
def shapes(draw):
  heads = draw(st.integers(1, 4))
  head_dim = draw(st.integers(1, 6))
  return dict(
      heads=heads,
      head_dim=head_dim,
      in_features=draw(st.integers(1, 12)),
      in_kv_features=draw(st.integers(1, 12)),
      out_features=draw(st.integers(1, 9)),
      batch=draw(st.integers(1, 3)),
      q_length=draw(st.integers(1, 7)),
      kv_length=draw(st.integers(1, 7)),
      use_bias=draw(st.booleans()),
      seed=draw(st.integers(0, 2**16)),
  )


def build(s, **options):
  spec = A.AttentionSpec(
      num_heads=s['heads'],
      in_features=s['in_features'],
      in_kv_features=s['in_kv_features'],
      out_features=s['out_features'],
      use_bias=s['use_bias'],
      **options
  )
  rng = np.random.default_rng(s['seed'])
  x = rng.standard_normal((s['batch'], s['q_length'], s['in_features']), np.float32)
  y = rng.standard_normal((s['batch'], s['kv_length'], s['in_kv_features']), np.float32)
  mask = rng.random((s['batch'], 1, s['q_length'], s['kv_length'])) < 0.8
  return spec, x, y, mask


@functools.partial(jax.jit, static_argnums=1)  # one compilation per example, not one per op
def out(params, spec, x, y, mask):
  return A.multi_head_attention(params, x, y, spec=spec, mask=mask).out


@SETTINGS
@given(shapes())
def test_collaborative_concatenate_full_width_equals_concat(make_params, s):
  concat, x, y, mask = build(s, qkv_features=s['heads'] * s['head_dim'])
  params = make_params(concat, s['seed'])
  collab_params, collab = concat_to_collaborative(params, concat)
  np.testing.assert_allclose(
      out(collab_params, collab, x, y, mask), out(params, concat, x, y, mask), atol=3e-5, rtol=1e-4
  )


@SETTINGS
@given(shapes(), st.sampled_from(['concat', 'collaborative', 'talking_heads']))
@example(
    s={
        'heads': 3,
        'head_dim': 6,
        'in_features': 1,
        'in_kv_features': 1,
        'out_features': 1,
        'batch': 1,
        'q_length': 1,
        'kv_length': 1,
        'use_bias': False,
        'seed': 2,
    },
    kind='concat',
)  # 1 ulp apart: the two programs round differently
def test_gated_with_open_gates_equals_base_kind(make_params, numpy_reference, s, kind):
  base, x, y, mask = build(s, kind=kind, qkv_features=s['heads'] * s['head_dim'])
  params = make_params(base, s['seed'])
  gated = dataclasses.replace(base, gated=True)
  open_gates = {**params, 'gate_log_alpha': jnp.full((s['heads'],), 2.5)}
  # The gates are exactly 1, but the two programs may fuse the output projection differently:
  # equal up to float32 rounding, measured on this computation (a gate off by 1e-3 is far
  # outside it).
  limit = numpy_reference.float32_tolerance(params, x, y, kind=kind, mask=mask)[0]
  numpy_reference.assert_within(
      out(open_gates, gated, x, y, mask), out(params, base, x, y, mask), limit
  )


@SETTINGS
@given(shapes())
def test_talking_heads_with_identity_mixing_equals_concat(make_params, s):
  concat, x, y, mask = build(s, qkv_features=s['heads'] * s['head_dim'])
  params = make_params(concat, s['seed'])
  talking = dataclasses.replace(concat, kind='talking_heads')
  eye = jnp.eye(s['heads'])
  np.testing.assert_allclose(
      out({**params, 'pre_softmax_mixing': eye, 'post_softmax_mixing': eye}, talking, x, y, mask),
      out(params, concat, x, y, mask),
      atol=1e-6,
  )


@SETTINGS
@given(shapes(), st.sampled_from(['concat', 'collaborative', 'talking_heads']))
def test_decoding_equals_full_causal_pass(make_params, s, kind):
  s = {**s, 'in_kv_features': s['in_features']}  # self-attention
  spec, x, _, _ = build(s, kind=kind, qkv_features=s['heads'] * s['head_dim'])
  params = make_params(spec, s['seed'])
  full = A.multi_head_attention(params, x, spec=spec, is_causal=True).out
  decode = jax.jit(lambda cache, x: A.multi_head_attention(params, x, spec=spec, cache=cache))
  cache = A.init_cache(spec, (s['batch'],), s['q_length'])
  steps = []
  for t in range(s['q_length']):
    result = decode(cache, x[:, t : t + 1])
    steps.append(result.out)
    cache = result.cache
  np.testing.assert_allclose(jnp.concatenate(steps, 1), full, atol=1e-5, rtol=1e-5)
