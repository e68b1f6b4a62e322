r"""Table 3 of Cordonnier et al. (2020) at MiniLM scale: GLUE after re-parametrizing the encoder.

    python -m experiments.collaborative.glue_reparam --runs_dir=/work/runs/glue_reparam \
        [--tasks=rte,mrpc,stsb,cola,sst2] [--key_dims=384,256,192,128,96,64,48]
        [--methods=collaborative,collaborative_rescaled,per_head_svd] [--seeds=0,1,2]
        [--decompose=finetuned|pretrained] [--second_epochs=E] [--second_learning_rate=LR]
        [--parallel=N] [--plot_only] [--smoke]

The paper's protocol (its code's README, `run_glue.py --mix_heads --mix_size D~k`): fine-tune
the pretrained encoder on the task, decompose the fine-tuned model's attention into
collaborative heads of shared key width D~k, then fine-tune again with the same recipe. Here:
  1. `<task>-original-s<seed>`: all-MiniLM-L6-v2 fine-tuned with `configs/glue.py:<task>`
     (BERT's recipe; the paper used lr 2e-5 for BERT-base, ours is the config's 5e-5);
  2. each method at each D~k converts that run's encoder (`reparametrize_nmt.convert`:
     CP with the original logit scale, CP with the paper's code's rescaled logits, or per-head
     SVD at equal width), written as a run directory (`lowrank_attn.reparam.write_run`);
  3. `<task>-<method>-k<D~k>-s<seed>` fine-tunes it with the same config (per-head SVD with its
     block one-hot mixing frozen, so it stays concat heads), and `<task>-original-again-s<seed>`
     fine-tunes the unconverted model the same way: the control for what a second fine-tune
     does on its own;
  4. `<task>-<method>-k<D~k>-s<seed>-before`: the converted model as converted, scored on the
     dev set without training (one step at learning rate 0, `BEFORE`: Adam's and the weight
     decay's updates are both scaled by it), so a loss after step 3 can be told apart from a
     conversion the fine-tune did not recover from; its own table, against the original.
`--second_epochs` / `--second_learning_rate` give the fine-tune after the conversion and its
control another budget (the paper's code: 3 epochs at 2e-5, 10 for RTE and SST-2): runs
`...-e<E>-lr<LR>-s<seed>`, results in `glue/e<E>-lr<LR>/` (the before runs are shared; with
`pretrained` the control is the pretrained encoder fine-tuned with that budget,
`<task>-original-e<E>-lr<LR>-s<seed>`).
`--decompose=pretrained` converts the pretrained MiniLM instead and fine-tunes once, against
step 1's original (the same fine-tune, unconverted): the issue's other reading, and a test of
whether the protocol matters (runs `<task>-pretrained-<method>-k<D~k>-s<seed>`, results in
`glue/pretrained/`).

Each run's final evaluation on the whole dev set (GLUE metrics x100) and its per-example
predictions (`final_eval/<step>/validation_predictions.json`), copied next to this script in
`glue/predictions/` as runs finish, feed the table: the task scores (mean over seeds), their
average, and a 95% bootstrap interval over dev examples for the difference of each row's
average to the original's (`experiments.stats`), then each other method minus CP at the same
D~k. Beside it, the paper's BERT-base rows; the plot `difference_vs_width.png` draws the
differences against D / D~k beside the paper's.
Each conversion's relative errors are kept in `glue/conversions.json` (by run name), so that
`--plot_only` redraws the tables and plots from committed files alone (no run directory, no
conversion).

Cost, measured on the 2-core CPU with nothing beside it (sixteenth session): one fine-tune of
MiniLM takes 8-9 minutes on RTE, 11 on MRPC (20 in the seventeenth session: the machine a session
gets varies), 18 on STS-B (28-31 in the nineteenth), 17-19 on CoLA (eighteenth) and 85-100 on
SST-2 (0.8 s a step), 1.5-2x that beside a test run; a conversion scored as converted 1-4 minutes.
The full grid is ~23 fine-tunes per task and seed: a GPU job (`--parallel`). Runs are resumable
(rerun the command) and results.json holds every finished run.
"""

import dataclasses
import json
import pathlib
import shutil

import numpy as np

from experiments import runner
from experiments.collaborative.reparametrize_nmt import METHODS, convert

HERE = pathlib.Path(__file__).resolve().parent
OUT = HERE / 'glue'
TASKS = ('rte', 'mrpc', 'stsb', 'cola', 'sst2')
# The tasks an average covers: the small ones, three seeds each. SST-2 (one seed at D~k = 96:
# hours a fine-tune on a CPU) keeps its columns and its own differences, outside the average.
AVERAGED = ('rte', 'mrpc', 'stsb', 'cola')
KEY_DIMS = (384, 256, 192, 128, 96, 64, 48)
PRETRAINED = 'all-MiniLM-L6-v2'
# A converted model scored as it is: one step at learning rate 0 (`num_train_steps` >= 1) moves
# no parameter, and the run's final evaluation is then the conversion's own dev score.
BEFORE = {'num_train_steps': 1, 'learning_rate': 0.0, 'warmup_steps': 0}
# Cordonnier et al. (2020), Table 3 (also the README of epfml/collaborative-attention): BERT-base
# fine-tuned, then re-parametrized at D~k and fine-tuned again; dev scores. MRPC: F1/accuracy,
# STS-B: Pearson/Spearman (the paper's average is over eight tasks; `paper_table` averages ours).
PAPER_BERT_BASE = {
    None: {'cola': 54.7, 'sst2': 91.7, 'mrpc': (88.8, 83.8), 'stsb': (88.8, 88.7), 'rte': 63.2},
    768: {'cola': 56.8, 'sst2': 90.1, 'mrpc': (89.6, 85.1), 'stsb': (89.2, 88.9), 'rte': 65.3},
    384: {'cola': 56.3, 'sst2': 90.7, 'mrpc': (87.7, 82.4), 'stsb': (88.3, 88.0), 'rte': 65.3},
    256: {'cola': 52.6, 'sst2': 90.1, 'mrpc': (88.1, 82.6), 'stsb': (87.5, 87.2), 'rte': 62.5},
    128: {'cola': 43.5, 'sst2': 89.5, 'mrpc': (83.4, 75.2), 'stsb': (84.5, 84.3), 'rte': 60.7},
}
PREDICTIONS = 'validation_predictions.json'
CONSTANT = 'constant prediction (input ignored)'  # the floor row of the tables
REFERENCE = 'collaborative'  # the method the others are compared with, width by width
D = 384  # all-MiniLM-L6-v2's width: the original's D~k
PAPER_D = 768  # BERT-base's
PLOT = 'difference_vs_width.png'


def arguments():
  parser = runner.arg_parser(__doc__, 'glue_reparam')
  parser.add_argument('--tasks', default='rte,mrpc,stsb,cola')
  parser.add_argument('--key_dims', default=','.join(map(str, KEY_DIMS)))
  parser.add_argument('--methods', default=','.join(METHODS))
  parser.add_argument('--seeds', default='0')
  parser.add_argument('--decompose', choices=('finetuned', 'pretrained'), default='finetuned')
  parser.add_argument(
      '--second_epochs',
      type=float,
      default=None,
      help='epochs of the fine-tune after the conversion and of its control (default: the '
      "config's 3)",
  )
  parser.add_argument(
      '--second_learning_rate',
      type=float,
      default=None,
      help="peak learning rate of that fine-tune and its control (default: the config's 5e-5)",
  )
  parser.add_argument(
      '--smoke',
      action='store_true',
      help='configs/glue.py:tiny-sized fine-tunes of 4 steps on RTE, one '
      'method at D~k = 64; results under --runs_dir',
  )
  args = parser.parse_args()
  args.tasks = args.tasks.split(',')
  args.key_dims = [int(k) for k in args.key_dims.split(',')]
  args.methods = args.methods.split(',')
  args.seeds = [int(s) for s in args.seeds.split(',')]
  for name, given, valid in (('tasks', args.tasks, TASKS), ('methods', args.methods, METHODS)):
    if set(given) - set(valid):
      parser.error(
          f'--{name}: {sorted(set(given) - set(valid))} unknown; valid: ' f'{",".join(valid)}'
      )
  # Another budget for the fine-tune after the conversion: its runs and results apart.
  args.variant = ''.join(
      f'-{label}{value:g}'
      for label, value in (('e', args.second_epochs), ('lr', args.second_learning_rate))
      if value is not None
  )
  args.out = OUT if args.decompose == 'finetuned' else OUT / 'pretrained'
  if args.variant:
    args.out = args.out / args.variant[1:]
  args.budget = {}
  if args.smoke:
    args.tasks, args.key_dims, args.methods, args.seeds = ['rte'], [64], ['collaborative'], [0]
    args.budget = {
        'num_train_steps': 4,
        'warmup_steps': 1,
        'checkpoint_every_steps': 2,
        'data.max_length': 32,
    }
    args.out = pathlib.Path(args.runs_dir) / 'smoke_results'
  return args


CONVERSIONS = 'conversions.json'


def main():
  args = arguments()
  runs_dir = pathlib.Path(args.runs_dir).resolve()
  if args.plot_only:  # from the committed files; the predictions run directories still hold
    results = grid([], args, set())
    return report(results, runner.files.read_json(args.out / CONVERSIONS) or {}, args)

  def run(name, task, seed, overrides, fixed=None, **config):
    train = runner.train_run(
        name,
        f'configs/glue.py:{task}',
        seed=seed,
        overrides={**overrides, **args.budget, **(fixed or {})},
    )
    return dataclasses.replace(train, config={'task': task, **config, **train.config})

  def budget(task):
    """The fine-tune after the conversion (and its control): the recipe, or --second_*."""
    import configs.glue  # pylint: disable=g-import-not-at-top  (JAX: after the first grid)

    epochs = (
        {} if args.second_epochs is None else configs.glue.epochs_budget(task, args.second_epochs)
    )
    rate = {} if args.second_learning_rate is None else {'learning_rate': args.second_learning_rate}
    return {**epochs, **rate}

  # The first fine-tune of the pretrained encoder: what `finetuned` converts, and for
  # `pretrained` the control (the conversions fine-tuned once, the same way: with another
  # budget, that budget). The recipe's runs are shared with the other protocol's: a finished
  # one in --runs_dir counts as done, and so does one that results.json records, unless runs
  # still to do start from it and its directory is gone: then it runs again (`needed`).
  own_budget = args.decompose == 'pretrained' and bool(args.variant)
  sources = {}  # (task, seed) -> the run directory the conversions start from
  first, needed = [], set()
  done = runner.recorded(args.out)
  for seed in args.seeds:
    for task in args.tasks:
      name = f'{task}-original{args.variant if own_budget else ""}-s{seed}'
      overrides = budget(task) if own_budget else {}
      first.append(run(name, task, seed, overrides, method='original', key_dim=None, stage=1))
      if args.decompose == 'finetuned':
        sources[task, seed] = runs_dir / name
        if not set(dependents(task, seed, args)) <= done:
          needed.add(name)
  results = grid(first, args, needed)
  if args.decompose == 'finetuned' and len(results['runs']) < len(first):
    return  # the conversions need every fine-tuned original; rerun when they are done

  second, before, errors = [], [], {}
  for seed in args.seeds:
    for task in args.tasks:
      source = sources.get((task, seed), PRETRAINED)
      if args.decompose == 'finetuned':
        second.append(
            run(
                again_name(task, seed, args),
                task,
                seed,
                {'init_from': str(source), **budget(task)},
                method='original',
                key_dim=None,
                stage=2,
            )
        )
      for key_dim in args.key_dims:
        for method in args.methods:
          directory = converted(source, task, seed, method, key_dim, args, runs_dir)
          conversion = json.loads((directory / 'conversion.json').read_text())
          name = second_name(task, seed, method, key_dim, args)
          errors[name] = conversion['relative_errors']
          if args.decompose == 'finetuned':  # the pretrained model has no task head to score
            as_converted = before_name(task, seed, method, key_dim)
            errors[as_converted] = conversion['relative_errors']
            before.append(
                run(
                    as_converted,
                    task,
                    seed,
                    {**conversion['overrides'], 'init_from': str(directory)},
                    fixed=BEFORE,
                    method=method,
                    key_dim=key_dim,
                    stage=0,
                )
            )
          frozen = {'trainable': '^(?!.*mixing)'} if method == 'per_head_svd' else {}
          second.append(
              run(
                  name,
                  task,
                  seed,
                  {
                      **conversion['overrides'],
                      **frozen,
                      'init_from': str(directory),
                      **budget(task),
                  },
                  method=method,
                  key_dim=key_dim,
                  stage=2,
              )
          )
  kept = runner.files.read_json(args.out / CONVERSIONS) or {}
  args.out.mkdir(parents=True, exist_ok=True)
  runner.files.write_json(args.out / CONVERSIONS, {**kept, **errors})
  results = grid(first + before + second, args, needed)
  report(results, errors, args)


def again_name(task: str, seed: int, args) -> str:
  return f'{task}-original-again{args.variant}-s{seed}'


def second_name(task: str, seed: int, method: str, key_dim: int, args) -> str:
  # The protocols share --runs_dir (and the first fine-tune): distinct names.
  protocol = '' if args.decompose == 'finetuned' else 'pretrained-'
  return f'{task}-{protocol}{method}-k{key_dim}{args.variant}-s{seed}'


def before_name(task: str, seed: int, method: str, key_dim: int) -> str:
  return f'{task}-{method}-k{key_dim}-s{seed}-before'  # any budget's


def dependents(task: str, seed: int, args) -> list[str]:
  """The runs that start from the fine-tuned original of `task` and `seed` (protocol
  `finetuned`): its control fine-tuned again, and each conversion as converted and fine-tuned."""
  names = [again_name(task, seed, args)]
  for key_dim in args.key_dims:
    for method in args.methods:
      names += [
          before_name(task, seed, method, key_dim),
          second_name(task, seed, method, key_dim, args),
      ]
  return names


def grid(runs, args, needed):
  if args.plot_only:  # no runs; the predictions their directories still hold are kept first
    results = runner.load_results(args.out)
    keep_predictions(results, args)
    return results
  names = {run.name for run in runs}
  results = runner.run_grid(
      runs,
      args.out,
      runs_dir=args.runs_dir,
      rerun_lost=needed & names,
      **runner.grid_options(args),
  )
  keep_predictions(results, args)
  return results


def converted(source, task, seed, method, key_dim, args, runs_dir) -> pathlib.Path:
  """The run directory of `source` (a fine-tuned run, or the pretrained name) converted."""
  from lowrank_attn import runs  # pylint: disable=g-import-not-at-top  (JAX: after the grid)
  from lowrank_attn.models import bert  # pylint: disable=g-import-not-at-top
  from lowrank_attn.reparam import write_run  # pylint: disable=g-import-not-at-top
  from lowrank_attn.train import state as state_lib  # pylint: disable=g-import-not-at-top

  origin = f'{task}-s{seed}' if source != PRETRAINED else 'pretrained'
  directory = runs_dir / 'converted' / f'{origin}-{method}-k{key_dim}'
  if not (directory / 'conversion.json').exists():
    print(f'converting {origin} by {method} at D~k = {key_dim}', flush=True)
    if directory.exists():
      shutil.rmtree(directory)  # a conversion that was cut off: it writes conversion.json last
    if source == PRETRAINED:
      import configs.glue  # pylint: disable=g-import-not-at-top

      model = bert.load_pretrained(state_lib.pretrained_dir(PRETRAINED))
      config = configs.glue.get_config(task)
    else:
      model, config = runs.RunDir(source).model(), runs.RunDir(source).config
    write_run(
        convert(model, method, key_dim, ['encoder']),
        directory,
        runs.with_overrides(config, args.budget),
    )
  return directory


def keep_predictions(results, args) -> None:
  """Copies each finished run's dev predictions next to the results (the bootstrap reads
  them; run directories may not survive). A run whose directory holds the run its entry
  records (`runner.holds_run`) replaces kept predictions (a run trained again); a run whose
  directory is gone, or holds a run of that name trained since by another experiment that
  shares the runs directory (glue_pruning's originals), keeps what was kept."""
  target = args.out / 'predictions'
  for entry in results['runs']:
    path = target / f'{entry["name"]}.json'
    rundir = pathlib.Path(results['runs_dir'], entry['name'])
    found = sorted(
        rundir.glob(f'final_eval/*/{PREDICTIONS}'),
        key=lambda p: int(p.parent.name),  # the last step's ('10' after '9')
    )
    if found and runner.holds_run(entry, rundir):
      target.mkdir(parents=True, exist_ok=True)
      shutil.copyfile(found[-1], path)


def report(results, errors, args) -> None:
  everything = [r for r in runner.final(results, 'validation') if 'score' in r]
  rows = [r for r in everything if r.get('stage') != 0]
  if not rows:
    print('no finished run has a final dev evaluation yet')
    return
  table, summary = glue_table(rows, args.out / 'predictions', errors)
  # The conversions as converted, against the fine-tuned original they were converted from.
  before_rows = [r for r in everything if r.get('stage') == 0]
  originals = [r for r in rows if r['method'] == 'original' and r['stage'] == 1]
  if before_rows:
    before, before_summary = glue_table(originals + before_rows, args.out / 'predictions', errors)
    table += (
        '\n\nBefore the second fine-tune: each conversion scored as converted (one step at'
        ' learning rate 0), against the fine-tuned original it was converted from:\n\n' + before
    )
    runner.files.write_json(args.out / 'table_before.json', before_summary)
  tasks = [t for t in TASKS if any(r['task'] == t for r in rows)]
  averaged = [t for t in tasks if t in AVERAGED]
  paper = paper_table(tasks, averaged)
  runner.files.write_json(args.out / 'table.json', summary)
  plot_widths(summary, tasks, args.out / PLOT, f'all-MiniLM-L6-v2, {"/".join(tasks)}', averaged)
  (args.out / 'results.md').write_text(table + '\n\n' + paper)
  print(table)
  if args.smoke:
    return
  figure = f'![score minus the control vs key reduction]({args.out.relative_to(HERE)}/{PLOT})'
  section = f'glue_{args.decompose}{args.variant}'  # the README's, one per protocol and budget
  if f'<!-- {section} -->' not in (HERE / 'README.md').read_text():
    print(f'README.md has no section {section}: add <!-- {section} --><!-- /{section} --> to it')
    return
  runner.write_section(
      HERE / 'README.md',
      section,
      '\n'.join(
          [
              runner.runs_summary(results),
              '',
              table,
              '',
              figure,
              '',
              'Cordonnier et al. (2020), Table 3, '
              'BERT-base (dev; average over the tasks above):',
              '',
              paper,
          ]
      ),
  )


def check_score(task: str, predictions, labels, recorded: float, what: str) -> None:
  """Raises ValueError unless kept dev predictions give the score a run recorded (else they
  are not that run's, or not in the labels' order)."""
  from lowrank_attn.tasks.glue import glue_metrics  # pylint: disable=g-import-not-at-top

  recomputed = glue_metrics(task, predictions, labels)['score']
  if abs(recomputed - recorded) > 1e-6:
    raise ValueError(
        f'{what}: its kept predictions score {recomputed:.4f}, {recorded:.4f} recorded'
    )


def _label(row) -> tuple[str, int | None]:
  if row['method'] != 'original':
    return row['method'], row['key_dim']
  return ('original, fine-tuned again' if row['stage'] == 2 else 'original'), None


def glue_table(rows, predictions_dir: pathlib.Path, errors) -> tuple[str, list[dict]]:
  """Mean dev score per task over seeds for each (method, D~k), their average over the
  `AVERAGED` tasks, and B - A of the average against the control with its paired bootstrap
  interval (`experiments.stats`); then B - A of each task alone, with its interval (rows of
  a slice without every task, and tasks outside the average, too).
  A row is paired with the control on the seeds both have, task by task (a seed still
  running on some rows, the control's or the row's, is left out of their comparison, not
  compared with another seed; the cells are each row's own mean).
  Each other method's row is also set against CP's at its D~k, on the seeds both have
  (`reference_differences` per task, `reference_difference` over the tasks)."""
  from experiments import stats  # pylint: disable=g-import-not-at-top  (imports JAX)
  from lowrank_attn.tasks.glue import constant_score  # pylint: disable=g-import-not-at-top

  tasks = [t for t in TASKS if any(r['task'] == t for r in rows)]
  averaged = [t for t in tasks if t in AVERAGED]
  groups = {}
  for row in rows:
    groups.setdefault(_label(row), []).append(row)
  control = (
      ('original, fine-tuned again', None)
      if ('original, fine-tuned again', None) in groups
      else ('original', None)
  )

  def predictions(group_rows, task):
    """Each seed's kept dev predictions and the labels; refused unless they score what the
    run recorded (else they are not that run's, or not in the labels' order)."""
    found = []
    for r in group_rows:
      path = predictions_dir / f'{r["name"]}.json'
      if r['task'] != task or not path.exists():
        continue
      kept = json.loads(path.read_text())
      check_score(task, kept['predictions'], kept['labels'], r['score'], r['name'])
      found.append(kept)
    return ([f['predictions'] for f in found], found[0]['labels']) if found else ([], None)

  def pair_on_shared_seeds(theirs, ours):
    """Task -> (labels, theirs' predictions, ours'), on the seeds both ran the task with: a
    seed only one side has finished is left out, not compared with another seed."""
    paired = {}
    for task in tasks:
      seeds = {r['seed'] for r in theirs if r['task'] == task}
      seeds &= {r['seed'] for r in ours if r['task'] == task}
      a, labels = predictions([r for r in theirs if r['seed'] in seeds], task)
      b, _ = predictions([r for r in ours if r['seed'] in seeds], task)
      if a and b:
        paired[task] = (labels, a, b)
    return paired

  summary = []
  for (method, key_dim), group in sorted(
      groups.items(), key=lambda kv: (kv[0][1] is not None, -(kv[0][1] or 0), kv[0][0])
  ):
    entry = {'method': method, 'key_dim': key_dim, 'seeds': sorted({r['seed'] for r in group})}
    entry['task_seeds'] = {}
    for task in tasks:
      scores = {r['seed']: r['score'] for r in group if r['task'] == task}
      entry[task] = float(np.mean(list(scores.values()))) if scores else None
      entry['task_seeds'][task] = sorted(scores)
    done = [entry[t] for t in averaged if entry[t] is not None]
    entry['average'] = float(np.mean(done)) if averaged and len(done) == len(averaged) else None
    # The conversions' mean relative error, over those conversions.json records (RTE's, run
    # before it existed, are not): a row says when its mean covers only some of its runs.
    names = [r['name'] for r in group]
    errs = [np.mean(list(errors[n].values())) for n in names if n in errors]
    entry['mean_error'] = float(np.mean(errs)) if errs else None
    entry['error_runs'] = [len(errs), len(names)]
    if (method, key_dim) != control:
      paired = pair_on_shared_seeds(groups[control], group)
      # Each task alone (a slice of the grid has rows before it has averages), then the average.
      entry['task_differences'] = {
          task: stats.glue_difference({task: pair}).as_dict() for task, pair in paired.items()
      }
      if entry['average'] is not None and set(averaged) <= set(paired):
        entry['difference'] = stats.glue_difference({t: paired[t] for t in averaged}).as_dict()
    summary.append(entry)
  for entry in summary:  # the other methods against CP at their width, on the seeds both have
    reference = groups.get((REFERENCE, entry['key_dim']))
    if entry['method'] == REFERENCE or not reference:  # (no CP row has the originals' None)
      continue
    paired = pair_on_shared_seeds(reference, groups[entry['method'], entry['key_dim']])
    entry['reference_differences'] = {
        task: stats.glue_difference({task: pair}).as_dict() for task, pair in paired.items()
    }
    if averaged and set(averaged) <= set(paired):
      entry['reference_difference'] = stats.glue_difference(
          {t: paired[t] for t in averaged}
      ).as_dict()
  # The floor: the best single answer for every dev example (a row at it has lost the task).
  # The dev labels are any run's of the task (the control may not have run it yet).
  labels = {t: None for t in tasks}
  for group in groups.values():
    for task in [t for t, found in labels.items() if found is None]:
      labels[task] = predictions(group, task)[1]
  if all(v is not None for v in labels.values()):
    floor = {t: constant_score(t, labels[t]) for t in tasks}
    summary.append(
        {
            'method': CONSTANT,
            'key_dim': None,
            'seeds': [],
            **floor,
            'average': float(np.mean([floor[t] for t in averaged])) if averaged else None,
            'mean_error': None,
            'error_runs': [0, 0],
        }
    )

  cell = lambda v: '' if v is None else f'{v:.2f}'

  def error_cell(e):
    covered, runs = e['error_runs']
    partial = f' ({covered} of {runs} runs)' if 0 < covered < runs else ''
    return cell(e['mean_error']) + partial

  def seeds_cell(e):
    """The seeds a row's means cover: one list, or each task's where they differ."""
    lists = {t: ','.join(map(str, s)) for t, s in e.get('task_seeds', {}).items() if s}
    if len(set(lists.values())) > 1:
      return '; '.join(f'{t} {s}' for t, s in lists.items())
    return ','.join(map(str, e['seeds']))

  diff = lambda e: (str(stats.Interval(**e['difference'])) if 'difference' in e else '')
  average = average_label(tasks, averaged)
  width = lambda e: '' if e['method'] == CONSTANT else (e['key_dim'] or D)
  table = runner.markdown_table(
      summary,
      [
          ('method', 'method'),
          ('D~k', width),
          ('CP / SVD error', error_cell),
      ]
      + [(task, lambda e, t=task: cell(e[t])) for task in tasks]
      + [
          (average, lambda e: cell(e['average'])),
          (f'{average} - {control[0]} [95%]', diff),
          ('seeds', seeds_cell),
      ],
  )
  per_task = runner.markdown_table(
      [e for e in summary if e.get('task_differences')],
      [('method', 'method'), ('D~k', lambda e: e['key_dim'] or D)]
      + [
          (
              f'{task} - {control[0]} [95%]',
              lambda e, t=task: (
                  str(stats.Interval(**e['task_differences'][t]))
                  if t in e['task_differences']
                  else ''
              ),
          )
          for task in tasks
      ],
  )
  text = table + '\n\nEach task alone, the row minus the control (paired bootstrap):\n\n' + per_task
  compared = [e for e in summary if e.get('reference_differences')]
  if compared:
    interval = lambda d: str(stats.Interval(**d)) if d else ''
    text += (
        f'\n\nEach other method minus {REFERENCE} at the same D~k (paired bootstrap, on the'
        f' seeds both rows have; the {average} where every task of it has both):\n\n'
        + runner.markdown_table(
            compared,
            [('method', 'method'), ('D~k', 'key_dim')]
            + [
                (
                    f'{task} - {REFERENCE} [95%]',
                    lambda e, t=task: interval(e['reference_differences'].get(t)),
                )
                for task in tasks
            ]
            + [
                (
                    f'{average} - {REFERENCE} [95%]',
                    lambda e: interval(e.get('reference_difference')),
                )
            ],
        )
    )
  return text, summary


def average_label(tasks, averaged) -> str:
  """'average', or which tasks it covers where some task is outside it."""
  return 'average' if list(averaged) == list(tasks) else f'average of {"/".join(averaged)}'


def paper_score(value) -> float:
  """A Table 3 cell as our score: MRPC's and STS-B's two metrics averaged."""
  return sum(value) / 2 if isinstance(value, tuple) else value


def paper_table(tasks, averaged) -> str:
  """The paper's BERT-base rows for `tasks` (MRPC and STS-B: the mean of their two metrics,
  as our score), with their average over `averaged` (ours' tasks)."""
  average = average_label(tasks, averaged)
  rows = [
      {
          'D~k': 'BERT-base' if k is None else k,
          **{t: paper_score(v[t]) for t in tasks},
          average: np.mean([paper_score(v[t]) for t in averaged]) if averaged else None,
      }
      for k, v in PAPER_BERT_BASE.items()
  ]
  return runner.markdown_table(
      rows,
      [('D~k', 'D~k')]
      + [(t, lambda r, t=t: '' if r[t] is None else f'{r[t]:.2f}') for t in [*tasks, average]],
  )


def width_series(summary, tasks, averaged=None) -> dict[str, dict[str, list]]:
  """What `plot_widths` draws, per panel ('average' over `averaged`, all `tasks` if not
  given, then each task) and line (each method, then the paper's BERT-base): x the key
  reduction D / D~k, y the row minus the control with its 95% interval (the paper's rows
  minus its unconverted BERT-base, no interval)."""
  averaged = tasks if averaged is None else averaged
  base = PAPER_BERT_BASE[None]
  paper = lambda row, t: paper_score(row[t]) - paper_score(base[t])
  widths = sorted((k for k in PAPER_BERT_BASE if k is not None), reverse=True)
  panels = {}
  for panel in ['average', *tasks]:
    lines = {}
    for e in summary:
      if e['key_dim'] is None or e['method'] == CONSTANT:
        continue
      d = e.get('difference') if panel == 'average' else e.get('task_differences', {}).get(panel)
      if d is None:
        continue
      line = lines.setdefault(e['method'], {'x': [], 'y': [], 'low': [], 'high': []})
      for key, value in zip(line, (D / e['key_dim'], d['estimate'], d['low'], d['high'])):
        line[key].append(value)
    lines['BERT-base (paper, Table 3)'] = {
        'x': [PAPER_D / k for k in widths],
        'y': [
            float(np.mean([paper(PAPER_BERT_BASE[k], t) for t in averaged]))
            if panel == 'average' and averaged
            else paper(PAPER_BERT_BASE[k], panel)
            for k in widths
        ],
    }
    for line in lines.values():  # left to right
      order = np.argsort(line['x'])
      for key in line:
        line[key] = [line[key][i] for i in order]
    panels[panel] = lines
  return panels


def plot_widths(
    summary, tasks, out: pathlib.Path, title: str, averaged=None
) -> dict[str, dict[str, list]]:
  """Each method's score minus the control against the key reduction D / D~k (the average
  over `averaged`, all `tasks` if not given, then each task), with its 95% paired bootstrap
  interval, beside the paper's BERT-base (Table 3: its rows minus BERT-base unconverted)."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top

  panels = width_series(summary, tasks, averaged)
  fig = Figure(figsize=(3.2 * len(panels), 3.6), layout='constrained')
  FigureCanvasAgg(fig)
  axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
  for ax, (panel, lines) in zip(axes, panels.items()):
    for label, line in lines.items():
      if 'low' in line:
        y = np.asarray(line['y'])
        ax.errorbar(
            line['x'],
            y,
            yerr=[y - line['low'], np.asarray(line['high']) - y],
            marker='o',
            markersize=4,
            capsize=3,
            label=label,
        )
      else:
        ax.plot(line['x'], line['y'], 'k--', marker='s', markersize=4, label=label)
    ax.axhline(0, color='grey', lw=0.8)
    ax.set_xscale('log', base=2)
    ticks = sorted({x for line in lines.values() for x in line['x']})
    ax.set_xticks(ticks, [format(t, '.3g') for t in ticks])
    ax.minorticks_off()
    ax.set_title(average_label(tasks, averaged or tasks) if panel == 'average' else panel)
    ax.set_xlabel('keys narrower: D / D~k')
    ax.grid(alpha=0.3)
  axes[0].set_ylabel('dev score minus the control (x100)')
  axes[0].legend(fontsize='x-small')
  fig.suptitle(title)
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, dpi=110)
  return panels


if __name__ == '__main__':
  main()
