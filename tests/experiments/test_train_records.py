"""experiments/bottleneck/train_records.py: what the training column's records covered."""

import json
import math

import numpy as np
import pytest

from experiments.bottleneck import train_records

TOKENS_PER_STEP = 4 * 8  # per_device_batch_size x max_length below


def _run(tmp_path, records, *, every=10, total=30):
  run = tmp_path / 'run-s0'
  run.mkdir()
  config = {
      'per_device_batch_size': 4,
      'data': {'max_length': 8},
      'eval_every_steps': every,
      'num_train_steps': total,
      'log_every_steps': 5,
      'progress_every_secs': 5.0,
  }
  (run / 'config.json').write_text(json.dumps(config))
  (run / 'attempts.jsonl').write_text(
      json.dumps({'attempt': 1, 'code': {'commit': 'a' * 40}}) + '\n' + json.dumps({'end': 1})
  )
  lines = [{'split': 'eval', 'step': s, 'loss': 1.0} for s in range(every, total + 1, every)]
  lines += [
      {'split': 'train', 'step': step, 'loss': loss, 'tokens': steps * TOKENS_PER_STEP}
      for step, loss, steps in records
  ]
  (run / 'metrics.jsonl').write_text(''.join(json.dumps(x) + '\n' for x in lines))
  return run


def test_each_interval_reports_its_records_steps_mean_and_standard_error(tmp_path):
  records = [(5, 2.0, 2), (10, 1.8, 3), (15, 1.5, 5), (20, 1.3, 1), (25, 1.2, 4), (30, 1.0, 2)]
  run = _run(tmp_path, records)
  out = tmp_path / 'out.json'
  train_records.main([str(run), f'--out={out}'])
  entry = json.loads(out.read_text())['run-s0']
  assert entry['commits'] == ['aaaaaaa'] and entry['last_step'] == 30
  assert [i['end'] for i in entry['intervals']] == [10, 20, 30]
  for interval, pair in zip(entry['intervals'], np.reshape(records, (3, 2, 3))):
    bits = pair[:, 1] / np.log(2)
    assert interval['records'] == 2 and interval['steps'] == 10
    assert interval['steps_covered'] == pair[:, 2].sum()
    assert interval['mean_bits_per_char'] == pytest.approx(bits.mean(), abs=1e-5)
    assert interval['sd'] == pytest.approx(bits.std(ddof=1), abs=1e-5)
    assert interval['standard_error'] == pytest.approx(bits.std(ddof=1) / math.sqrt(2), abs=1e-5)
  # A second run is added; the first kept.
  other = tmp_path / 'other'
  other.mkdir()
  _run(other, records)
  train_records.main([str(other / 'run-s0'), f'--out={out}'])
  assert list(json.loads(out.read_text())) == ['run-s0']
  (other / 'run-s0').rename(other / 'run-s1')
  train_records.main([str(other / 'run-s1'), f'--out={out}'])
  assert list(json.loads(out.read_text())) == ['run-s0', 'run-s1']


def test_an_interval_with_one_record_is_left_out_and_a_step_fraction_refused(tmp_path):
  run = _run(tmp_path, [(5, 2.0, 1), (15, 1.5, 2), (20, 1.4, 2), (30, 1.0, 1)])
  assert [i['end'] for i in train_records.read(run)['intervals']] == [20]
  run.rename(tmp_path / 'old')
  run = _run(tmp_path, [(5, 2.0, 1), (10, 1.5, 1.5)])
  with pytest.raises(ValueError, match='not whole steps'):
    train_records.read(run)
