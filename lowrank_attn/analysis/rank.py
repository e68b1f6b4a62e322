"""The low-rank bottleneck of one attention head, measured: logit ranks and best head fits.

Bhojanapalli et al. (2020), "Low-Rank Bottleneck in Multi-Head Attention Models": a head of
size d computes logits A = (X W_Q)(X W_K)^T of rank <= d for an input X of n tokens, so when
d < n there are row-stochastic n x n matrices P = softmax(A) it cannot produce (their
Theorem 2); when d >= n and X has rank n, it can produce every P with positive entries
(Theorem 1). Tools to see this on real and random inputs:

    numerical_rank(logits)                 # [..., n, m] -> rank per matrix, <= d for a head
    fit = fit_head(x, target, head_dim=d)  # gradient descent on the row-wise KL
    fit.kl                                 # the best error a head of size d reached
    svd_head(x, target, d)                 # closed form: rank-d SVD of log P through X^+

Shapes: inputs `[batch..., n, D]`, targets and logits `[batch..., n, m]` (rows sum to 1 where
not masked). Pure jnp, jit-safe; `fit_head` vmaps over the leading (problem) axes.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

Array = jax.Array


def _check_matrices(name: str, matrices) -> Array:
  matrices = jnp.asarray(matrices)
  if matrices.ndim < 2:
    raise ValueError(f'{name} must have shape [..., n, m], got shape {matrices.shape}.')
  if not jnp.issubdtype(matrices.dtype, jnp.floating):
    matrices = matrices.astype(jnp.float32)
  return matrices


def singular_values(matrices) -> Array:
  """`[..., n, m] -> [..., min(n, m)]`, in descending order (computed in float32 or wider)."""
  matrices = _check_matrices('matrices', matrices)
  matrices = matrices.astype(jnp.promote_types(matrices.dtype, jnp.float32))
  return jnp.linalg.svd(matrices, compute_uv=False)


def numerical_rank(matrices, rtol: float | None = None) -> Array:
  """Number of singular values above `rtol` x the largest, per matrix: `[..., n, m] -> [...]`.

  `rtol=None` uses numpy's default, max(n, m) x the machine epsilon of the matrices' dtype
  (float32 logits: about 1.5e-5 for 128 x 128), so a product of rank-d factors, rounded once,
  counts d. A zero matrix has rank 0.
  """
  matrices = _check_matrices('matrices', matrices)
  if rtol is None:
    rtol = max(matrices.shape[-2:]) * float(jnp.finfo(matrices.dtype).eps)
  elif not (isinstance(rtol, (int, float)) and 0.0 <= rtol < 1.0):
    raise ValueError(f'rtol={rtol!r} must be a number in [0, 1).')
  sigma = singular_values(matrices)
  return jnp.sum(sigma > rtol * sigma[..., :1], axis=-1)


def energy_rank(matrices, fraction: float = 0.99) -> Array:
  """Fewest singular values holding `fraction` of the squared Frobenius norm, per matrix.

  A softer rank than `numerical_rank`: how many directions the logits really use.
  """
  if not (isinstance(fraction, (int, float)) and 0.0 < fraction <= 1.0):
    raise ValueError(f'fraction={fraction!r} must be a number in (0, 1].')
  energy = jnp.square(singular_values(matrices))
  cumulative = jnp.cumsum(energy, axis=-1) / jnp.maximum(energy.sum(-1, keepdims=True), 1e-30)
  # Guard the last entry against rounding just under `fraction`.
  cumulative = cumulative.at[..., -1].set(1.0)
  return 1 + jnp.sum(cumulative < fraction, axis=-1)


def row_kl(targets, logits, mask=None) -> Array:
  """Mean over rows of KL(targets_i || softmax(logits_i)), in nats: `[..., n, m] -> [...]`.

  `mask` (bool, broadcastable to the logits; True = may attend) leaves positions out of the
  softmax; targets must be 0 there. Rows without any allowed position are left out of the mean.
  """
  targets = _check_matrices('targets', targets).astype(jnp.float32)
  logits = _check_matrices('logits', logits).astype(jnp.float32)
  if targets.shape[-2:] != logits.shape[-2:]:
    raise ValueError(
        f'targets {targets.shape} and logits {logits.shape} must have the same '
        'last two dimensions [n, m].'
    )
  if mask is None:
    mask = jnp.ones(logits.shape[-2:], bool)
  mask = jnp.broadcast_to(
      jnp.asarray(mask, bool), jnp.broadcast_shapes(logits.shape, targets.shape)
  )
  log_q = jax.nn.log_softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)
  # 0 log 0 = 0: positions with zero target (masked ones included) contribute nothing.
  positive = targets > 0
  terms = jnp.where(
      positive,
      targets * (jnp.log(jnp.where(positive, targets, 1.0)) - jnp.where(mask, log_q, 0.0)),
      0.0,
  )
  rows = mask.any(-1)
  return (terms.sum(-1) * rows).sum(-1) / jnp.maximum(rows.sum(-1), 1)


def head_logits(inputs, query_kernel, key_kernel) -> Array:
  """A dot-product head's logits (X W_Q)(X W_K)^T / sqrt(d): `[..., n, D] -> [..., n, n]`."""
  queries = inputs @ query_kernel
  keys = inputs @ key_kernel
  return queries @ jnp.swapaxes(keys, -1, -2) / math.sqrt(query_kernel.shape[-1])


def svd_head(inputs, targets, head_dim: int, *, mask=None, floor: float = 1e-6):
  """W_Q, W_K `[..., D, head_dim]` whose logits are the best rank-head_dim approximation of
  the targets' log-probabilities: a closed-form start for `fit_head`.

  L = log P, floored at `floor` x each row's largest entry and centred per row over the
  allowed positions (softmax ignores row constants; masked entries get the row's mean),
  is truncated to rank head_dim by SVD, L_d = U S V^T, and mapped back through the
  pseudo-inverse of X: W_Q = X^+ U S^1/2 d^1/4, W_K = X^+ V S^1/2 d^1/4, so that
  `head_logits(X, W_Q, W_K)` = X X^+ L_d X^+T X^T = L_d when X has rank n (Bhojanapalli
  et al. 2020, Theorem 1's construction). It minimises the Frobenius error of the logits,
  not the KL; `fit_head(init='svd')` continues from it by gradient descent.
  """
  inputs = _check_matrices('inputs', inputs).astype(jnp.float32)
  targets = _check_matrices('targets', targets).astype(jnp.float32)
  n = inputs.shape[-2]
  mask = jnp.ones((n, n), bool) if mask is None else jnp.asarray(mask, bool)
  mask = jnp.broadcast_to(mask, targets.shape)
  rowmax = jnp.max(jnp.where(mask, targets, 0.0), axis=-1, keepdims=True)
  log_p = jnp.log(jnp.maximum(targets, floor * jnp.maximum(rowmax, 1e-30)))
  allowed = jnp.maximum(mask.sum(-1, keepdims=True), 1)
  row_mean = jnp.sum(jnp.where(mask, log_p, 0.0), -1, keepdims=True) / allowed
  centred = jnp.where(mask, log_p - row_mean, 0.0)
  u, sigma, vt = jnp.linalg.svd(centred, full_matrices=False)
  rank_d = min(head_dim, n)
  root = jnp.sqrt(sigma[..., None, :rank_d]) * head_dim**0.25
  pinv = jnp.linalg.pinv(inputs)  # [..., D, n]
  query_kernel = pinv @ (u[..., :rank_d] * root)
  key_kernel = pinv @ (jnp.swapaxes(vt, -1, -2)[..., :rank_d] * root)
  pad = [(0, 0)] * (query_kernel.ndim - 1) + [(0, head_dim - rank_d)]  # d > n: zero columns
  return jnp.pad(query_kernel, pad), jnp.pad(key_kernel, pad)


@dataclasses.dataclass(frozen=True)
class HeadFit:
  """What `fit_head` found, per problem (leading axes as the inputs').

  Attributes:
    query_kernel, key_kernel: W_Q, W_K `[..., D, head_dim]`.
    logits: the fitted head's logits `[..., n, n]` (rank <= head_dim).
    kl: the row-wise KL of the best iterate (the one returned), `[...]` (nats per row).
    kl_history: the KL before every step, `[..., steps]`.
  """

  query_kernel: Array
  key_kernel: Array
  logits: Array
  kl: Array
  kl_history: Array


INITS = ('random', 'svd')


def fit_head(
    inputs,
    targets,
    head_dim: int,
    *,
    mask=None,
    steps: int = 2000,
    learning_rate: float = 0.03,
    seed: int | Array = 0,
    init: str = 'random',
) -> HeadFit:
  """Fits one head's W_Q, W_K `[D, head_dim]` so that softmax(logits) matches `targets`.

  Minimises `row_kl(targets, head_logits(inputs, W_Q, W_K), mask)` with Adam (`learning_rate`
  after a 5% warmup, cosine decay to 1% of it at `steps`) from `init`: 'random' (scaled to
  give unit-variance logits) or 'svd' (`svd_head`, plus a little noise so that its zero
  columns can move). Leading axes of `inputs` `[..., n, D]` and `targets` `[..., n, n]`
  are independent problems, fitted in one vmapped, jitted loop (one compilation per shape,
  head_dim and steps); `seed` is an int, or ints or keys shaped like the problems.

  The KL reached is an upper bound on the best achievable error of a head of size `head_dim`
  (gradient descent on a non-convex problem): near 0 when head_dim >= n and the inputs have
  rank n (Bhojanapalli et al. 2020, Theorem 1).
  """
  inputs = _check_matrices('inputs', inputs).astype(jnp.float32)
  targets = _check_matrices('targets', targets).astype(jnp.float32)
  n = inputs.shape[-2]
  if targets.shape[-2:] != (n, n):
    raise ValueError(
        f"targets must have shape [..., n, n] with n={n} (the inputs' length), "
        f'got {targets.shape}.'
    )
  batch = jnp.broadcast_shapes(inputs.shape[:-2], targets.shape[:-2])
  for name, value in (('head_dim', head_dim), ('steps', steps)):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
      raise ValueError(f'{name}={value!r} must be an integer >= 1.')
  if not (isinstance(learning_rate, (int, float)) and learning_rate > 0):
    raise ValueError(f'learning_rate={learning_rate!r} must be a number > 0.')
  if init not in INITS:
    raise ValueError(f'init={init!r} is not one of {INITS}.')
  mask = jnp.ones((n, n), bool) if mask is None else jnp.asarray(mask, bool)
  if mask.shape[-2:] != (n, n):
    raise ValueError(f'mask must broadcast to [..., {n}, {n}], got shape {mask.shape}.')
  keys = jnp.asarray(seed)
  if not jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):
    keys = jax.vmap(jax.random.key)(jnp.broadcast_to(keys, batch).reshape(-1)).reshape(batch)
  keys = jnp.broadcast_to(keys, batch)

  flat = lambda a: jnp.broadcast_to(a, batch + a.shape[-2:]).reshape((-1,) + a.shape[-2:])
  out = _fit_problems(
      flat(inputs),
      flat(targets),
      flat(mask),
      keys.reshape(-1),
      head_dim=int(head_dim),
      steps=int(steps),
      learning_rate=float(learning_rate),
      init=init,
  )
  return HeadFit(*(a.reshape(batch + a.shape[1:]) for a in out))


@functools.partial(jax.jit, static_argnames=('head_dim', 'steps', 'learning_rate', 'init'))
def _fit_problems(inputs, targets, mask, keys, *, head_dim, steps, learning_rate, init):
  """`_fit_one` over a leading axis of problems."""
  fit = functools.partial(
      _fit_one, head_dim=head_dim, steps=steps, learning_rate=learning_rate, init=init
  )
  return jax.vmap(fit)(inputs, targets, mask, keys)


def _fit_one(inputs, targets, mask, key, *, head_dim, steps, learning_rate, init):
  """One problem: `[n, D]`, `[n, n]`, `[n, n]`, key -> (W_Q, W_K, logits, kl, history)."""
  depth = inputs.shape[-1]
  # W ~ N(0, 1/(D ms(x))): queries and keys of unit variance, logits of unit variance.
  scale = jax.lax.rsqrt(depth * jnp.maximum(jnp.mean(jnp.square(inputs)), 1e-12))
  query_key, key_key = jax.random.split(key)
  params = (
      scale * jax.random.normal(query_key, (depth, head_dim)),
      scale * jax.random.normal(key_key, (depth, head_dim)),
  )
  if init == 'svd':
    start = svd_head(inputs, targets, head_dim, mask=mask)
    params = tuple(w + 1e-3 * noise for w, noise in zip(start, params))
  # A short warmup: the first steps from a random start can overshoot at large head_dim.
  optimizer = optax.adam(
      optax.warmup_cosine_decay_schedule(
          0.0,
          learning_rate,
          warmup_steps=max(steps // 20, 1),
          decay_steps=steps,
          end_value=0.01 * learning_rate,
      )
  )
  loss = lambda p: row_kl(targets, head_logits(inputs, *p), mask)

  def step(carry, _):
    params, opt_state, best, best_value = carry
    value, grads = jax.value_and_grad(loss)(params)
    # Keep the best iterate: Adam's steps stay ~learning_rate long near an optimum.
    best, best_value = jax.lax.cond(
        value < best_value, lambda: (params, value), lambda: (best, best_value)
    )
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state, best, best_value), value

  carry = (params, optimizer.init(params), params, jnp.asarray(jnp.inf, jnp.float32))
  (params, _, best, best_value), history = jax.lax.scan(step, carry, length=steps)
  params = jax.lax.cond(loss(params) < best_value, lambda: params, lambda: best)
  logits = head_logits(inputs, *params)
  return params[0], params[1], logits, row_kl(targets, logits, mask), history
