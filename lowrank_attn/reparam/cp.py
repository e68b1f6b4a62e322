"""CP decomposition of a layer's stacked per-head bilinear forms, from its factors.

Head i of a concat layer computes the logits x_q T_i x_k^T with T_i = W_Q^(i) W_K^(i)T. A
collaborative layer computes x_q W~_Q diag(m_i) W~_K^T x_k^T: its shared projections and mixing
are a rank-`key_dim` CP decomposition of the tensor T `[D_q, heads, D_k]` (Cordonnier et al.
2020, re-parametrization of pre-trained layers). The paper's code runs tensorly's `parafac` on
the dense T. Here every step of the alternating least squares (ALS, Kolda & Bader 2009,
sec. 3.4) is computed from the per-head factors instead: T is never formed, and a sweep costs
O(h d R (h d + R)) instead of O(D_q h D_k R).

Coordinates: every ALS update of W~_Q lies in the span of the stacked per-head query kernels
W_Q = [W_Q^(1) ... W_Q^(h)] `[D_q, h d]`, so W~_Q = W_Q X_Q with coefficients X_Q `[h d, R]`,
and likewise W~_K = W_K X_K. T enters only through the Gram matrices G_Q = W_Q^T W_Q and G_K.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_attn.attention import concatenate_mixing

Array = jax.Array

# With several starts, all run this many sweeps; only the best goes on.
SCREEN_SWEEPS = 10
# Relative error below which iterating stops: float32 factors cannot represent T better.
ERROR_FLOOR = 1e-6
# Extrapolation ("line search") of Bro (1998) as in tensorly's parafac: after a sweep, try
# old + jump * (new - old) with jump = k^(1 / power); after MAX_FAILS rejections in a row,
# power grows by one (shorter jumps).
FIRST_JUMP_AT = 3
MAX_FAILS = 4


class CollaborativeFactors(NamedTuple):
  """A rank-`key_dim` CP decomposition of T_i = W_Q^(i) W_K^(i)T, i = 1..heads.

  T_i ~ query_kernel diag(mixing[i]) key_kernel^T. Columns are sorted by decreasing weight
  |a_r| |b_r| |m_r|; each mixing column has unit norm and a positive largest entry, and its
  query and key columns have equal norms.
  """

  query_kernel: Array  # [D_q, key_dim]
  key_kernel: Array  # [D_k, key_dim]
  mixing: Array  # [heads, key_dim]
  relative_error: float  # |T - T^|_F / |T|_F of the returned factors, computed in float64
  num_iterations: int  # ALS sweeps from the returned start
  error_history: np.ndarray  # after 0, check_every, 2 check_every, ... sweeps (last: all)


def collaborative_factors(
    query_kernel,
    key_kernel,
    key_dim: int,
    *,
    num_iterations: int = 100,
    tol: float = 1e-5,
    num_starts: int = 4,
    check_every: int = 10,
    seed: int = 0,
) -> CollaborativeFactors:
  """CP-decompose the per-head bilinear forms W_Q^(i) W_K^(i)T of a concat layer.

  Args:
    query_kernel: `[D_q, heads, head_dim]`, W_Q^(i) = query_kernel[:, i].
    key_kernel: `[D_k, heads, head_dim]` (D_k may differ from D_q: cross attention).
    key_dim: R, the rank (the collaborative layer's shared key width). From heads * head_dim
      on, the block one-hot (concatenated heads) solution is exact and is returned directly.
    num_iterations: at most this many ALS sweeps.
    tol: stop once the relative error decreases by less than a fraction `tol` per sweep,
      averaged over the last `check_every` sweeps (errors compared in float64).
    num_starts: ALS has local minima, whose errors differ by about 1% on trained layers:
      start from the SVD initialisation and num_starts - 1 of tensorly's (random in part),
      run each SCREEN_SWEEPS sweeps, and go on with the best.
    check_every: sweeps between the float64 error evaluations that are recorded in
      `error_history` and tested for convergence (each costs about 3 float32 sweeps).
    seed: for the random parts of the starts.

  Starts: (1) the leading left singular vectors of T's query-side and key-side unfoldings
  (what tensorly's init='svd' gives those modes, computed from the factors), then the mixing
  that is optimal for them; (2) tensorly's init='svd' itself: the key-side vectors, and for the
  mixing the head-mode singular vectors completed by U[0, 1) columns, then the best queries.
  Sweeps update mixing, queries and keys, each by exact least squares, then try an
  extrapolation (Bro 1998, as tensorly's line search) kept only if it lowers the error.

  Precision: sweeps run in float32, under a local `jax.enable_x64` context for float64 where
  float32 fails: the Cholesky factors of the normal equations (their condition number is the
  square of the factors'), and the errors used to stop, record and report, which subtract
  numbers of size |T|^2 (in float32 their noise, ~1e-6 |T|^2, exceeds tol * error once errors
  fall below ~0.3). On XLA:CPU a float64 sweep costs about 3x a float32 one.
  """
  query_kernel, key_kernel = np.asarray(query_kernel), np.asarray(key_kernel)
  _check_arguments(query_kernel, key_kernel, key_dim, num_iterations, tol, num_starts, check_every)
  dtype = jnp.result_type(query_kernel, key_kernel)
  dq, h, d = query_kernel.shape
  if key_dim >= h * d:
    return _exact_factors(query_kernel, key_kernel, key_dim, dtype)
  # |T|^2 = sum_i tr(W_Q^(i)T W_Q^(i) W_K^(i)T W_K^(i)), in float64 numpy: T = 0 has no
  # relative error to minimise.
  wq64, wk64 = query_kernel.astype(np.float64), key_kernel.astype(np.float64)
  norm2 = np.sum(np.einsum('qhd,qhe->hde', wq64, wq64) * np.einsum('khd,khe->hde', wk64, wk64))
  if norm2 == 0.0:
    zeros = lambda n: jnp.zeros((n, key_dim), dtype)
    return CollaborativeFactors(
        zeros(dq), zeros(key_kernel.shape[0]), zeros(h), 0.0, 0, np.zeros(1)
    )
  with jax.enable_x64(True):
    q, k, m, history, sweeps, error = _decompose(
        jnp.asarray(query_kernel),
        jnp.asarray(key_kernel),
        jax.random.key(seed),
        tol,
        rank=key_dim,
        num_iterations=num_iterations,
        num_starts=num_starts,
        check_every=check_every,
        dtype=dtype,
    )
    num_checks = -(-int(sweeps) // check_every) + 1
    history = np.asarray(history)[:num_checks]
    return CollaborativeFactors(q, k, m, float(error), int(sweeps), history)


def _check_arguments(
    query_kernel, key_kernel, key_dim, num_iterations, tol, num_starts, check_every
):
  if query_kernel.ndim != 3 or key_kernel.ndim != 3:
    raise ValueError(
        f'query_kernel {query_kernel.shape} and key_kernel {key_kernel.shape} must '
        'be [D, heads, head_dim].'
    )
  if query_kernel.shape[1:] != key_kernel.shape[1:]:
    raise ValueError(
        f'query_kernel {query_kernel.shape} and key_kernel {key_kernel.shape} must '
        'have the same heads and head_dim.'
    )
  for name, value in (
      ('key_dim', key_dim),
      ('num_iterations', num_iterations),
      ('num_starts', num_starts),
      ('check_every', check_every),
  ):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
      raise ValueError(f'{name}={value!r} must be an integer >= 1.')
  if not tol >= 0:
    raise ValueError(f'tol={tol!r} must be >= 0.')


def _exact_factors(query_kernel, key_kernel, key_dim, dtype) -> CollaborativeFactors:
  """Concatenated heads, block one-hot mixing (Cordonnier et al. 2020, sec. 3.1), zero-padded.

  Padding columns are zero in all three factors: they add nothing, and, being a saddle point
  of the logits in (query, key, mixing), also stay zero under gradient descent.
  """
  dq, h, d = query_kernel.shape
  pad = lambda x: jnp.pad(jnp.asarray(x, dtype), ((0, 0), (0, key_dim - h * d)))
  return CollaborativeFactors(
      query_kernel=pad(query_kernel.reshape(dq, h * d)),
      key_kernel=pad(key_kernel.reshape(key_kernel.shape[0], h * d)),
      mixing=pad(concatenate_mixing(h, h * d, dtype)),
      relative_error=0.0,
      num_iterations=0,
      error_history=np.zeros(1),
  )


# --------------------------------------------------------------------------- ALS internals


class _State(NamedTuple):
  """Factors in coefficient form and the products every update needs."""

  x_q: Array  # [h d, R]: W~_Q = W_Q x_q
  x_k: Array  # [h d, R]
  mixing: Array  # [h, R]
  p_q: Array  # [h d, R]: W_Q^T W~_Q = G_Q x_q, i.e. W_Q^(i)T a_r for every head and column
  p_k: Array  # [h d, R]
  gram_q: Array  # [R, R]: W~_Q^T W~_Q = x_q^T p_q
  gram_k: Array  # [R, R]


def _solve_normal(gram: Array, rhs: Array) -> Array:
  """x with x gram = rhs: the normal equations of an ALS update (Kolda & Bader 2009, sec. 3.4).

  gram `[R, R]` is a Hadamard product of Gram matrices, positive semi-definite. Its Cholesky
  factor L is computed in float64 (gram's condition number is the square of the factors');
  then, in rhs's dtype, x = rhs L^-T L^-1: on XLA:CPU one triangular inverse and two matrix
  products take a third of the time of two triangular solves with h d right-hand sides. The
  tiny ridge keeps dead (all-zero) components from making the factorization fail.
  """
  gram = gram.astype(jnp.float64)
  ridge = 1e-12 * jnp.trace(gram) / gram.shape[0] + jnp.finfo(jnp.float64).tiny
  chol = jnp.linalg.cholesky(gram + ridge * jnp.eye(gram.shape[0], dtype=gram.dtype))
  chol = chol.astype(rhs.dtype)
  chol_inv = jax.lax.linalg.triangular_solve(
      chol, jnp.eye(chol.shape[0], dtype=chol.dtype), left_side=True, lower=True
  )
  return rhs @ (chol_inv.T @ chol_inv)


def _mixing_rhs(p_q: Array, p_k: Array, h: int) -> Array:
  """`[h, R]`: a_r^T T_i b_r = sum_d (W_Q^(i)T a_r)_d (W_K^(i)T b_r)_d, the heads-mode MTTKRP."""
  rank = p_q.shape[-1]
  return jnp.einsum('hdr,hdr->hr', p_q.reshape(h, -1, rank), p_k.reshape(h, -1, rank))


def _per_row(mixing: Array, d: int) -> Array:
  """`[h d, R]`: mixing[i] repeated for each of head i's d rows."""
  return jnp.repeat(mixing, d, axis=0)


def _sum64(x: Array) -> Array:
  return jnp.sum(x.astype(jnp.float64))


def _squared_error(state: _State, norm2: Array, h: int) -> Array:
  """|T - T^|^2 = |T|^2 - 2 <T, T^> + |T^|^2, all from the factors."""
  inner = _sum64(state.mixing * _mixing_rhs(state.p_q, state.p_k, h))
  model = _sum64(state.gram_q * state.gram_k * (state.mixing.T @ state.mixing))
  return norm2 - 2.0 * inner + model


def _with_products(x_q, x_k, mixing, g_q, g_k) -> _State:
  p_q, p_k = g_q @ x_q, g_k @ x_k
  return _State(x_q, x_k, mixing, p_q, p_k, x_q.T @ p_q, x_k.T @ p_k)


def _relative_error64(state: _State, g_q64, g_k64, norm2, h) -> Array:
  """The relative error of a state, recomputed in float64 from its coefficients."""
  cast = lambda x: x.astype(jnp.float64)
  state64 = _with_products(cast(state.x_q), cast(state.x_k), cast(state.mixing), g_q64, g_k64)
  return jnp.sqrt(jnp.maximum(_squared_error(state64, norm2, h), 0.0) / norm2)


def _sweep(state: _State, g_q, g_k, norm2, h, d) -> tuple[_State, Array]:
  """One ALS sweep (mixing, queries, keys), each the exact least-squares update given the rest.

  Query update: W~_Q = T_(1) (M (.) W~_K) V^-1 (Kolda & Bader 2009, sec. 3.4), where column r of
  the MTTKRP is sum_i m_ir W_Q^(i) W_K^(i)T b_r = W_Q (p_k * m)_r: in coefficients,
  x_q = (p_k * m) V^-1 with V = (W~_K^T W~_K) * (M^T M). Keys likewise.
  """
  mixing = _solve_normal(state.gram_q * state.gram_k, _mixing_rhs(state.p_q, state.p_k, h))
  mixing = mixing.astype(state.mixing.dtype)
  mm = mixing.T @ mixing
  x_q = _solve_normal(state.gram_k * mm, state.p_k * _per_row(mixing, d))
  p_q = g_q @ x_q
  gram_q = x_q.T @ p_q
  rhs_k = p_q * _per_row(mixing, d)
  normal_k = gram_q * mm
  x_k = _solve_normal(normal_k, rhs_k)
  p_k = g_k @ x_k
  gram_k = x_k.T @ p_k
  # After an exact update of the keys, <T, T^> = sum(p_k * rhs_k) and |T^|^2 = sum(V * gram_k).
  squared = norm2 - 2.0 * _sum64(p_k * rhs_k) + _sum64(normal_k * gram_k)
  return _State(x_q, x_k, mixing, p_q, p_k, gram_q, gram_k), squared


def _unfolding_vectors(g_self, g_other, h, rank, key):
  """Coefficients x `[h d, rank]` with W x = the leading left singular vectors of T's unfolding
  on W's side, scaled by the singular values (for the query side, T_(1) = [T_1 ... T_h]).

  T_(1) = W_Q blockdiag(W_K^(i)T), so T_(1) T_(1)^T = Y Y^T with Y = W_Q S for any S S^T = K,
  the block-diagonal part of G_K: the vectors are Y v = W_Q S v for the eigenvectors v of
  Y^T Y = S^T G_Q S. Directions beyond the unfolding's rank (rank > min(D, h d)) are random.
  """
  hd = g_self.shape[0]
  same_head = jnp.repeat(jnp.repeat(jnp.eye(h, dtype=bool), hd // h, 0), hd // h, 1)
  blocks = jnp.where(same_head, g_other, 0.0)
  # One Cholesky of the block-diagonal matrix, not a batch of per-head ones: jaxlib's batched
  # CPU LAPACK calls can deadlock when two run at once on a small thread pool. The ridge only
  # matters for rank-deficient heads.
  ridge = 1e-10 * jnp.trace(blocks) / hd + jnp.finfo(blocks.dtype).tiny
  root = jnp.linalg.cholesky(blocks + ridge * jnp.eye(hd, dtype=blocks.dtype))
  values, vectors = jnp.linalg.eigh(root.T @ g_self @ root)
  values, vectors = values[::-1][:rank], vectors[:, ::-1][:, :rank]
  random = jax.random.normal(key, (hd, rank), root.dtype)
  random *= jnp.sqrt(values[0] / jnp.sum(random * (g_self @ random), axis=0))
  return jnp.where(values > 1e-12 * values[0], root @ vectors, random)


def _svd_start(x_q, x_k, g_q, g_k, h) -> _State:
  """The unfoldings' singular vectors for queries and keys, then the best mixing for them."""
  state = _with_products(x_q, x_k, jnp.zeros((h, x_q.shape[1]), x_q.dtype), g_q, g_k)
  mixing = _solve_normal(state.gram_q * state.gram_k, _mixing_rhs(state.p_q, state.p_k, h))
  return state._replace(mixing=mixing)


def _tensorly_start(x_k, g_q, g_k, h, key) -> _State:
  """tensorly's init='svd': key-side singular vectors, mixing = the head-mode singular vectors
  completed by U[0, 1) columns (there are only h of them), then the best queries for them."""
  hd, rank = x_k.shape
  # T_(2) T_(2)^T [i, j] = <T_i, T_j> = tr(W_Q^(i)T W_Q^(j) W_K^(j)T W_K^(i)).
  heads_gram = jnp.einsum(
      'idje,idje->ij', g_q.reshape(h, hd // h, h, hd // h), g_k.reshape(h, hd // h, h, hd // h)
  )
  head_vectors = jnp.linalg.eigh(heads_gram)[1][:, ::-1]
  filler = jax.random.uniform(key, (h, max(rank - h, 0)), head_vectors.dtype)
  mixing = jnp.concatenate([head_vectors, filler], axis=1)[:, :rank]
  p_k = g_k @ x_k
  gram_k = x_k.T @ p_k
  x_q = _solve_normal(gram_k * (mixing.T @ mixing), p_k * _per_row(mixing, hd // h))
  return _with_products(x_q, x_k, mixing, g_q, g_k)


class _Carry(NamedTuple):
  state: _State
  sweeps: Array  # sweeps done
  power: Array  # extrapolation jump = sweeps^(1 / power)
  fails: Array  # extrapolations rejected in a row
  history: Array  # [num_checks] float64 errors, NaN where not reached
  error: Array  # float64 error at the last check
  done: Array
  extrapolate: Array  # False once an extrapolated window came out worse (see _iterate)


def _iterate(carry: _Carry, limit, check_every, tol, g_q, g_k, g_q64, g_k64, norm2, h, d) -> _Carry:
  """ALS sweeps with extrapolation up to `limit` sweeps or convergence, checked every
  `check_every` sweeps in float64.

  An extrapolation is kept when the float32 error says it helps, but that comparison is noise
  once the relative error is below ~3e-4 (|T|^2 - 2<T, T^> + |T^|^2 cancels to ~1e-7 |T|^2).
  So a window can come out worse than the one before, which exact ALS sweeps never do: it is
  then undone and the sweeps go on without extrapolation. Only a small decrease (< tol per
  sweep), the floor, or a plain window that is worse (float32's limit) ends the iteration;
  once an increase was read as convergence, and ALS stopped at ~5e-5 on exact-rank tensors.
  """

  def window(carry):

    def sweep(k, inner):
      state, power, fails = inner
      new, squared = _sweep(state, g_q, g_k, norm2, h, d)
      # Extrapolate every linear part of the state; the Grams are recomputed.
      jump = ((k + 1.0) ** (1.0 / power)).astype(state.x_q.dtype)
      step = lambda old, new: old + jump * (new - old)
      x_q, x_k, mixing, p_q, p_k = (step(o, n) for o, n in zip(state[:5], new[:5]))
      jumped = _State(x_q, x_k, mixing, p_q, p_k, x_q.T @ p_q, x_k.T @ p_k)
      accept = (
          carry.extrapolate & (k >= FIRST_JUMP_AT) & (_squared_error(jumped, norm2, h) < squared)
      )
      new = jax.tree.map(lambda a, b: jnp.where(accept, a, b), jumped, new)
      fails = jnp.where(accept | (k < FIRST_JUMP_AT), 0, fails + 1)
      power = jnp.where(fails >= MAX_FAILS, power + 1.0, power)
      return new, power, jnp.where(fails >= MAX_FAILS, 0, fails)

    count = jnp.minimum(check_every, limit - carry.sweeps)
    state, power, fails = jax.lax.fori_loop(
        carry.sweeps, carry.sweeps + count, sweep, (carry.state, carry.power, carry.fails)
    )
    sweeps = carry.sweeps + count
    error = _relative_error64(state, g_q64, g_k64, norm2, h)
    worse = error > carry.error
    # A worse window is undone: the state and error stay those of the check before.
    state = jax.tree.map(lambda old, new: jnp.where(worse, old, new), carry.state, state)
    error = jnp.where(worse, carry.error, error)
    history = carry.history.at[(sweeps + check_every - 1) // check_every].set(error)
    converged = ~worse & (carry.error - error < tol * count * carry.error)
    done = converged | (error < ERROR_FLOOR) | (worse & ~carry.extrapolate)
    return _Carry(state, sweeps, power, fails, history, error, done, carry.extrapolate & ~worse)

  return jax.lax.while_loop(lambda c: (c.sweeps < limit) & ~c.done, window, carry)


@functools.partial(
    jax.jit, static_argnames=('rank', 'num_iterations', 'num_starts', 'check_every', 'dtype')
)
def _decompose(wq, wk, key, tol, *, rank, num_iterations, num_starts, check_every, dtype):
  """ALS from `num_starts` starts; the best after SCREEN_SWEEPS sweeps goes on to the end."""
  dq, h, d = wq.shape
  wq64, wk64 = wq.astype(jnp.float64), wk.astype(jnp.float64)
  w_q, w_k = wq64.reshape(dq, h * d), wk64.reshape(-1, h * d)
  g_q64, g_k64 = w_q.T @ w_q, w_k.T @ w_k
  norm2 = jnp.sum(jnp.einsum('qhd,qhe->hde', wq64, wq64) * jnp.einsum('khd,khe->hde', wk64, wk64))
  # Sweeps run in float32 (see collaborative_factors).
  g_q, g_k = g_q64.astype(jnp.float32), g_k64.astype(jnp.float32)
  key_q, key_k, *keys = jax.random.split(key, num_starts + 1)
  x_q = _unfolding_vectors(g_q64, g_k64, h, rank, key_q)
  x_k = _unfolding_vectors(g_k64, g_q64, h, rank, key_k)
  starts = [_svd_start(x_q, x_k, g_q64, g_k64, h)]
  starts += [_tensorly_start(x_k, g_q64, g_k64, h, k) for k in keys]
  num_checks = -(-num_iterations // check_every) + 1

  def start(state):
    state = jax.tree.map(lambda x: x.astype(jnp.float32), state)
    error = _relative_error64(state, g_q64, g_k64, norm2, h)
    history = jnp.full((num_checks,), jnp.nan, jnp.float64).at[0].set(error)
    return _Carry(
        state,
        jnp.int32(0),
        jnp.float64(2.0),
        jnp.int32(0),
        history,
        error,
        error < ERROR_FLOOR,
        jnp.bool_(True),
    )

  run = functools.partial(
      _iterate,
      check_every=check_every,
      tol=tol,
      g_q=g_q,
      g_k=g_k,
      g_q64=g_q64,
      g_k64=g_k64,
      norm2=norm2,
      h=h,
      d=d,
  )
  carry = start(starts[0])
  if num_starts > 1:
    # One start after the other (lax.map, not vmap: see _unfolding_vectors on batched LAPACK).
    carries = jax.lax.map(
        lambda c: run(c, limit=min(SCREEN_SWEEPS, num_iterations)),
        jax.tree.map(lambda *x: jnp.stack(x), *[start(s) for s in starts]),
    )
    carry = jax.tree.map(lambda x: x[jnp.argmin(carries.error)], carries)
  carry = run(carry, limit=num_iterations)
  q, k, mixing = _normalize(
      w_q @ carry.state.x_q.astype(jnp.float64),
      w_k @ carry.state.x_k.astype(jnp.float64),
      carry.state.mixing.astype(jnp.float64),
  )
  q, k, mixing = q.astype(dtype), k.astype(dtype), mixing.astype(dtype)
  return q, k, mixing, carry.history, carry.sweeps, _factors_error(wq64, wk64, q, k, mixing, norm2)


def _normalize(q: Array, k: Array, mixing: Array) -> tuple[Array, Array, Array]:
  """Unit mixing columns with a positive largest entry, balanced query/key norms, sorted."""
  norm_q, norm_k = jnp.linalg.norm(q, axis=0), jnp.linalg.norm(k, axis=0)
  norm_m = jnp.linalg.norm(mixing, axis=0)
  weight = norm_q * norm_k * norm_m
  largest = jnp.take_along_axis(mixing, jnp.argmax(jnp.abs(mixing), axis=0)[None], axis=0)[0]
  sign = jnp.where(largest < 0, -1.0, 1.0)
  safe = lambda x: jnp.where(weight > 0, x, 1.0)
  q = q * (sign * jnp.sqrt(weight) / safe(norm_q))
  k = k * (jnp.sqrt(weight) / safe(norm_k))
  mixing = mixing * (sign / safe(norm_m))
  order = jnp.argsort(-weight)
  return q[:, order], k[:, order], mixing[:, order]


def _factors_error(wq, wk, q, k, mixing, norm2) -> Array:
  """Relative error of explicit factors `[D_q, R]`, `[D_k, R]`, `[h, R]`, in float64."""
  dq, h, d = wq.shape
  q, k, mixing = (x.astype(jnp.float64) for x in (q, k, mixing))
  p_q = wq.reshape(dq, h * d).T @ q
  p_k = wk.reshape(-1, h * d).T @ k
  state = _State(None, None, mixing, p_q, p_k, q.T @ q, k.T @ k)
  return jnp.sqrt(jnp.maximum(_squared_error(state, norm2, h), 0.0) / norm2)
