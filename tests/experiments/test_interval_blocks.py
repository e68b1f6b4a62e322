"""experiments/bottleneck/interval_blocks.py: the block-length check of the paired interval."""

import numpy as np
import pytest

from experiments import runner
from experiments.bottleneck import interval_blocks


def _results(path, runs):
  entries = [
      {
          'name': name,
          'result': {
              'final_eval': {'row_nll': list(nll), 'row_tokens': [128] * len(nll), 'rows_digest': d}
          },
      }
      for name, (nll, d) in runs.items()
  ]
  entries.append({'name': 'old', 'result': {'final_eval': {'loss': 1.0}}})  # no rows: left out
  runner.files.write_json(path, {'runs': entries})


def test_a_difference_shared_by_blocks_of_32_rows_correlates_within_them_and_not_beyond(tmp_path):
  """Per-row differences constant over runs of 32 rows, independent between them: the lag
  correlation is (32 - lag) / 32 of the whole within a block and 0 past it (plain formula),
  and the interval's width grows with the block up to 32 rows and then no more (within noise)."""
  rng = np.random.default_rng(0)
  rows = 32 * 400
  a = rng.normal(180, 20, rows)
  b = a - np.repeat(rng.normal(0, 10, rows // 32), 32)
  path = tmp_path / 'results.json'
  _results(path, {'a': (a, 'x'), 'b': (b, 'x')})
  out = interval_blocks.main([f'--results={path}', f'--out={tmp_path / "blocks.json"}'])
  (pair,) = out['pairs']
  assert (pair['a'], pair['b'], pair['rows']) == ('a', 'b', rows)
  corr = pair['lag_correlation']
  # 12,800 rows: a correlation estimate errs by about 1 / sqrt(12,800) = 0.009.
  for lag in (1, 8, 16):
    assert corr[lag] == pytest.approx((32 - lag) / 32, abs=0.05)
  assert abs(corr[32]) < 0.05 and abs(corr[64]) < 0.05
  width = pair['interval_width']
  assert width[32] / width[1] == pytest.approx(np.sqrt(32), rel=0.2)  # sqrt of the block
  assert width[64] / width[32] == pytest.approx(1.0, rel=0.2)
  assert runner.files.read_json(tmp_path / 'blocks.json')['pairs'][0]['a'] == 'a'


def test_runs_scored_on_other_text_are_refused(tmp_path):
  path = tmp_path / 'results.json'
  _results(path, {'a': (np.ones(64), 'x'), 'b': (np.ones(64), 'y')})
  with pytest.raises(ValueError, match='different validation rows'):
    interval_blocks.main([f'--results={path}', f'--out={tmp_path / "blocks.json"}'])
