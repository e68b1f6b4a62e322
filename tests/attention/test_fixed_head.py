"""fixed_head (Bhojanapalli et al. 2020) against its formula, at head sizes D/h and others.

Replaces three tests that compared fixed_head at d = D/h with concat: both run the same code
there, so they agreed whatever that code computed. Here the kernel meets the formula, written
below from the parameter arrays in numpy (float64, no lowrank_attn code).
"""

import math

import jax
import numpy as np
import pytest

from lowrank_attn import attention as A


def fixed_head_formula(params, x, y, mask):
  """Bhojanapalli et al. (2020), sec. 3: head i is softmax(Q_i K_i^T / sqrt(d_p)) V_i with
  Q_i = X W_Q^i + b_Q^i (likewise K_i, V_i from Y), d_p the head size chosen freely; the
  output is sum_i head_i W_O^i + b_O. A row that sees no key gives zeros."""
  p = {name: np.asarray(value, np.float64) for name, value in params.items()}
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  q = np.einsum('bqe,ehd->bhqd', x, p['query_kernel']) + p['query_bias'][:, None]
  k = np.einsum('bke,ehd->bhkd', y, p['key_kernel']) + p['key_bias'][:, None]
  v = np.einsum('bke,ehd->bhkd', y, p['value_kernel']) + p['value_bias'][:, None]
  logits = np.einsum('bhqd,bhkd->bhqk', q, k) / math.sqrt(q.shape[-1])
  logits = np.where(mask, logits, -np.inf)
  top = np.max(logits, -1, keepdims=True)
  e = np.where(mask, np.exp(logits - np.where(np.isfinite(top), top, 0.0)), 0.0)
  weights = e / np.maximum(e.sum(-1, keepdims=True), np.finfo(np.float64).tiny)
  heads = np.einsum('bhqk,bhkd->bhqd', weights, v)
  return np.einsum('bhqd,hde->bqe', heads, p['out_kernel']) + p['out_bias']


# (heads, D, head_dim): d_p = D/h (where concat has the same parameters), below and above it.
SIZES = [(4, 16, 4), (4, 16, 3), (4, 16, 12), (1, 8, 8), (3, 12, 20)]


@pytest.mark.parametrize(
    'heads,features,head_dim', SIZES, ids=[f'h{h}-D{e}-d{d}' for h, e, d in SIZES]
)
@pytest.mark.parametrize('cross', [False, True], ids=['self', 'cross'])
def test_fixed_head_is_its_formula(make_params, heads, features, head_dim, cross):
  kv_features, out_features = (10, 9) if cross else (features, features)
  spec = A.AttentionSpec(
      num_heads=heads,
      in_features=features,
      in_kv_features=kv_features,
      out_features=out_features,
      kind='fixed_head',
      head_dim=head_dim,
  )
  params = {k: np.asarray(v) for k, v in make_params(spec, seed=head_dim).items()}
  assert params['query_kernel'].shape == (features, heads, head_dim)
  rng = np.random.default_rng(head_dim)
  kv_length = 7 if cross else 5
  x = rng.standard_normal((2, 5, features)).astype(np.float32)
  y = rng.standard_normal((2, kv_length, kv_features)).astype(np.float32) if cross else x
  mask = rng.random((2, 1, 5, kv_length)) < 0.6
  mask[0, :, 1, :] = False  # a query that sees nothing
  out = jax.jit(lambda p, x, y, m: A.multi_head_attention(p, x, y, spec=spec, mask=m).out)(
      params, x, y, mask
  )
  np.testing.assert_allclose(out, fixed_head_formula(params, x, y, mask), rtol=1e-5, atol=1e-5)
