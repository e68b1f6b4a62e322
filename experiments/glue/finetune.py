r"""GLUE fine-tuning of the pretrained all-MiniLM-L6-v2: dev scores and the minutes each took.

    python -m experiments.glue.finetune --runs_dir=/work/runs/glue_finetune \
        [--tasks=stsb,rte,mrpc,cola,sst2] [--seeds=0] [--smoke]

One run per task and seed of `configs/glue.py:<task>` (BERT's recipe, see that file), through
the experiment runner (resumable: rerun the command; finished runs are skipped). Results: each
run's final evaluation on the whole dev set (the GLUE metrics, x100) and its wall-clock
minutes, in `results.json` and the table of README.md (written by this script). `--smoke`:
`configs/glue.py:tiny` for 6 steps on RTE, results under --runs_dir.

The zero-shot reference of the issue (all-MiniLM-L6-v2's mean-pooled cosine similarity on STS-B
dev: Spearman 86.7) is checked by `tests/tasks/test_glue.py`.
"""

import dataclasses
import pathlib

from experiments import runner

HERE = pathlib.Path(__file__).resolve().parent
TASKS = ('stsb', 'rte', 'mrpc', 'cola', 'sst2')
# The metrics GLUE reports per task (x100), then the task's score.
METRICS = {
    'cola': ('matthews',),
    'sst2': ('accuracy',),
    'mrpc': ('f1', 'accuracy'),
    'rte': ('accuracy',),
    'stsb': ('pearson', 'spearman'),
}


def arguments():
  parser = runner.arg_parser(__doc__, 'glue_finetune')
  parser.add_argument('--tasks', default=','.join(TASKS))
  parser.add_argument('--seeds', default='0')
  parser.add_argument('--smoke', action='store_true')
  args = parser.parse_args()
  args.tasks = args.tasks.split(',')
  args.seeds = [int(s) for s in args.seeds.split(',')]
  unknown = sorted(set(args.tasks) - set(TASKS))
  if unknown:
    parser.error(f'--tasks: {unknown} are not GLUE tasks here; valid: {",".join(TASKS)}')
  args.out = HERE
  if args.smoke:
    args.tasks, args.seeds = ['rte'], [0]
    args.out = pathlib.Path(args.runs_dir) / 'smoke_results'
  return args


def main():
  args = arguments()
  runs = []
  for seed in args.seeds:
    for task in args.tasks:
      config = 'configs/glue.py:tiny' if args.smoke else f'configs/glue.py:{task}'
      overrides = {'num_train_steps': 6, 'checkpoint_every_steps': 3} if args.smoke else {}
      run = runner.train_run(f'{task}-s{seed}', config, seed=seed, overrides=overrides)
      runs.append(dataclasses.replace(run, config={'task': task, **run.config}))
  if args.plot_only:
    results = runner.load_results(args.out)
  else:
    results = runner.run_grid(runs, args.out, runs_dir=args.runs_dir, **runner.grid_options(args))
  report(results, args)


def report(results, args) -> None:
  rows = [r for r in runner.final(results, 'validation') if 'score' in r]
  if not rows:
    print('no finished run has a final dev evaluation yet')
    return
  rows.sort(key=lambda r: (TASKS.index(r['task']), r['seed']))
  metric = lambda r: ', '.join(f'{name} {r[name]:.2f}' for name in METRICS[r['task']])
  # All attempts of a run stopped and resumed across sessions, and how many there were.
  minutes = lambda r: f"{r['wall_time_total_s'] / 60:.0f}" + (
      f" ({r['attempts']})" if r['attempts'] > 1 else ''
  )
  table = runner.markdown_table(
      rows,
      [
          ('task', 'task'),
          ('seed', 'seed'),
          ('dev examples', lambda r: f"{r['examples']:,.0f}"),
          ('dev metrics (x100)', metric),
          ('score', lambda r: f"{r['score']:.2f}"),
          ('steps', lambda r: f"{r['step']:,}"),
          ('minutes (attempts)', minutes),
      ],
  )
  (args.out / 'results.md').write_text(table)
  if not args.smoke:
    runner.write_section(
        HERE / 'README.md', 'finetune', '\n'.join([runner.runs_summary(results), '', table])
    )


if __name__ == '__main__':
  main()
