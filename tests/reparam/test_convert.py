"""Conversions of a concat layer's parameters: collaborative (exact, then CP) and per-head SVD."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_attn import attention as A
from lowrank_attn.reparam import collaborative_factors, concat_to_collaborative, per_head_svd

from .dense import D_K, D_Q, HEAD_DIM, HEADS, RANK, dense_tensor, reference


def concat_spec(**options):
  return A.AttentionSpec(num_heads=HEADS, in_features=D_Q, in_kv_features=D_K, **options)


def random_params(spec, seed=0):
  """Every parameter random, biases included, so no term is trivially zero."""
  rng = np.random.default_rng(seed)
  return {
      name: jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[0]), jnp.float32)
      for name, shape in sorted(spec.param_shapes().items())
  }


def inputs(seed=1):
  rng = np.random.default_rng(seed)
  return (
      jnp.asarray(rng.standard_normal((2, 5, D_Q)), jnp.float32),
      jnp.asarray(rng.standard_normal((2, 7, D_K)), jnp.float32),
  )


def run(params, spec, x, y):
  return np.asarray(A.multi_head_attention(params, x, y, spec=spec).out)


def exact_content_bias(params):
  return np.einsum(
      'khd,hd->kh',
      np.asarray(params['key_kernel'], np.float64),
      np.asarray(params['query_bias'], np.float64),
  )


@pytest.mark.parametrize('use_bias', [True, False])
@pytest.mark.parametrize('key_dim', [None, HEADS * HEAD_DIM, HEADS * HEAD_DIM + 3])
def test_full_width_is_exact(use_bias, key_dim):
  spec = concat_spec(use_bias=use_bias)
  params = random_params(spec)
  new, new_spec, error = concat_to_collaborative(params, spec, key_dim, return_error=True)
  assert error == 0.0 and new_spec.kind == 'collaborative'
  assert new_spec.key_dim == (key_dim or 16) and new_spec.logit_scale == spec.logit_scale
  x, y = inputs()
  np.testing.assert_allclose(run(new, new_spec, x, y), run(params, spec, x, y), atol=1e-5)


def test_reduced_width_is_the_layer_built_from_the_factors():
  spec = concat_spec()
  params = random_params(spec)
  new, new_spec, error = concat_to_collaborative(params, spec, RANK, return_error=True)
  assert (new_spec.kind, new_spec.key_dim) == ('collaborative', RANK)
  assert new_spec.logit_scale == pytest.approx(1 / math.sqrt(HEAD_DIM))  # the original's
  factors = collaborative_factors(params['query_kernel'], params['key_kernel'], RANK)
  assert error == factors.relative_error and 0.05 < error < 1.0
  forms = np.einsum(
      'qr,hr,kr->qhk',
      *(
          np.asarray(f, np.float64)
          for f in (factors.query_kernel, factors.mixing, factors.key_kernel)
      ),
  )
  x, y = inputs()
  expected = reference(forms, exact_content_bias(params), params, spec.logit_scale, x, y)
  np.testing.assert_allclose(run(new, new_spec, x, y), expected, atol=1e-5)
  # ... and not the original layer: the truncation is visible in the outputs.
  original = reference(
      dense_tensor(params['query_kernel'], params['key_kernel']),
      exact_content_bias(params),
      params,
      spec.logit_scale,
      x,
      y,
  )
  np.testing.assert_allclose(run(params, spec, x, y), original, atol=1e-5)
  assert np.abs(run(new, new_spec, x, y) - original).max() > 1e-3


def test_content_bias_is_exact_at_reduced_width():
  """Zero query kernels leave only b_Q^(i) . (x_k W_K^(i) + b_K^(i)) in the logits: the
  reduced-width layer must match the original exactly through its content bias alone."""
  spec = concat_spec()
  params = random_params(spec)
  params['query_kernel'] = jnp.zeros_like(params['query_kernel'])
  new, new_spec, error = concat_to_collaborative(params, spec, RANK, return_error=True)
  assert error == 0.0 and 'key_bias' not in new
  # A float32 dot product of HEAD_DIM terms: off by at most (HEAD_DIM + 1) u sum|terms| (u =
  # 2^-24), whatever order the compiled code sums in; a relative tolerance fails on the
  # entries where the terms nearly cancel.
  magnitude = exact_content_bias({k: np.abs(np.asarray(v)) for k, v in params.items()})
  bound = (HEAD_DIM + 1) * 2.0**-24 * magnitude
  assert np.all(np.abs(new['content_bias'] - exact_content_bias(params)) <= bound)
  x, y = inputs()
  np.testing.assert_allclose(run(new, new_spec, x, y), run(params, spec, x, y), atol=1e-5)


def test_rescaled_logits_as_in_the_papers_code():
  """Their layer divides the logits by sqrt(dim_key_query_all / num_attention_heads)."""
  spec = concat_spec()
  params = random_params(spec)
  kept, kept_spec = concat_to_collaborative(params, spec, RANK)
  rescaled, rescaled_spec = concat_to_collaborative(params, spec, RANK, rescale_logits=True)
  assert rescaled_spec.logit_scale == pytest.approx(1 / math.sqrt(RANK / HEADS))
  assert rescaled_spec.logit_scale == pytest.approx(
      kept_spec.logit_scale * math.sqrt(HEADS * HEAD_DIM / RANK)
  )
  for name in kept:
    np.testing.assert_array_equal(rescaled[name], kept[name])
  # At full width both scales agree with the original.
  _, full_spec = concat_to_collaborative(params, spec, rescale_logits=True)
  assert full_spec.logit_scale == pytest.approx(spec.logit_scale)


def test_backwards_compatible_return():
  spec = concat_spec()
  params = random_params(spec)
  new, new_spec = concat_to_collaborative(params, spec)
  assert set(new) == set(new_spec.param_shapes())


def test_per_head_svd_at_full_rank_is_exact():
  spec = concat_spec()
  params = random_params(spec)
  new, new_spec = per_head_svd(params, spec, HEADS * HEAD_DIM)
  x, y = inputs()
  np.testing.assert_allclose(run(new, new_spec, x, y), run(params, spec, x, y), atol=1e-5)


@pytest.mark.parametrize('key_dim,ranks', [(8, [2, 2, 2, 2]), (6, [2, 1, 2, 1])])
def test_per_head_svd_truncates_each_head(key_dim, ranks):
  spec = concat_spec()
  params = random_params(spec)
  new, new_spec = per_head_svd(params, spec, key_dim)
  assert (new_spec.kind, new_spec.key_dim) == ('collaborative', key_dim)
  assert new_spec.logit_scale == spec.logit_scale
  # Eckart-Young in numpy: each dense T_i cut to its share of the key width.
  forms = dense_tensor(params['query_kernel'], params['key_kernel'])
  truncated = np.empty_like(forms)
  for i, rank in enumerate(ranks):
    u, s, vt = np.linalg.svd(forms[:, i])
    truncated[:, i] = (u[:, :rank] * s[:rank]) @ vt[:rank]
  ours = np.einsum(
      'qr,hr,kr->qhk',
      *(np.asarray(new[n], np.float64) for n in ('query_kernel', 'mixing', 'key_kernel')),
  )
  np.testing.assert_allclose(ours, truncated, atol=1e-5)
  x, y = inputs()
  expected = reference(truncated, exact_content_bias(params), params, spec.logit_scale, x, y)
  np.testing.assert_allclose(run(new, new_spec, x, y), expected, atol=1e-5)


def test_bad_layers_and_widths():
  spec = concat_spec()
  params = random_params(spec)
  collaborative, collaborative_spec = concat_to_collaborative(params, spec)
  with pytest.raises(ValueError, match="kind='collaborative'"):
    concat_to_collaborative(collaborative, collaborative_spec)
  with pytest.raises(ValueError, match='normalize_qk'):
    per_head_svd(params, concat_spec(normalize_qk=True), 8)
  for key_dim in (3, 17):
    with pytest.raises(ValueError, match=f'key_dim={key_dim}'):
      per_head_svd(params, spec, key_dim)
