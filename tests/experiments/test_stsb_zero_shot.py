"""The STS-B zero-shot scripts' intervals: Spearman differences against scipy's, kept
similarities that must reproduce the recorded figures, a fine-tuned run's predictions paired
only with the same dev pairs."""

import json

import numpy as np
import pytest
from scipy import stats as scipy_stats

from experiments.collaborative import stsb_zero_shot
from experiments.glue import zero_shot


def _entries(n=400, seed=0):
  """Gold scores and three systems' similarities: the original close to the gold, two
  conversions noisier (SVD the noisiest), all correlated through the gold."""
  rng = np.random.default_rng(seed)
  labels = np.round(rng.uniform(0, 5, n), 2)
  noise = {'original@384': 0.6, 'collaborative@64': 0.9, 'per_head_svd@64': 1.5}
  entries = {k: list(np.round(labels / 5 + rng.normal(0, s, n) / 5, 6)) for k, s in noise.items()}
  # At full width the conversions are exact: the original's similarities, compared with none.
  for name in ('collaborative@384', 'per_head_svd@384'):
    entries[name] = entries['original@384']
  return [float(x) for x in labels], entries


def _results(labels, entries):
  out = []
  for name, sims in entries.items():
    method, key_dim = name.split('@')
    rho = scipy_stats.spearmanr(sims, labels).statistic
    out.append({'method': method, 'key_dim': int(key_dim), 'spearman': 100 * rho})
  return out


def test_intervals_are_spearman_differences_of_the_kept_similarities():
  labels, entries = _entries()
  results = _results(labels, entries)
  # Recorded as scipy computes them; the script recomputes them with the library's ranks.
  intervals = stsb_zero_shot.compute_intervals(results, {'labels': labels, 'entries': entries})
  rho = {f"{r['method']}@{r['key_dim']}": r['spearman'] for r in results}
  (vs_svd,) = [i for i in intervals['vs_original'] if i['b'] == 'per_head_svd@64']
  assert vs_svd['a'] == 'original@384'
  assert vs_svd['estimate'] == pytest.approx(rho['per_head_svd@64'] - rho['original@384'], abs=1e-6)
  assert vs_svd['low'] < vs_svd['estimate'] < vs_svd['high'] < 0  # clearly worse, paired
  assert {i['b'] for i in intervals['vs_original']} == {'collaborative@64', 'per_head_svd@64'}
  (methods,) = intervals['methods']  # collaborative minus SVD at 64 (none at full width)
  assert (methods['a'], methods['b']) == ('per_head_svd@64', 'collaborative@64')
  assert methods['estimate'] == pytest.approx(
      rho['collaborative@64'] - rho['per_head_svd@64'], abs=1e-6
  )


def test_a_recorded_figure_the_kept_similarities_do_not_give_is_refused():
  labels, entries = _entries()
  results = _results(labels, entries)
  results[1]['spearman'] += 0.01  # collaborative@64
  with pytest.raises(ValueError, match='collaborative@64: Spearman .* recorded'):
    stsb_zero_shot.compute_intervals(results, {'labels': labels, 'entries': entries})


def test_a_finetuned_runs_predictions_are_compared_on_the_same_pairs(tmp_path):
  labels, entries = _entries()
  cosine, predictions = entries['original@384'], entries['per_head_svd@64']
  kept = tmp_path / 'validation_predictions.json'
  kept.write_text(json.dumps({'predictions': predictions, 'labels': labels}))
  result = zero_shot.versus_finetuned(np.asarray(cosine), np.asarray(labels), kept)
  expected = 100 * (
      scipy_stats.spearmanr(predictions, labels).statistic
      - scipy_stats.spearmanr(cosine, labels).statistic
  )
  difference = result['minus_zero_shot']['spearman']
  assert difference['estimate'] == pytest.approx(expected, abs=1e-6)
  assert difference['low'] < difference['estimate'] < difference['high']
  assert result['spearman'] == pytest.approx(
      100 * scipy_stats.spearmanr(predictions, labels).statistic, abs=1e-9
  )
  # Predictions of another order (or another split) are refused, not paired wrongly.
  kept.write_text(json.dumps({'predictions': predictions, 'labels': labels[::-1]}))
  with pytest.raises(ValueError, match='not STS-B dev'):
    zero_shot.versus_finetuned(np.asarray(cosine), np.asarray(labels), kept)
