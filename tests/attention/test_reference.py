"""Every kind at generic settings against the numpy formulas of `numpy_reference.py`.

Generic means no setting that hides a mistake: head sizes other than D/h, a reduced collaborative
width with random mixing and content bias, talking heads with non-identity mixing and per-head
masks, grouped keys, half-open gates, fully masked rows, cross attention with other lengths
and widths. Both the kernel and the NNX layer are checked.
"""

import jax
import numpy as np
import pytest
from flax import nnx

from lowrank_attn import attention as A
from lowrank_attn import nn as lnn

BATCH, Q_LEN, KV_LEN = 2, 5, 7

# Settings passed as keywords to both AttentionSpec and nn.MultiHeadAttention.
CASES = {
    'concat': dict(kind='concat', num_heads=3, in_features=12),
    'fixed_head': dict(kind='fixed_head', num_heads=3, in_features=12, head_dim=5),
    'fixed_head_cross': dict(
        kind='fixed_head',
        num_heads=3,
        in_features=12,
        head_dim=5,
        in_kv_features=10,
        out_features=9,
    ),
    'collaborative': dict(kind='collaborative', num_heads=3, in_features=12, key_dim=7),
    'collaborative_cross': dict(
        kind='collaborative',
        num_heads=3,
        in_features=12,
        key_dim=7,
        in_kv_features=10,
        out_features=9,
        head_dim=5,
    ),
    'collaborative_no_bias': dict(
        kind='collaborative', num_heads=3, in_features=12, key_dim=7, use_bias=False
    ),
    'talking_heads': dict(kind='talking_heads', num_heads=4, in_features=12),
    'talking_heads_cross': dict(
        kind='talking_heads',
        num_heads=4,
        in_features=12,
        head_dim=5,
        in_kv_features=10,
        out_features=9,
    ),
    'grouped_query': dict(kind='concat', num_heads=4, in_features=12, num_kv_heads=2),
    'grouped_query_fixed_head': dict(
        kind='fixed_head',
        num_heads=6,
        in_features=12,
        head_dim=5,
        num_kv_heads=2,
        in_kv_features=10,
    ),
    'normalize_qk': dict(
        kind='fixed_head', num_heads=3, in_features=12, head_dim=5, normalize_qk=True
    ),
    'gated_concat': dict(kind='concat', num_heads=3, in_features=12, gated=True),
    'gated_fixed_head': dict(
        kind='fixed_head', num_heads=3, in_features=12, head_dim=5, gated=True
    ),
    'gated_collaborative': dict(
        kind='collaborative', num_heads=3, in_features=12, key_dim=7, gated=True
    ),
    'gated_talking_heads': dict(
        kind='talking_heads', num_heads=4, in_features=12, gated=True, in_kv_features=10
    ),
}


def is_cross(settings):
  """Attention over another sequence (7 keys for 5 queries); talking heads always."""
  return 'in_kv_features' in settings or settings['kind'] == 'talking_heads'


def make_case(name, make_params, seed=0):
  """(settings, params, x, y or None, mask) with nothing left at a convenient value."""
  settings = CASES[name]
  spec = A.AttentionSpec(**settings)
  params = {k: np.asarray(v) for k, v in make_params(spec, seed).items()}
  rng = np.random.default_rng(seed + 100)
  h = settings['num_heads']
  if 'gate_log_alpha' in params:
    # |log alpha| < log(11): every evaluation gate strictly between 0 and 1.
    params['gate_log_alpha'] = rng.uniform(-2.0, 2.0, h).astype(np.float32)
  for param in ('pre_softmax_mixing', 'post_softmax_mixing'):
    if param in params:  # far from the identity, where talking heads equals concat
      params[param] = rng.standard_normal((h, h)).astype(np.float32)
  for param in ('query_ln_scale', 'key_ln_scale'):
    if param in params:
      params[param] = rng.uniform(0.5, 1.5, params[param].shape).astype(np.float32)
  x = rng.standard_normal((BATCH, Q_LEN, settings['in_features'])).astype(np.float32)
  y = None
  kv_len = Q_LEN
  if is_cross(settings):
    kv_len = KV_LEN
    y = rng.standard_normal(
        (BATCH, KV_LEN, settings.get('in_kv_features', settings['in_features']))
    )
    y = y.astype(np.float32)
  # Per-head masks for talking heads (their mixing moves weight between heads), else shared.
  mask_heads = h if settings['kind'] == 'talking_heads' else 1
  mask = rng.random((BATCH, mask_heads, Q_LEN, kv_len)) < 0.6
  mask[:, :, :, 0] = True
  mask[0, :, 1, :] = False  # a query that sees nothing: zeros, never NaN
  mask[1, -1, 3, :] = False
  return settings, params, x, y, mask


def options(settings, mask, head_mask=None):
  """The numpy formulas' keyword arguments for a case."""
  normalize_qk = settings.get('normalize_qk', False)
  return dict(kind=settings['kind'], mask=mask, head_mask=head_mask, normalize_qk=normalize_qk)


def reference(numpy_reference, settings, params, x, y, mask, head_mask=None):
  """The numpy formulas' (out, weights)."""
  return numpy_reference.attention(params, x, y, **options(settings, mask, head_mask))


def tolerance(numpy_reference, settings, params, x, y, mask, head_mask=None):
  """How far a float32 evaluation may be from `reference` (out, weights), measured on it."""
  return numpy_reference.float32_tolerance(params, x, y, **options(settings, mask, head_mask))


@pytest.mark.parametrize('name', CASES)
def test_kernel_equals_the_numpy_formulas(name, make_params, numpy_reference):
  settings, params, x, y, mask = make_case(name, make_params)
  spec = A.AttentionSpec(**settings)
  result = jax.jit(
      lambda p, x, y, mask: A.multi_head_attention(
          p, x, y, spec=spec, mask=mask, return_weights=True
      )
  )(params, x, y, mask)
  expected_out, expected_weights = reference(numpy_reference, settings, params, x, y, mask)
  out_tol, weight_tol = tolerance(numpy_reference, settings, params, x, y, mask)
  assert np.all(np.isfinite(result.out))
  numpy_reference.assert_within(result.weights, expected_weights, weight_tol)
  numpy_reference.assert_within(result.out, expected_out, out_tol)
  # No weight on a hidden key, none at all in a row that sees nothing.
  hidden = ~np.broadcast_to(mask, result.weights.shape)
  assert np.all(np.asarray(result.weights)[hidden] == 0.0)


@pytest.mark.parametrize(
    'name',
    ['fixed_head_cross', 'collaborative_cross', 'gated_talking_heads', 'grouped_query_fixed_head'],
)
def test_nnx_layer_equals_the_numpy_formulas(name, make_params, numpy_reference):
  settings, params, x, y, mask = make_case(name, make_params, seed=1)
  layer = lnn.MultiHeadAttention(**settings, deterministic=True, rngs=nnx.Rngs(0))
  for param_name, value in params.items():
    getattr(layer, param_name)[...] = value
  head_mask = np.random.default_rng(2).uniform(0.2, 1.5, settings['num_heads'])
  head_mask = head_mask.astype(np.float32)
  out, weights = layer(x, y, mask=mask, head_mask=head_mask, return_weights=True)
  expected_out, expected_weights = reference(
      numpy_reference, settings, params, x, y, mask, head_mask
  )
  out_tol, weight_tol = tolerance(numpy_reference, settings, params, x, y, mask, head_mask)
  numpy_reference.assert_within(weights, expected_weights, weight_tol)
  numpy_reference.assert_within(out, expected_out, out_tol)


def test_talking_heads_reference_moves_weight_between_differently_masked_heads(
    make_params, numpy_reference
):
  """The case is strong enough to matter: without re-masking, the post-softmax mix would put
  much of the weight on keys a head must not see."""
  settings, params, x, y, mask = make_case('talking_heads', make_params)
  _, weights = reference(numpy_reference, settings, params, x, y, mask)
  visible_only = numpy_reference.masked_softmax(np.zeros(mask.shape), mask)  # any weights
  leaked = np.einsum('bhqk,hg->bgqk', visible_only, params['post_softmax_mixing'])
  assert np.abs(leaked[~mask]).max() > 0.1  # what re-masking removes
  assert np.all(weights[~mask] == 0.0)


def test_gates_of_the_gated_cases_are_half_open(make_params, numpy_reference):
  for name in ('gated_concat', 'gated_collaborative', 'gated_talking_heads'):
    _, params, *_ = make_case(name, make_params)
    gates = numpy_reference.hard_concrete_eval(params['gate_log_alpha'])
    assert np.all((gates > 0.0) & (gates < 1.0)), (name, gates)


# ------------------------------------------------ cached decoding with a mask; segment masks

SELF_CASES = {
    'concat': dict(kind='concat', num_heads=3, in_features=12),
    'collaborative': dict(kind='collaborative', num_heads=3, in_features=12, key_dim=7),
    'talking_heads': dict(kind='talking_heads', num_heads=4, in_features=12),
}


@pytest.mark.parametrize('mask_kind', ['padding', 'boolean', 'int'])
@pytest.mark.parametrize('name', SELF_CASES)
def test_cached_decoding_with_a_mask_equals_the_numpy_formulas(
    name, mask_kind, make_params, numpy_reference
):
  """One position per step through the cache, with a mask over the cache's keys: a key
  padding mask `[batch, 1, 1, max_length]`, or a per-query boolean (or 0/1 int) one sliced
  to the step's query. The reference: the full pass with that mask AND causality."""
  settings = SELF_CASES[name]
  spec = A.AttentionSpec(**settings)
  params = {k: np.asarray(v) for k, v in make_params(spec, 3).items()}
  rng = np.random.default_rng(4)
  x = rng.standard_normal((BATCH, Q_LEN, 12)).astype(np.float32)
  if mask_kind == 'padding':  # row 0: keys 1 and 3 are padding (a left-padded prefix, a hole)
    mask = np.ones((BATCH, 1, 1, Q_LEN), bool)
    mask[0, :, :, [1, 3]] = False
  else:
    mask = rng.random((BATCH, 1, Q_LEN, Q_LEN)) < 0.6
    mask[0, :, 2, :] = False  # a query that sees nothing
  full_mask = mask & np.tril(np.ones((Q_LEN, Q_LEN), bool))
  expected, _ = reference(numpy_reference, settings, params, x, None, full_mask)
  step = jax.jit(
      lambda cache, x, mask: A.multi_head_attention(params, x, spec=spec, cache=cache, mask=mask)
  )
  cache = A.init_cache(spec, (BATCH,), Q_LEN)
  outs = []
  for t in range(Q_LEN):
    step_mask = mask if mask_kind == 'padding' else mask[:, :, t : t + 1]
    result = step(
        cache, x[:, t : t + 1], step_mask.astype(np.int32) if mask_kind == 'int' else step_mask
    )
    outs.append(result.out)
    cache = result.cache
  out_tol, _ = tolerance(numpy_reference, settings, params, x, None, full_mask)
  numpy_reference.assert_within(np.concatenate(outs, 1), expected, out_tol)


@pytest.mark.parametrize('implementation', ['xla', 'blockwise'])
def test_segment_ids_hide_padding_keys_from_every_query(
    implementation, make_params, numpy_reference
):
  """Segment ids against a mask written by hand: a query sees the keys of its own segment,
  and no query sees a padding key (segment 0), padding queries included (they see nothing)."""
  settings = CASES['concat']
  spec = A.AttentionSpec(**settings)
  params = {k: np.asarray(v) for k, v in make_params(spec, 5).items()}
  x = np.random.default_rng(6).standard_normal((BATCH, Q_LEN, 12)).astype(np.float32)
  segments = np.array([[1, 1, 2, 0, 0], [0, 1, 1, 1, 0]], np.int32)
  visible = np.zeros((BATCH, 1, Q_LEN, Q_LEN), bool)
  for b in range(BATCH):
    for i in range(Q_LEN):
      for j in range(Q_LEN):
        visible[b, 0, i, j] = segments[b, i] == segments[b, j] != 0
  expected, _ = reference(numpy_reference, settings, params, x, None, visible)
  out = jax.jit(
      lambda p, x, s: A.multi_head_attention(
          p, x, spec=spec, segment_ids=(s, s), implementation=implementation, block_size=2
      )
  )(params, x, segments).out
  # Blockwise rescales its running softmax once per key block: a few roundings more, inside
  # the tolerance's factor at these 3 blocks.
  out_tol, _ = tolerance(numpy_reference, settings, params, x, None, visible)
  numpy_reference.assert_within(out, expected, out_tol)
  # A padding query outputs the output bias alone.
  np.testing.assert_allclose(
      np.asarray(out)[segments == 0], np.broadcast_to(params['out_bias'], (4, 12)), atol=1e-6
  )
