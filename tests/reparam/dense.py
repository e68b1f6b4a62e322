"""Dense float64 numpy references for the CP tests (independent of the code under test)."""

import numpy as np


def dense_tensor(query_kernel, key_kernel):
  """T `[D_q, heads, D_k]` with T[:, i] = W_Q^(i) W_K^(i)T, in float64."""
  return np.einsum(
      'qhd,khd->qhk', np.asarray(query_kernel, np.float64), np.asarray(key_kernel, np.float64)
  )


def cp_tensor(query, mixing, key):
  """T^ `[D_q, heads, D_k]` with T^[:, i] = query diag(mixing[i]) key^T, in float64."""
  return np.einsum('qr,hr,kr->qhk', *(np.asarray(x, np.float64) for x in (query, mixing, key)))


def relative_error(tensor, approximation):
  return np.linalg.norm(tensor - approximation) / np.linalg.norm(tensor)


def random_kernels(d_q, d_k, heads, head_dim, seed=0):
  """Per-head float32 query and key kernels `[D, heads, head_dim]` at a trained layer's scale."""
  rng = np.random.default_rng(seed)
  return (
      (rng.standard_normal((d_q, heads, head_dim)) / np.sqrt(d_q)).astype(np.float32),
      (rng.standard_normal((d_k, heads, head_dim)) / np.sqrt(d_k)).astype(np.float32),
  )


def reference(forms, content_bias, params, scale, x, y):
  """The layer in float64 numpy from per-head bilinear forms `[D_q, h, D_k]` and the content
  bias `[D_k, h]`: logits_i = scale (x_q T_i x_k^T + 1 (x_k c_i)^T); values and output of
  `params` (a concat layer's)."""
  f64 = lambda a: np.asarray(a, np.float64)
  x, y = f64(x), f64(y)
  logits = np.einsum('bnq,qhk,bmk->bhnm', x, f64(forms), y)
  logits = scale * (logits + np.einsum('bmk,kh->bhm', y, f64(content_bias))[:, :, None, :])
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  values = np.einsum('bmk,khd->bmhd', y, f64(params['value_kernel'])) + f64(params['value_bias'])
  heads = np.einsum('bhnm,bmhd->bnhd', weights, values)
  return np.einsum('bnhd,hde->bne', heads, f64(params['out_kernel'])) + f64(params['out_bias'])


# One shape and rank for most tests: every new (shape, rank) compiles the ALS anew (seconds).
D_Q, D_K, HEADS, HEAD_DIM, RANK = 16, 12, 4, 4, 6
