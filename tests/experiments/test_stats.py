"""Paired bootstrap intervals against closed forms and sacreBLEU's own corpus scores."""

import numpy as np
import pytest
import sacrebleu
from scipy import stats as scipy_stats

from experiments import stats


def _paired_accuracy_systems(n, seed=0):
  """Labels and two correlated classifiers: B fixes some of A's errors and makes a few new."""
  rng = np.random.default_rng(seed)
  labels = rng.integers(0, 2, n)
  a = np.where(rng.random(n) < 0.75, labels, 1 - labels)
  flip = rng.random(n)
  b = np.where(flip < 0.12, labels, np.where(flip < 0.18, 1 - labels, a))
  return labels, a, b


def test_the_interval_of_a_paired_accuracy_difference_has_the_normal_width():
  """For accuracy the paired difference is a mean of d_i in {-1, 0, 1}: its standard error is
  sd(d) / sqrt(n), and the 95% interval is about +-1.96 of it. Resampling A and B apart
  (unpaired) would give an interval about twice as wide here; a wrong quantile level a
  different width. The percentile ends of 2,000 resamples carry ~3% Monte Carlo error, the
  normal approximation at n = 600 ~1%: 10% covers both."""
  labels, a, b = _paired_accuracy_systems(600)
  interval = stats.glue_difference({'sst2': (labels, [a], [b])}, seed=1)
  d = 100.0 * ((b == labels).astype(float) - (a == labels))
  assert interval.estimate == pytest.approx(d.mean(), abs=1e-9)
  half_width = 1.959964 * d.std(ddof=0) / np.sqrt(len(d))
  assert (interval.high - interval.low) / (2 * half_width) == pytest.approx(1.0, abs=0.10)
  assert interval.low < interval.estimate < interval.high
  assert interval.excludes_zero == (interval.low > 0 or interval.high < 0)


def test_identical_systems_differ_by_exactly_zero():
  labels, a, _ = _paired_accuracy_systems(200)
  interval = stats.glue_difference({'rte': (labels, [a], [a])})
  assert (interval.estimate, interval.low, interval.high) == (0.0, 0.0, 0.0)


def test_tasks_are_averaged_and_seeds_averaged_within_a_task():
  labels, a, b = _paired_accuracy_systems(300)
  accuracy = lambda p: 100.0 * np.mean(p == labels)
  rng = np.random.default_rng(5)
  scores = rng.random(300)  # an STS-B-like regression task whose systems agree
  stsb = (scores, [scores + 0.1 * rng.random(300)], [scores + 0.1 * rng.random(300)])
  b2 = np.where(np.arange(300) < 30, labels, b)
  interval = stats.glue_difference({'rte': (labels, [a, a], [b, b2]), 'stsb': stsb}, samples=50)

  def stsb_score(p):  # GLUE's STS-B score: the mean of Pearson's and Spearman's x100
    return 50 * (scipy_stats.pearsonr(p, scores)[0] + scipy_stats.spearmanr(p, scores)[0])

  expected_rte = (accuracy(b) + accuracy(b2)) / 2 - accuracy(a)
  expected_stsb = stsb_score(stsb[2][0]) - stsb_score(stsb[1][0])
  assert interval.estimate == pytest.approx((expected_rte + expected_stsb) / 2, abs=1e-9)


def test_bleu_difference_is_sacrebleus_corpus_difference_with_a_paired_interval():
  rng = np.random.default_rng(0)
  words = 'a man in a blue shirt is riding a bike down the street with his dog'.split()
  references = [' '.join(rng.choice(words, rng.integers(5, 12))) for _ in range(120)]

  def noisy(sentence, p):
    kept = [w for w in sentence.split() if rng.random() > p]
    return ' '.join(kept or ['the'])

  system_a = [noisy(r, 0.35) for r in references]
  system_b = [noisy(r, 0.25) for r in references]
  interval = stats.bleu_difference(references, system_a, system_b, samples=300)
  expected = (
      sacrebleu.corpus_bleu(system_b, [references]).score
      - sacrebleu.corpus_bleu(system_a, [references]).score
  )
  assert interval.estimate == pytest.approx(expected, abs=1e-9)
  assert interval.low < expected < interval.high
  same = stats.bleu_difference(references, system_a, system_a, samples=20)
  assert (same.low, same.high) == (0.0, 0.0)
  with pytest.raises(ValueError, match='every system must translate every sentence'):
    stats.bleu_difference(references, system_a[:-1], system_b)
  # Seeds: each system's BLEU is the mean of its seeds' corpus BLEU.
  seed_b = [noisy(r, 0.1) for r in references]
  seeds = stats.bleu_difference(references, [system_a], [system_b, seed_b], samples=20)
  mean_b = (
      sacrebleu.corpus_bleu(system_b, [references]).score
      + sacrebleu.corpus_bleu(seed_b, [references]).score
  ) / 2
  assert seeds.estimate == pytest.approx(
      mean_b - sacrebleu.corpus_bleu(system_a, [references]).score, abs=1e-9
  )
  assert stats.corpus_bleu(references, seed_b) == pytest.approx(
      sacrebleu.corpus_bleu(seed_b, [references]).score
  )


def test_bleu_contrast_is_the_weighted_sum_of_sacrebleus_scores_on_the_same_resamples():
  """A difference of differences: its estimate is sacreBLEU's scores combined; it is exactly 0
  on every resample when the two differences are the same systems; a contrast whose systems
  differ only in the interaction's cell has an interval around that cell's difference."""
  rng = np.random.default_rng(1)
  words = 'two dogs run across a green field while a child watches them'.split()
  references = [' '.join(rng.choice(words, rng.integers(5, 12))) for _ in range(150)]

  def noisy(sentence, p):
    return ' '.join([w for w in sentence.split() if rng.random() > p] or ['the'])

  a, b, c, d = ([noisy(r, p) for r in references] for p in (0.4, 0.3, 0.35, 0.1))
  score = lambda hyps: sacrebleu.corpus_bleu(hyps, [references]).score
  got = stats.bleu_contrast(references, [a, b, c, d], [1, -1, -1, 1], samples=300)
  assert got.estimate == pytest.approx((score(d) - score(c)) - (score(b) - score(a)), abs=1e-9)
  assert got.low < got.estimate < got.high
  same = stats.bleu_contrast(references, [a, b, a, b], [1, -1, -1, 1], samples=30)
  assert (same.estimate, same.low, same.high) == (0.0, 0.0, 0.0)
  # Against bleu_difference: (D - C) - (B - A) with B = A is D - C, resample by resample.
  one = stats.bleu_contrast(references, [a, a, c, d], [1, -1, -1, 1], samples=200, seed=3)
  two = stats.bleu_difference(references, c, d, samples=200, seed=3)
  assert (one.low, one.high) == pytest.approx((two.low, two.high), abs=1e-9)
  with pytest.raises(ValueError, match='one weight each'):
    stats.bleu_contrast(references, [a, b], [1.0])
