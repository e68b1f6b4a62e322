"""Multi-head attention of every kind and the hard-concrete gate, from the papers, in numpy.

Nothing here imports lowrank_attn or reads its defaults: tests compare the library with these
formulas, written per head with plain loops in float64 (float32 on request: the measured
rounding behind `float32_tolerance`; `one_ulp_tolerance` for what has no formula here).
Parameters are read by the library's names
(`spec.param_shapes()`); sizes and the logit scale come from their shapes.
"""

import math

import numpy as np

# Hard-concrete settings of Voita et al.'s own code (lena-voita/the-story-of-heads,
# lib/layers/concrete_gate.py: `temperature=0.33, stretch_limits=(-0.1, 1.1)`).
VOITA_TEMPERATURE = 0.33
# Louizos et al. (2018), sec. 4: beta = 2/3, (gamma, zeta) = (-0.1, 1.1).
LOUIZOS_TEMPERATURE = 2 / 3
STRETCH = (-0.1, 1.1)


def sigmoid(x):
  return 1.0 / (1.0 + np.exp(-np.asarray(x, np.float64)))


# ------------------------------------------------------------------ hard concrete (Louizos et al.)


def hard_concrete_sample(u, log_alpha, temperature, stretch=STRETCH):
  """Eq. 10: s = sigmoid((log u - log(1 - u) + log alpha) / beta), stretched, clipped."""
  low, high = stretch
  s = sigmoid((np.log(u) - np.log1p(-u) + log_alpha) / temperature)
  return np.clip(s * (high - low) + low, 0.0, 1.0)


def hard_concrete_eval(log_alpha, stretch=STRETCH):
  """Eq. 13: the test-time gate min(1, max(0, sigmoid(log alpha) (zeta - gamma) + gamma))."""
  low, high = stretch
  return np.clip(sigmoid(log_alpha) * (high - low) + low, 0.0, 1.0)


def hard_concrete_prob_open(log_alpha, temperature, stretch=STRETCH):
  """Eq. 12: P(g != 0) = sigmoid(log alpha - beta log(-gamma / zeta))."""
  low, high = stretch
  return sigmoid(np.asarray(log_alpha, np.float64) - temperature * math.log(-low / high))


def hard_concrete_prob_one(log_alpha, temperature, stretch=STRETCH):
  """P(g = 1) = P(s >= (1 - gamma) / (zeta - gamma)) = sigmoid(log alpha - beta log((1 - gamma) / (zeta - 1)))."""
  low, high = stretch
  return sigmoid(np.asarray(log_alpha, np.float64) - temperature * math.log((1 - low) / (high - 1)))


def hard_concrete_mean(log_alpha, temperature, stretch=STRETCH, points=1_000_000):
  """E[g]: eq. 10 integrated over u ~ U(0, 1) by the midpoint rule."""
  u = (np.arange(points) + 0.5) / points
  return np.array(
      [hard_concrete_sample(u, a, temperature, stretch).mean() for a in np.atleast_1d(log_alpha)]
  )


# ------------------------------------------------------------------ attention


def masked_softmax(logits, mask):
  """Softmax over visible keys; a row with no visible key is all zeros."""
  logits = np.where(mask, logits, -np.inf)
  top = np.max(logits, axis=-1, keepdims=True)
  top = np.where(np.isfinite(top), top, 0.0)
  e = np.where(mask, np.exp(logits - top), 0.0)
  total = e.sum(-1, keepdims=True)
  return np.divide(e, total, out=np.zeros_like(e), where=total > 0)


def _layer_norm(x, scale, eps=1e-6):
  """LayerNorm over the head dimension, no bias (flax's `normalize_qk`)."""
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + eps) * scale


def attention(
    params, x, y=None, *, kind, mask=None, head_mask=None, normalize_qk=False, dtype=np.float64
):
  """Evaluation-mode multi-head attention of `kind`; returns (out, weights).

  x `[batch, q, D]`, y `[batch, k, D_kv]` (default x); mask broadcastable to
  `[batch, heads, q, k]` (True = visible); head_mask `[heads]` factors on head outputs.
  Gated layers (a 'gate_log_alpha' parameter) scale head i by its eq.-13 gate. Computed in
  `dtype` (float64; float32 for `float32_tolerance`).
  """
  p = {name: np.asarray(value, dtype) for name, value in params.items()}
  x = np.asarray(x, dtype)
  y = x if y is None else np.asarray(y, dtype)
  bias = lambda name, shape: p.get(name, np.zeros(shape, dtype))
  batch, q_len, k_len = x.shape[0], x.shape[1], y.shape[1]
  h, head_dim = p['out_kernel'].shape[:2]
  mask = np.ones((1, 1, 1, 1), bool) if mask is None else np.asarray(mask, bool)
  mask = np.broadcast_to(mask, (batch, h, q_len, k_len))

  logits = np.zeros((batch, h, q_len, k_len), dtype)
  values = np.zeros((batch, h, k_len, head_dim), dtype)
  for b in range(batch):
    for i in range(h):
      if kind == 'collaborative':
        # Cordonnier et al. (2020), eq. 7: s ((X W~_Q diag(m_i)) (Y W~_K)^T + 1 (Y c_i)^T),
        # s = 1 / sqrt(D_k / h) for a layer trained from scratch.
        key_dim = p['mixing'].shape[1]
        scale = 1.0 / math.sqrt(key_dim / h)
        shared_q = x[b] @ p['query_kernel']
        shared_k = y[b] @ p['key_kernel']
        content = y[b] @ p['content_bias'][:, i] if 'content_bias' in p else np.zeros(k_len, dtype)
        logits[b, i] = scale * ((shared_q * p['mixing'][i]) @ shared_k.T + content[None, :])
        j = i
      else:
        # Vaswani et al. (2017): head i's logits q_i k_j^T / sqrt(d_p), d_p the per-head width
        # (Bhojanapalli et al. 2020 choose d_p freely). Grouped-query attention (Ainslie et al.
        # 2023): query head i reads key/value head j = i // (h / h_kv), contiguous groups.
        kv_heads = p['key_kernel'].shape[1]
        j = i // (h // kv_heads)
        d = p['query_kernel'].shape[2]
        query = x[b] @ p['query_kernel'][:, i] + bias('query_bias', (h, d))[i]
        key = y[b] @ p['key_kernel'][:, j] + bias('key_bias', (kv_heads, d))[j]
        if normalize_qk:
          query = _layer_norm(query, p['query_ln_scale'])
          key = _layer_norm(key, p['key_ln_scale'])
        logits[b, i] = query @ key.T / math.sqrt(d)
      value_heads = p['value_kernel'].shape[1]
      values[b, i] = y[b] @ p['value_kernel'][:, j] + bias('value_bias', (value_heads, head_dim))[j]

  if kind == 'talking_heads':
    # Shazeer et al. (2020): mix the logits across heads, softmax (masked by the output
    # head's mask), mix the weights; weight mixed onto a hidden key is removed again.
    pre, post = p['pre_softmax_mixing'], p['post_softmax_mixing']
    mixed = np.einsum('bhqk,hg->bgqk', logits, pre)
    weights = np.einsum('bhqk,hg->bgqk', masked_softmax(mixed, mask), post) * mask
  else:
    weights = masked_softmax(logits, mask)

  factors = np.ones(h)
  if 'gate_log_alpha' in p:
    factors = factors * hard_concrete_eval(p['gate_log_alpha'])
  if head_mask is not None:
    factors = factors * np.asarray(head_mask, np.float64)
  factors = factors.astype(dtype)
  heads = np.einsum('bhqk,bhkd->bqhd', weights, values) * factors[None, None, :, None]
  out = np.einsum('bqhd,hde->bqe', heads, p['out_kernel'])
  out = out + bias('out_bias', out.shape[-1:])
  return out, weights


# ------------------------------------------------------------------ float32 tolerances

NOISE_FACTOR = 16


def float32_tolerance(params, x, y=None, *, kind, mask=None, head_mask=None, normalize_qk=False):
  """How far two float32 evaluations of `attention` (the library's and flax's, a cached and a
  full pass) may differ on these inputs, derived from the rounding of this very computation on
  this machine: the formula evaluated in float32 by numpy, against float64, measured here.

  XLA sums in other orders and fuses otherwise, so a program may round a few times worse than
  numpy's (blocked, partly pairwise) sums: NOISE_FACTOR of the largest measured error, at
  least 4 ulps of the largest output. Tighter than a worst-case bound (gamma_n over the sums
  of absolute terms: here 10^3-10^4 times the errors seen, too loose to see a logit scale off
  by 1%), and unlike a fixed atol it follows the inputs' magnitude and the CPU's rounding.
  Returns (out tolerance, weights tolerance), as `attention` returns (out, weights)."""
  settings = dict(kind=kind, mask=mask, head_mask=head_mask, normalize_qk=normalize_qk)
  exact = attention(params, x, y, **settings)
  rounded = attention(params, x, y, **settings, dtype=np.float32)

  def tolerance(exact, rounded):
    ulp = np.spacing(np.float32(np.max(np.abs(exact))))
    return max(NOISE_FACTOR * float(np.max(np.abs(rounded - exact))), 4 * float(ulp))

  return tuple(tolerance(e, r) for e, r in zip(exact, rounded))


def one_ulp_tolerance(evaluate, inputs, seed=0):
  """How far float32 rounding alone can move `evaluate(inputs)`, for computations with no
  float64 formula to measure against (a whole model, an optimisation): NOISE_FACTOR of the
  change when every float32 array in the pytree `inputs` moves by one ulp, up or down at
  random (one rounding of each), at least 4 ulps of the largest output. `evaluate` returns an
  array; an output that amplifies rounding (a chaotic fit) gets a tolerance to match."""
  import jax  # only to map over pytrees (a model's parameter state); the rest is numpy

  rng = np.random.default_rng(seed)

  def move(x):
    x = np.asarray(x)
    if x.dtype != np.float32:
      return x
    return np.where(rng.random(x.shape) < 0.5, np.nextafter(x, np.inf), np.nextafter(x, -np.inf))

  before = np.asarray(evaluate(inputs), np.float64)
  after = np.asarray(evaluate(jax.tree.map(move, inputs)), np.float64)
  ulp = np.spacing(np.float32(np.max(np.abs(before))))
  return max(NOISE_FACTOR * float(np.max(np.abs(after - before))), 4 * float(ulp))


def assert_within(actual, expected, tolerance):
  """|actual - expected| <= tolerance everywhere, reporting the worst element."""
  error = np.abs(np.asarray(actual, np.float64) - np.asarray(expected, np.float64))
  worst = np.unravel_index(np.argmax(error), error.shape)
  assert (
      error[worst] <= tolerance
  ), f'off by {error[worst]:.3g} at {worst}; float32 rounding explains {tolerance:.3g}'
