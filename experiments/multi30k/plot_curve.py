"""Learning curve of a translation run: BLEU and eval loss against training wall-clock minutes.

    python -m experiments.multi30k.plot_curve --workdir=/work/runs/multi30k/base \
        --out=experiments/multi30k/curve.png

Reads `<workdir>/metrics.jsonl`: train lines carry `train_secs` (timed training seconds of the
process, compilation, evaluation and checkpointing excluded) and eval lines the loss and BLEU
at their step. A resumed run restarts `train_secs` from 0 in its new process; the curve adds
the time its earlier process had reached at the step it resumed from. An eval step without a
train line of its own gets the time interpolated between its neighbours. Writes a two-panel
plot (matplotlib) and prints a markdown table (step, minutes, eval loss, BLEU); the final
evaluation's test BLEU, when present, is marked on the BLEU panel and printed below.
"""

import argparse
import json
import os
import pathlib

import numpy as np

METRICS_FILE = 'metrics.jsonl'  # as lowrank_attn.train.metrics.METRICS_FILE


def read_lines(workdir) -> list[dict]:
  """metrics.jsonl in file order (a line cut short by a kill is skipped)."""
  out = []
  with open(pathlib.Path(workdir) / METRICS_FILE) as f:
    for line in f:
      try:
        entry = json.loads(line)
        int(entry['step']), str(entry['split'])
      except (ValueError, KeyError, TypeError):
        continue
      out.append(entry)
  return out


def training_seconds(lines: list[dict]) -> dict[int, float]:
  """Step -> cumulative training seconds, over the processes of a resumed run.

  A process's train lines have increasing steps and `train_secs`; a line whose step or
  `train_secs` does not increase starts a new process, which resumed from a checkpoint at or
  before that step: its seconds are added to those the run had reached at its first step
  (interpolated on the earlier lines), and the later lines replace the earlier ones.
  """
  at: dict[int, float] = {}
  last_step, last_secs, offset = None, None, 0.0
  for entry in lines:
    if entry['split'] != 'train' or 'train_secs' not in entry:
      continue
    step, secs = int(entry['step']), float(entry['train_secs'])
    if last_step is not None and (step <= last_step or secs < last_secs):
      # Resumed: the new process's clock starts near its first step.
      earlier = sorted(at.items())  # the earlier process's lines, also those after `step`
      offset = float(np.interp(step, *zip(*earlier))) - secs if earlier else 0.0
      offset = max(offset, 0.0)
      at = {s: t for s, t in at.items() if s < step}
    at[step] = offset + secs
    last_step, last_secs = step, secs
  return at


def curve(lines: list[dict], split: str = 'eval') -> list[dict]:
  """One row per eval step (the last line of each step): step, minutes, loss, bleu."""
  seconds = training_seconds(lines)
  if not seconds:
    raise ValueError(
        'no train line with train_secs in metrics.jsonl: this run was made before '
        'the training loop logged train_secs.'
    )
  steps, secs = zip(*sorted(seconds.items()))
  evals = {int(e['step']): e for e in lines if e['split'] == split}
  rows = []
  for step in sorted(evals):
    entry = evals[step]
    bleu = entry.get('bleu', entry.get('bleu_greedy'))
    rows.append(
        {
            'step': step,
            'minutes': float(np.interp(step, steps, secs)) / 60.0,
            'loss': entry.get('loss'),
            'bleu': bleu,
        }
    )
  return rows


def final_test(lines: list[dict], rows: list[dict]) -> dict | None:
  """The final evaluation's test line (at the last eval step), if the run has one."""
  tests = [e for e in lines if e['split'] == 'test']
  if not tests or not rows:
    return None
  entry = tests[-1]
  bleu = entry.get('bleu', entry.get('bleu_greedy'))
  minutes = next((r['minutes'] for r in rows if r['step'] == entry['step']), rows[-1]['minutes'])
  return {
      'step': int(entry['step']),
      'minutes': minutes,
      'loss': entry.get('loss'),
      'bleu': bleu,
      'chrf': entry.get('chrf'),
      'sentences': entry.get('sentences'),
  }


def markdown_table(rows: list[dict]) -> str:
  fmt = lambda v, spec: '–' if v is None else format(v, spec)
  out = ['| step | minutes | eval loss | BLEU |', '|---:|---:|---:|---:|']
  out += [
      f'| {r["step"]} | {r["minutes"]:.1f} | {fmt(r["loss"], ".3f")} | '
      f'{fmt(r["bleu"], ".2f")} |'
      for r in rows
  ]
  return '\n'.join(out)


def plot(rows: list[dict], out: str, title: str, test: dict | None = None) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, (top, bottom) = plt.subplots(2, 1, figsize=(6, 6), sharex=True)
  with_bleu = [r for r in rows if r['bleu'] is not None]
  top.plot(
      [r['minutes'] for r in with_bleu], [r['bleu'] for r in with_bleu], 'o-', label='validation'
  )
  if test is not None and test['bleu'] is not None:
    top.plot(
        [test['minutes']],
        [test['bleu']],
        '*',
        markersize=12,
        label=f'test (final): {test["bleu"]:.1f}',
    )
  top.set_ylabel('BLEU')
  top.grid(alpha=0.3)
  top.legend(loc='lower right')
  with_loss = [r for r in rows if r['loss'] is not None]
  bottom.plot([r['minutes'] for r in with_loss], [r['loss'] for r in with_loss], 'o-')
  bottom.set_ylabel('eval loss')
  bottom.set_xlabel('training wall-clock minutes (evaluation and checkpoints excluded)')
  bottom.grid(alpha=0.3)
  fig.suptitle(title)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  fig.savefig(out, dpi=120)
  plt.close(fig)


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(
      description=__doc__.split('\n\n')[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument('--workdir', required=True, help='the training run (its metrics.jsonl)')
  parser.add_argument('--out', required=True, help='the plot (.png)')
  parser.add_argument('--split', default='eval', help="eval lines to plot (default 'eval')")
  parser.add_argument('--title', default=None, help='plot title (default: the run directory)')
  args = parser.parse_args(argv)
  if not (pathlib.Path(args.workdir) / METRICS_FILE).exists():
    parser.exit(2, f'plot_curve: {args.workdir} has no {METRICS_FILE}.\n')
  lines = read_lines(args.workdir)
  try:
    rows = curve(lines, args.split)
  except ValueError as e:
    parser.exit(2, f'plot_curve: {e}\n')
  if not rows:
    parser.exit(2, f'plot_curve: {args.workdir} has no {args.split!r} lines yet.\n')
  test = final_test(lines, rows)
  plot(rows, args.out, args.title or os.path.basename(os.path.abspath(args.workdir)), test)
  print(markdown_table(rows))
  if test is not None and test['bleu'] is not None:
    fmt = lambda v, spec: '–' if v is None else format(v, spec)
    print(
        f'\nFinal test (step {test["step"]}, {test["minutes"]:.1f} min): BLEU '
        f'{test["bleu"]:.2f}, chrF {fmt(test["chrf"], ".2f")}, loss {fmt(test["loss"], ".3f")}, '
        f'{fmt(test["sentences"], ".0f")} sentences.'
    )
  print(f'\nwrote {args.out}')
  return rows


if __name__ == '__main__':
  main()
