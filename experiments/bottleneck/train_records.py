"""How much of each evaluation interval the *train bits/char* column saw, and its noise.

    python -m experiments.bottleneck.train_records RUN_DIR [RUN_DIR ...]

`convergence.collect`'s training column (and each run's `train_curve`) is the mean of the training
records logged in an interval of `eval_every_steps` steps. Up to `convergence.LOGGING_FIX` a record
was the mean over the steps since the step metrics were last fetched (for a save, an evaluation or
the progress line every `progress_every_secs`), not since the previous record: on a slow machine a
few of its `log_every_steps` steps. The runs of the bottleneck tables that trained so (each
section's header counts them: `convergence.train_records_note`) have lost their directories once
collected, so this reads the directories that still exist (the grid's runs in progress) and
records, per interval: the records, the steps they covered (their `tokens` over the tokens of one
step, one device per run), the mean in bits/char and its standard error from the records' spread
(which also holds the loss's drift over the interval, so it overstates the sampling error a
little). Runs are added to `convergence/train_records.json` (a run read again replaces its entry),
so the file grows as runs pass through this machine.
"""

import argparse
import json
import math
import pathlib
import statistics

from experiments import runner
from experiments.bottleneck import convergence

OUT = convergence.OUT / convergence.TRAIN_RECORDS


def intervals(train: list[dict], every: int, tokens_per_step: int) -> list[dict]:
  """Per interval (end - every, end] with at least two records: what they covered and their mean."""
  out = []
  last = max((r['step'] for r in train), default=0)
  for end in range(every, last + 1, every):
    inside = [r for r in train if end - every < r['step'] <= end]
    if len(inside) < 2:
      continue
    bits = [r['loss'] / math.log(2) for r in inside]
    steps = [r['tokens'] / tokens_per_step for r in inside]
    if any(s != int(s) or s < 1 for s in steps):
      raise ValueError(
          f'records of {steps} steps at {tokens_per_step} tokens a step (per_device_batch_size '
          'x max_length: one device per run assumed): not whole steps'
      )
    sd = statistics.stdev(bits)
    out.append(
        {
            'end': end,
            'records': len(inside),
            'steps_covered': int(sum(steps)),
            'steps': every,
            'mean_bits_per_char': round(statistics.fmean(bits), 5),
            'sd': round(sd, 5),
            'standard_error': round(sd / math.sqrt(len(bits)), 5),
        }
    )
  return out


def read(rundir: pathlib.Path) -> dict:
  config = json.loads((rundir / 'config.json').read_text())
  tokens_per_step = config['per_device_batch_size'] * config['data']['max_length']
  commits = sorted(
      {
          a['code']['commit'][:7]
          for a in map(json.loads, (rundir / 'attempts.jsonl').read_text().splitlines())
          if 'code' in a
      }
  )
  train = [m for m in runner.read_metrics(rundir) if m['split'] == 'train']
  return {
      'commits': commits,
      'num_train_steps': config['num_train_steps'],
      'log_every_steps': config['log_every_steps'],
      'progress_every_secs': config.get('progress_every_secs'),
      'last_step': max((m['step'] for m in train), default=0),
      'intervals': intervals(train, config['eval_every_steps'], tokens_per_step),
  }


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('rundirs', nargs='+')
  parser.add_argument('--out', default=str(OUT))
  args = parser.parse_args(argv)
  out = pathlib.Path(args.out)
  runs = json.loads(out.read_text()) if out.exists() else {}
  for rundir in map(pathlib.Path, args.rundirs):
    runs[rundir.name] = read(rundir)
  out.write_text(json.dumps(dict(sorted(runs.items())), indent=1) + '\n')
  for name, run in runs.items():
    late = [i for i in run['intervals'] if i['end'] > run['num_train_steps'] / 4]
    if late:
      errors = [i['standard_error'] for i in late]
      covered = [i['steps_covered'] for i in late]
      print(
          f'{name}: {len(late)} intervals past step {run["num_train_steps"] // 4} (where the '
          f'loss drifts little), {min(covered)}-{max(covered)} of {late[0]["steps"]} steps '
          f'covered, standard error {min(errors):.4f}-{max(errors):.4f} (median '
          f'{statistics.median(errors):.4f})'
      )
  return runs


if __name__ == '__main__':
  main()
