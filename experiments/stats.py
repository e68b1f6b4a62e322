"""Paired bootstrap intervals for the differences the experiments' READMEs state.

    interval = stats.glue_difference({'rte': (labels, [a_seed0, a_seed1], [b_seed0, b_seed1])})
    interval = stats.bleu_difference(references, system_a, system_b)
    interval = stats.bleu_contrast(references, [a, b, c, d], [1, -1, -1, 1])  # (d-c) - (b-a)
    print(interval)   # '+1.23 [+0.40, +2.05]' : B minus A, with its 95% interval

Both systems are scored on the same resampled examples (Koehn 2004; sacreBLEU's paired
bootstrap), so what the two share (hard sentences, easy ones) cancels. Several tasks are
resampled independently, each from its own examples (a stratified bootstrap), and several seeds
of a system are averaged on the same resample. The interval is the percentile one; with the
default 2,000 resamples its ends move by about 2% of its width between seeds of the bootstrap.
"""

from collections.abc import Callable, Mapping, Sequence
import dataclasses

import numpy as np

SAMPLES = 2_000
LEVEL = 0.95


@dataclasses.dataclass(frozen=True)
class Interval:
  """A difference (B - A) on all examples and its bootstrap interval."""

  estimate: float
  low: float
  high: float
  level: float = LEVEL

  @property
  def excludes_zero(self) -> bool:
    return self.low > 0 or self.high < 0

  def __str__(self) -> str:
    return f'{self.estimate:+.2f} [{self.low:+.2f}, {self.high:+.2f}]'

  def as_dict(self) -> dict[str, float]:
    return dataclasses.asdict(self)


def bootstrap(
    difference: Callable[[Sequence[np.ndarray]], float],
    sizes: Sequence[int],
    *,
    samples: int = SAMPLES,
    seed: int = 0,
    level: float = LEVEL,
) -> Interval:
  """`difference(indices)` on all examples and the percentile interval of its resamples.

  sizes: the number of examples of each group (task); `indices` holds one index array per
    group, drawn with replacement from that group alone.
  """
  if not sizes or min(sizes) < 1:
    raise ValueError(f'every group needs at least one example; sizes {list(sizes)}')
  if not 0 < level < 1:
    raise ValueError(f'level={level} must lie in (0, 1)')
  rng = np.random.default_rng(seed)
  estimate = float(difference([np.arange(n) for n in sizes]))
  draws = np.array([difference([rng.integers(0, n, n) for n in sizes]) for _ in range(samples)])
  low, high = np.quantile(draws, [(1 - level) / 2, (1 + level) / 2])
  return Interval(estimate, float(low), float(high), level)


def glue_difference(
    tasks: Mapping[
        str, tuple[Sequence[float], Sequence[Sequence[float]], Sequence[Sequence[float]]]
    ],
    metric: str = 'score',
    **kwargs,
) -> Interval:
  """B - A of the average GLUE score over `tasks`: task -> (labels, A's predictions per seed,
  B's predictions per seed), every prediction list in the labels' order (the dev file's).
  Each task's score is `glue_metrics`' `metric` (x100: 'score', GLUE's, or one of the task's
  own, e.g. 'spearman' for STS-B), averaged over the seeds of its system."""
  from lowrank_attn.tasks.glue import glue_metrics  # pylint: disable=g-import-not-at-top

  names = sorted(tasks)
  prepared = []
  for name in names:
    labels, a, b = tasks[name]
    labels = np.asarray(labels, np.float64)
    a, b = (np.asarray(x, np.float64).reshape(-1, len(labels)) for x in (a, b))
    if not (len(a) and len(b)):
      raise ValueError(f'{name}: both systems need predictions of at least one seed')
    prepared.append((name, labels, a, b))

  def score(name, predictions, labels):
    return np.mean([glue_metrics(name, p, labels)[metric] for p in predictions])

  def difference(indices):
    return np.mean(
        [
            score(name, b[:, i], labels[i]) - score(name, a[:, i], labels[i])
            for (name, labels, a, b), i in zip(prepared, indices)
        ]
    )

  return bootstrap(difference, [len(labels) for _, labels, _, _ in prepared], **kwargs)


def corpus_bleu(references: Sequence[str], hypotheses: Sequence[str], tokenize: str = '13a'):
  """sacreBLEU's corpus BLEU (one reference per sentence), as the final evaluation scores it."""
  from sacrebleu.metrics import BLEU  # pylint: disable=g-import-not-at-top

  return BLEU(tokenize=tokenize).corpus_score(list(hypotheses), [list(references)]).score


def bleu_difference(
    references: Sequence[str],
    system_a: Sequence[str] | Sequence[Sequence[str]],
    system_b: Sequence[str] | Sequence[Sequence[str]],
    *,
    tokenize: str = '13a',
    **kwargs,
) -> Interval:
  """B - A in corpus BLEU (sacreBLEU, one reference per sentence): each resample sums the
  sentences' n-gram statistics, as sacreBLEU's own paired bootstrap does. A system is one
  list of hypotheses or a list of them (seeds): its BLEU is then the mean of its seeds' corpus
  BLEU on the same resample."""
  return bleu_contrast(references, [system_a, system_b], [-1.0, 1.0], tokenize=tokenize, **kwargs)


def bleu_contrast(
    references: Sequence[str],
    systems: Sequence[Sequence[str] | Sequence[Sequence[str]]],
    weights: Sequence[float],
    *,
    tokenize: str = '13a',
    **kwargs,
) -> Interval:
  """sum_k weights[k] * BLEU(systems[k]) on the same resampled sentences: B - A is weights
  (-1, 1); a difference of differences, (D - C) - (B - A), is (1, -1, -1, 1) over A, B, C, D.
  Systems as in `bleu_difference` (one list of hypotheses, or one per seed, averaged)."""
  from sacrebleu.metrics import BLEU  # pylint: disable=g-import-not-at-top

  if len(systems) != len(weights) or not systems:
    raise ValueError(f'{len(systems)} systems and {len(weights)} weights: one weight each')
  seeds = [[s] if isinstance(s[0], str) else list(s) for s in systems]
  lengths = {len(h) for system in seeds for h in system}
  if lengths != {len(references)}:
    raise ValueError(
        f'{len(references)} references, hypotheses of lengths {sorted(lengths)}: every '
        'system must translate every sentence'
    )
  bleu = BLEU(tokenize=tokenize)
  stats = [
      [
          np.asarray(bleu._extract_corpus_statistics(list(hyps), [list(references)]))  # pylint: disable=protected-access
          for hyps in system
      ]
      for system in seeds
  ]
  corpus = lambda counts: bleu._compute_score_from_stats(list(counts.sum(0))).score  # pylint: disable=protected-access

  def contrast(indices):
    (i,) = indices
    return sum(w * np.mean([corpus(c[i]) for c in system]) for w, system in zip(weights, stats))

  return bootstrap(contrast, [len(references)], **kwargs)
