"""`lowrank_attn.analysis.rank` against numpy, and the bottleneck it measures on n = 4."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_attn.analysis import rank


def low_rank_matrices(rng, ranks, n=12, m=10):
  """`[len(ranks), n, m]` float32 matrices of the given ranks, well conditioned."""
  out = []
  for r in ranks:
    out.append(rng.standard_normal((n, r)) @ rng.standard_normal((r, m)))
  return np.stack(out).astype(np.float32)


def test_numerical_rank_matches_numpy():
  rng = np.random.default_rng(0)
  ranks = [0, 1, 3, 7, 10]
  # Large and small scales: the tolerance must be relative to each matrix's largest value.
  scales = np.array([1.0, 1e3, 1e-3, 1e4, 1e-2])[:, None, None]
  matrices = (low_rank_matrices(rng, ranks) * scales).astype(np.float32)
  got = np.asarray(rank.numerical_rank(matrices))
  # numpy's default tolerance: largest singular value x max(n, m) x eps of the dtype.
  want = [np.linalg.matrix_rank(a) for a in matrices]
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(got, ranks)


def test_numerical_rank_relative_tolerance_matches_numpy():
  rng = np.random.default_rng(1)
  u, _ = np.linalg.qr(rng.standard_normal((8, 8)))
  v, _ = np.linalg.qr(rng.standard_normal((8, 8)))
  sigma = np.array([1.0, 0.5, 0.2, 0.05, 0.02, 0.005, 0.002, 0.0005])
  matrix = 300.0 * (u * sigma) @ v.T
  for rtol in (0.3, 0.1, 0.01, 0.001, 0.0001):
    assert int(rank.numerical_rank(matrix, rtol=rtol)) == np.linalg.matrix_rank(matrix, rtol=rtol)


def test_energy_rank_matches_numpy():
  rng = np.random.default_rng(2)
  matrices = rng.standard_normal((5, 9, 9)) * np.logspace(0, -3, 9)  # decaying columns
  for fraction in (0.5, 0.9, 0.99, 0.999):  # no share within float32 rounding of these
    sigma = np.linalg.svd(matrices, compute_uv=False)
    share = np.cumsum(sigma**2, -1) / np.sum(sigma**2, -1, keepdims=True)
    want = [int(np.searchsorted(s, fraction - 1e-12) + 1) for s in share]
    np.testing.assert_array_equal(rank.energy_rank(matrices, fraction), want)


def numpy_row_kl(targets, logits, mask):
  """Mean over rows with an allowed position of sum_j p log(p / q), q the masked softmax."""
  total, rows = 0.0, 0
  for p, a, allowed in zip(targets, logits, mask):
    if not allowed.any():
      continue
    a = np.where(allowed, a, -np.inf)
    q = np.exp(a - a.max()) / np.exp(a - a.max()).sum()
    total += sum(pj * np.log(pj / qj) for pj, qj in zip(p, q) if pj > 0)
    rows += 1
  return total / rows


def test_row_kl_matches_numpy_with_a_causal_mask():
  rng = np.random.default_rng(3)
  n = 6
  mask = np.tril(np.ones((n, n), bool))
  logits = rng.standard_normal((n, n)) * 2
  raw = np.where(mask, rng.random((n, n)) + 0.1, 0.0)
  raw[2, 1] = 0.0  # an allowed position with zero target: 0 log 0 = 0
  targets = raw / raw.sum(-1, keepdims=True)
  got = float(rank.row_kl(targets, logits, mask))
  np.testing.assert_allclose(got, numpy_row_kl(targets, logits, mask), rtol=1e-5)
  full = np.ones((n, n), bool)
  np.testing.assert_allclose(
      float(rank.row_kl(targets, logits)), numpy_row_kl(targets, logits, full), rtol=1e-5
  )


def test_row_kl_skips_a_fully_masked_row_without_nan_gradients():
  rng = np.random.default_rng(9)
  n = 5
  mask = np.tril(np.ones((n, n), bool))
  mask[0] = False  # e.g. a padding query
  logits = rng.standard_normal((n, n)).astype(np.float32)
  targets = np.where(mask, 1.0, 0.0)
  targets = (targets / np.maximum(targets.sum(-1, keepdims=True), 1)).astype(np.float32)
  value, grad = jax.value_and_grad(lambda a: rank.row_kl(targets, a, mask))(logits)
  np.testing.assert_allclose(value, numpy_row_kl(targets, logits, mask), rtol=1e-5)
  assert np.isfinite(np.asarray(grad)).all()
  np.testing.assert_array_equal(grad[0], 0.0)


def test_row_kl_is_zero_for_the_targets_own_logits():
  rng = np.random.default_rng(4)
  logits = rng.standard_normal((3, 5, 5))
  targets = jax.nn.softmax(logits + 7.0, axis=-1)  # a row constant does not change softmax
  np.testing.assert_allclose(rank.row_kl(targets, logits), 0.0, atol=1e-6)


def test_head_logits_match_numpy():
  rng = np.random.default_rng(5)
  x, wq, wk = (rng.standard_normal(s).astype(np.float32) for s in ((7, 6), (6, 3), (6, 3)))
  want = (x @ wq) @ (x @ wk).T / np.sqrt(3)
  np.testing.assert_allclose(rank.head_logits(x, wq, wk), want, rtol=1e-5, atol=1e-5)


def permutation_target(n=4, mass=0.9):
  """Each row puts `mass` on a different column: its logits need rank n (a rank-1 head can
  only put its largest weight on the argmax or argmin column of its keys)."""
  p = np.full((n, n), (1 - mass) / (n - 1))
  p[np.arange(n), np.roll(np.arange(n), 1)] = mass
  return p.astype(np.float32)


def test_fit_head_reaches_zero_at_d_equal_n_and_not_at_d_1():
  """The bottleneck on n = 4: Theorem 1 (d = n fits) and Theorem 2 (d = 1 cannot)."""
  n, depth = 4, 8
  x = np.random.default_rng(6).standard_normal((n, depth)).astype(np.float32)
  target = permutation_target(n)
  full = rank.fit_head(x, target, n, steps=600, seed=0)
  one = rank.fit_head(x, target, 1, steps=600, seed=0)
  assert float(full.kl) < 1e-3
  # Rank-1 logits a_i b_k put every row's largest weight on argmax b or argmin b: at least two
  # of the four rows lose their peak. The closest q to such a row p with q_j >= q_t (t its
  # peak) merges the two, q_t = q_j = (p_t + p_j) / 2, at KL p_t log(2 p_t / (p_t + p_j)) +
  # p_j log(2 p_j / (p_t + p_j)); the mean over rows is at least half of that.
  p_t, p_j = target.max(), target.min()
  lost = p_t * np.log(2 * p_t / (p_t + p_j)) + p_j * np.log(2 * p_j / (p_t + p_j))
  assert float(one.kl) >= 2 / n * lost - 1e-4  # 0.2516 (measured ~0.7)
  # The reported error is the KL of the returned logits, and those have rank <= d.
  for fit, d in ((full, n), (one, 1)):
    np.testing.assert_allclose(
        float(fit.kl),
        numpy_row_kl(target, np.asarray(fit.logits), np.ones((n, n), bool)),
        rtol=1e-3,
        atol=1e-6,
    )
    np.testing.assert_allclose(
        fit.logits, rank.head_logits(x, fit.query_kernel, fit.key_kernel), rtol=1e-5, atol=1e-5
    )
    assert int(rank.numerical_rank(fit.logits)) == d
  assert full.kl_history.shape == (600,)
  assert full.kl_history[-1] < full.kl_history[0]


def test_fit_head_vmaps_over_problems_and_seeds(numpy_reference):
  """A batch of problems is fitted as each one alone (same seed, same result, up to what
  rounding the inputs moves the KL reached after 50 Adam steps)."""
  rng = np.random.default_rng(7)
  x = rng.standard_normal((3, 4, 6)).astype(np.float32)
  targets = np.stack(
      [permutation_target(), permutation_target(mass=0.6), np.full((4, 4), 0.25, np.float32)]
  )
  batch = rank.fit_head(x, targets, 2, steps=50, seed=np.array([3, 4, 5]))
  assert batch.query_kernel.shape == (3, 6, 2) and batch.kl.shape == (3,)
  for i in range(3):
    fit = lambda inputs: rank.fit_head(inputs, targets[i], 2, steps=50, seed=3 + i).kl
    tolerance = numpy_reference.one_ulp_tolerance(fit, x[i])
    numpy_reference.assert_within(batch.kl[i], fit(x[i]), tolerance)


def test_fit_head_respects_the_mask():
  """A causal target is fitted under the causal mask: masked logits do not count."""
  n = 4
  mask = np.tril(np.ones((n, n), bool))
  target = np.where(mask, 1.0, 0.0)
  target = (target / target.sum(-1, keepdims=True)).astype(np.float32)
  x = np.random.default_rng(8).standard_normal((n, 8)).astype(np.float32)
  fit = rank.fit_head(x, target, n, mask=mask, steps=400, seed=0)
  assert float(fit.kl) < 1e-3
  np.testing.assert_allclose(
      float(fit.kl), numpy_row_kl(target, np.asarray(fit.logits), mask), rtol=1e-3, atol=1e-6
  )


def test_svd_head_gives_the_rank_d_truncation_of_the_centred_log_targets():
  """Theorem 1's construction, checked against numpy's SVD of log P."""
  rng = np.random.default_rng(10)
  n, depth = 6, 10
  x = rng.standard_normal((n, depth)).astype(np.float32)
  target = np.asarray(jax.nn.softmax(2 * rng.standard_normal((n, n)), -1))
  centred = np.log(target) - np.log(target).mean(-1, keepdims=True)
  u, sigma, vt = np.linalg.svd(centred)
  for d in (1, 3, n, n + 2):
    logits = rank.head_logits(x, *rank.svd_head(x, target, d))
    k = min(d, n)
    np.testing.assert_allclose(logits, (u[:, :k] * sigma[:k]) @ vt[:k], atol=2e-4)
  # d >= n: exact, so the KL is 0 before any gradient step.
  assert float(rank.row_kl(target, rank.head_logits(x, *rank.svd_head(x, target, n)))) < 1e-6


def test_fit_head_from_the_svd_start_keeps_its_exact_fit():
  rng = np.random.default_rng(11)
  x = rng.standard_normal((5, 9)).astype(np.float32)
  target = np.asarray(jax.nn.softmax(3 * rng.standard_normal((5, 5)), -1))
  fit = rank.fit_head(x, target, 5, steps=20, init='svd')
  assert float(fit.kl_history[0]) < 1e-4  # the start is already exact (plus 1e-3 noise)
  assert float(fit.kl) < 1e-5


@pytest.mark.parametrize(
    'call, message',
    [
        (lambda: rank.numerical_rank(np.ones(3)), 'shape'),
        (lambda: rank.numerical_rank(np.ones((2, 2)), rtol=1.5), 'rtol'),
        (lambda: rank.energy_rank(np.ones((2, 2)), fraction=0.0), 'fraction'),
        (lambda: rank.row_kl(np.ones((2, 3)), np.ones((2, 2))), 'last two'),
        (lambda: rank.fit_head(np.ones((4, 3)), np.ones((5, 5)), 2), 'targets'),
        (lambda: rank.fit_head(np.ones((4, 3)), np.ones((4, 4)), 0), 'head_dim'),
        (lambda: rank.fit_head(np.ones((4, 3)), np.ones((4, 4)), 2, steps=0), 'steps'),
        (
            lambda: rank.fit_head(np.ones((4, 3)), np.ones((4, 4)), 2, learning_rate=-1.0),
            'learning_rate',
        ),
        (lambda: rank.fit_head(np.ones((4, 3)), np.ones((4, 4)), 2, mask=np.ones((3, 3))), 'mask'),
        (lambda: rank.fit_head(np.ones((4, 3)), np.ones((4, 4)), 2, init='zeros'), 'init'),
    ],
)
def test_bad_input_raises_a_value_error_naming_it(call, message):
  with pytest.raises(ValueError, match=message):
    call()
