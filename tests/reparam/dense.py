"""Dense float64 numpy references for the CP tests (independent of the code under test)."""

import numpy as np


def dense_tensor(query_kernel, key_kernel):
  """T `[D_q, heads, D_k]` with T[:, i] = W_Q^(i) W_K^(i)T, in float64."""
  return np.einsum('qhd,khd->qhk', np.asarray(query_kernel, np.float64),
                   np.asarray(key_kernel, np.float64))


def cp_tensor(query, mixing, key):
  """T^ `[D_q, heads, D_k]` with T^[:, i] = query diag(mixing[i]) key^T, in float64."""
  return np.einsum('qr,hr,kr->qhk', *(np.asarray(x, np.float64) for x in (query, mixing, key)))


def relative_error(tensor, approximation):
  return np.linalg.norm(tensor - approximation) / np.linalg.norm(tensor)


def random_kernels(d_q, d_k, heads, head_dim, seed=0):
  """Per-head float32 query and key kernels `[D, heads, head_dim]` at a trained layer's scale."""
  rng = np.random.default_rng(seed)
  return ((rng.standard_normal((d_q, heads, head_dim)) / np.sqrt(d_q)).astype(np.float32),
          (rng.standard_normal((d_k, heads, head_dim)) / np.sqrt(d_k)).astype(np.float32))


# One shape and rank for most tests: every new (shape, rank) compiles the ALS anew (seconds).
D_Q, D_K, HEADS, HEAD_DIM, RANK = 16, 12, 4, 4, 6
