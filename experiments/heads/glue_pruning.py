r"""Pruning the heads of a pretrained encoder fine-tuned on GLUE (Michel et al. 2019; Voita et
al. 2019 on BERT-style models): all-MiniLM-L6-v2, 6 layers x 12 heads = 72 encoder heads.

    python -m experiments.heads.glue_pruning --runs_dir=/work/runs/glue_pruning \
        [--tasks=sst2,mrpc,stsb] [--seeds=0] [--lambdas=0.003,0.01,0.03,0.1,0.3]
        [--gate_learning_rate=0.05] [--l0_epochs=3] [--importance_examples=2000]
        [--finetune_levels=0.3,0.5,0.7] [--finetune_epochs=1] [--random_seeds=0,1,2]
        [--random_finetune_seeds=0] [--roles=experiments/heads/roles/minilm/roles.json]
        [--parallel=N] [--plot_only] [--smoke]

Every step is a run of `experiments.runner` (resumable: rerun the same command):
  1. `<task>-original-s<seed>`: all-MiniLM-L6-v2 fine-tuned with `configs/glue.py:<task>`
     (BERT's recipe: 3 epochs, lr 5e-5). The same names and commands as
     `experiments.collaborative.glue_reparam`: given the same --runs_dir, both scripts share
     these fine-tunes (and `<task>-original-again-s<seed>`, below).
  2. `<task>-analyse-s<seed>` (this file's `analyse` command, in one process): Michel et al.'s
     importance I_h = E_x |dL(x)/d xi_h| of the fine-tuned model on --importance_examples
     *training* examples (a shuffled draw; the dev set only scores), L2-normalised per layer
     (Michel et al. sec. 4.2); heads removed in increasing importance, 10% of the 72 at a time
     (round(0.1 k 72) heads at level k), and in 3 random orders (--random_seeds). Each level
     is scored on the whole dev set with head masks (`head_masks`: 0/1 per head, which
     computes what the physically pruned model computes; tests/experiments/
     test_glue_pruning.py checks it), without any fine-tune. At --finetune_levels the pruned
     model is written as a run (`lowrank_attn.pruning.prune_run`).
  3. `<task>-l0-<lambda>-s<seed>`: Voita et al.'s protocol: the whole fine-tuned model trained
     again with a hard-concrete gate on each head and the L0 penalty, lambda x (expected open
     gates summed over a layer's heads, averaged over the 6 layers) added to the mean
     per-example task loss (`train.steps.train_step`; `models.Transformer.l0_penalty`); gates
     start glorot-uniform as in Voita et al.'s code; same recipe for --l0_epochs (default the
     config's 3). The heads kept are those whose evaluation gate is above 0
     (`pruning.keep_from_gates` on the final checkpoint, kept in `glue/gates.json`). The
     score is the run's own final dev evaluation, which is the pruned model's: at evaluation a
     gate is clip(sigmoid(log alpha) x 1.2 - 0.1, 0, 1) (`attention.gates.HardConcrete.
     deterministic`, multiplied onto each head's output in `attention.kernels`), exactly 0 for
     log alpha <= -log 11, so a closed head contributes exactly nothing.
     `<task>-original-again-s<seed>`: the fine-tuned model trained again without gates for the
     same budget, the control for what the second fine-tune does on its own.
  4. `<task>-michel-p<level>-ft-s<seed>` and `<task>-random<r>-p<level>-ft-s<seed>`: the pruned
     models of step 2 at --finetune_levels fine-tuned for --finetune_epochs (default 1) with the
     recipe's learning rate, warmup and decay (random order seeds --random_finetune_seeds).
     The analysis writes Michel's and random order 0's pruned models; every other random order
     fine-tuned gets a run of its own, `<task>-prune-random<r>-s<seed>` (this file's `prune`
     command: the same order as the analysis's curve for r), so adding orders later leaves the
     analysis's command, and the runs recorded with it, as they were.

Lambda: the penalty is at most 12 lambda (all gates open) and closing one head saves at most
lambda / 6. At lambda = 0.003 a head must cost the task under 0.0005 (nats or squared error per
example) to close; at 0.3 closing all 72 saves 3.6, more than any task's loss at chance (0.69
nats for two classes; for STS-B's squared error the variance of its scores, ~2): the range
spans "only free heads close" to "everything may close", in steps of ~3.

Gate learning rate: Adam moves a parameter by at most about its learning rate per step, and a
gate closes when log alpha falls from its start (|log alpha| <= 0.5) to -2.4. At the recipe's
5e-5 with its linear schedule (mean 0.5 of the peak) the gates move at most ~0.01 (MRPC, 345
steps) to ~0.2 (SST-2, 6,315 steps) in 3 epochs: none can close. So the gates get a learning
rate of their own (as structured-pruning code for BERT-style models commonly gives its masks);
--gate_learning_rate (default
0.05, the translation gates' rate, `experiments/heads/run.py`; max travel ~9 on MRPC) sets the
training config's `gate_learning_rate` (peak rate of the 'gate' parameters under the same
schedule); --gate_learning_rate=0 trains them at the model's rate (Voita et al.'s single
optimizer).

Report (written by the script): per task a table and `<task>.png` (dev score vs heads kept: L0,
Michel with and without fine-tune, random mean with its min-max band), 95% paired bootstrap
intervals over dev examples (`experiments.stats.glue_difference`) for the differences stated,
each on the task seeds both rows have (a grid stopped midway has some rows on fewer seeds),
and the roles question: for each lambda (and Michel level) the share of the heads with roles
(`experiments.heads.roles` on UD English-EWT, --roles) among the survivors against their share
among all 72. Files: `glue/results.json` (runner), `glue/pruning.json` (the in-process curves,
every number), `glue/gates.json` (the L0 runs' heads kept and gate values),
`glue/pruned.json` (the prune runs' pruned models, by run name), `glue/table.json`,
`glue/predictions/`, `glue/<task>.png`, and README.md's
section `glue_pruning`. `--plot_only`: no runs; the report of the runs results.json records,
after keeping what their run directories still hold (predictions, analyses, gates): the report
of a grid stopped midway (the full command would start the runs still to do). `--smoke`: RTE, 4-step fine-tunes at max_length 32, 64 importance
examples, levels 0 and 0.5; everything under --runs_dir (smoke_results/), README untouched.
"""

import argparse
import dataclasses
import json
import math
import pathlib
import shutil
import sys

import numpy as np

from experiments import runner

# The grid: the runs, of the needed ones those in it rerun if lost, then the predictions kept.
from experiments.collaborative.glue_reparam import check_score, grid, keep_predictions

HERE = pathlib.Path(__file__).resolve().parent
OUT = HERE / 'glue'
TASKS = ('sst2', 'mrpc', 'stsb', 'rte', 'cola')
DEFAULT_TASKS = ('sst2', 'mrpc', 'stsb')
LAMBDAS = (0.003, 0.01, 0.03, 0.1, 0.3)
LEVELS = tuple(k / 10 for k in range(10))  # 0%, 10%, ..., 90% of the heads removed
ROLES = HERE / 'roles' / 'minilm' / 'roles.json'
GATE_LEARNING_RATE = 0.05
ANALYSIS_FILE = 'pruning.json'
ANALYSIS_PREDICTIONS = 'predictions.json'
GATES_FILE = 'gates.json'
PRUNED_FILE = 'pruned.json'  # a prune run's pruned models (`prune`); kept in glue/ by run name
# glue_reparam's smoke budget, so that a shared --runs_dir shares the smoke fine-tunes too.
SMOKE_BUDGET = {
    'num_train_steps': 4,
    'warmup_steps': 1,
    'checkpoint_every_steps': 2,
    'data.max_length': 32,
}


def get_config(run_dir: str):
  """The training config of a run directory: `--config=experiments/heads/glue_pruning.py:DIR`
  fine-tunes a pruned run with exactly its config (its per-layer head counts cannot be
  written as command-line overrides)."""
  from lowrank_attn.runs import RunDir  # pylint: disable=g-import-not-at-top

  return RunDir(run_dir).config


# ------------------------------------------------------------------ pruning orders (in-process)


def point_name(method: str, seed: int | None, level: float) -> str:
  """'michel-p50', 'random2-p30': a pruning order and level."""
  return f'{method}{"" if seed is None else seed}-p{round(100 * level)}'


def removal_counts(levels, total: int) -> list[int]:
  """Heads removed at each level (a fraction of `total`): round(level x total)."""
  counts = [int(round(level * total)) for level in levels]
  if any(not 0 <= c <= total for c in counts):
    raise ValueError(f'levels {list(levels)} must lie in [0, 1]')
  return counts


def importance_order(importance: np.ndarray) -> np.ndarray:
  """Flat head indices (layer x heads + head) in increasing importance: the order Michel et
  al. remove them in (ties by index)."""
  return np.argsort(np.asarray(importance, np.float64).ravel(), kind='stable')


def random_order(seed: int, shape) -> np.ndarray:
  """Flat head indices in a random order drawn from `seed`."""
  return np.random.default_rng(seed).permutation(int(np.prod(shape)))


def keep_after(order: np.ndarray, removed: int, shape) -> np.ndarray:
  """bool `shape` ([layers, heads]): every head but the first `removed` of `order`."""
  keep = np.ones(int(np.prod(shape)), bool)
  keep[np.asarray(order)[:removed]] = False
  return keep.reshape(shape)


def level_keeps(order: np.ndarray, levels, shape) -> list[np.ndarray]:
  """The keep mask of each level: its removal count's prefix of `order` removed."""
  total = int(np.prod(shape))
  return [keep_after(order, n, shape) for n in removal_counts(levels, total)]


# ------------------------------------------------------------------------- scoring (in-process)


def _predict_fn():
  import functools  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from lowrank_attn import tasks  # pylint: disable=g-import-not-at-top

  @functools.partial(jax.jit, static_argnums=0)
  def predict(graphdef, params, batch, masks):
    model = nnx.merge(graphdef, params)
    outputs, _ = tasks.get('glue').forward(model, batch, deterministic=True, head_masks=masks)
    return outputs if outputs.ndim == 1 else jnp.argmax(outputs, axis=-1)

  return predict


_PREDICT = None


def dev_predictions(model, batches, keep: np.ndarray | None = None):
  """(predictions, labels) of a GLUE classifier on `batches` (rows of weight 0 left out),
  its encoder heads masked by `keep` (bool [layers, heads]; None: every head)."""
  global _PREDICT
  from flax import nnx  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  if _PREDICT is None:
    _PREDICT = _predict_fn()
  graphdef, params = nnx.split(model, nnx.Param)
  masks = None if keep is None else {'encoder': jnp.asarray(keep, jnp.float32)}
  predictions, labels = [], []
  for batch in batches:
    out = np.asarray(
        _PREDICT(graphdef, params, {k: jnp.asarray(v) for k, v in batch.items()}, masks)
    )
    real = np.asarray(batch['weights']) > 0
    predictions.append(out[real])
    labels.append(np.asarray(batch['targets'])[real])
  return np.concatenate(predictions), np.concatenate(labels)


def stored(predicted: np.ndarray) -> list:
  """Predictions as `predictions.json` keeps them: classes as they are, scores at float32's
  shortest decimal (each reads back as the same float32; half the characters of float64's:
  40 pruned models x 1,500 STS-B pairs made 1.2 MB)."""
  predicted = np.asarray(predicted)
  if np.issubdtype(predicted.dtype, np.integer):
    return predicted.tolist()
  return [float(str(x)) for x in predicted.astype(np.float32)]


def first_examples(batches, count: int) -> list[dict]:
  """The batches holding the first `count` real examples, later rows' weights set to 0."""
  out, seen = [], 0
  for batch in batches:
    weights = np.array(batch['weights'], np.float32)
    real = np.cumsum(weights > 0) + seen  # real examples up to each row
    weights[real > count] = 0.0
    out.append({**batch, 'weights': weights})
    seen = int(min(real[-1], count))
    if seen >= count:
      break
  return out


# ------------------------------------------------------------------------------ roles


def load_roles(path) -> dict[tuple[int, int], list[str]]:
  """{(layer, head): role labels} of `experiments.heads.roles`' roles.json."""
  return {
      (e['layer'], e['head']): list(e['roles']) for e in json.loads(pathlib.Path(path).read_text())
  }


def role_kind(label: str) -> str:
  """'positional (prev)' -> 'positional'; 'syntactic (nsubj ->)' -> 'syntactic'."""
  return label.split(' (')[0]


def upper_tail(total: int, marked: int, drawn: int, hits: int) -> float:
  """P(X >= hits), X hypergeometric: `drawn` of `total` heads kept at random, `marked` of
  them with a role."""
  denominator = math.comb(total, drawn)
  return (
      sum(
          math.comb(marked, x) * math.comb(total - marked, drawn - x)
          for x in range(hits, min(marked, drawn) + 1)
      )
      / denominator
  )


def role_shares(
    keep: np.ndarray, roles: dict, kinds=('any', 'positional', 'syntactic', 'rare')
) -> dict:
  """Per kind of role: role heads among the survivors of `keep` against among all heads,
  and the chances of at least and of at most as many under random survival (hypergeometric)."""
  keep = np.asarray(keep, bool)
  total, kept = keep.size, int(keep.sum())
  out = {'heads': total, 'kept': kept}
  for kind in kinds:
    marked = {
        h
        for h, labels in roles.items()
        if labels and (kind == 'any' or any(role_kind(l) == kind for l in labels))
    }
    hits = sum(bool(keep[h]) for h in marked)
    out[kind] = {
        'role_heads': len(marked),
        'kept': hits,
        'share_kept': hits / kept if kept else None,
        'share_all': len(marked) / total,
        'p_at_least': upper_tail(total, len(marked), kept, hits),
        'p_at_most': 1 - upper_tail(total, len(marked), kept, hits + 1),
    }
  return out


# ----------------------------------------------------------------------- the analyse command


def analyse(argv) -> None:
  """Importance, the pruning curves with head masks, and pruned runs to fine-tune."""
  parser = argparse.ArgumentParser(prog='glue_pruning analyse')
  parser.add_argument('--run', required=True, help='the fine-tuned run directory')
  parser.add_argument('--out', required=True)
  parser.add_argument('--importance_examples', type=int, required=True)
  parser.add_argument('--levels', required=True)
  parser.add_argument('--random_seeds', required=True)
  parser.add_argument('--finetune_levels', default='')
  parser.add_argument('--random_finetune_seeds', default='')
  parser.add_argument('--batch_size', type=int, default=32)
  args = parser.parse_args(argv)
  floats = lambda s: [float(x) for x in s.split(',') if x]
  ints = lambda s: [int(x) for x in s.split(',') if x]
  levels, finetune_levels = floats(args.levels), floats(args.finetune_levels)
  random_seeds, finetune_seeds = ints(args.random_seeds), ints(args.random_finetune_seeds)

  from lowrank_attn import analysis, tasks  # pylint: disable=g-import-not-at-top
  from lowrank_attn.runs import RunDir  # pylint: disable=g-import-not-at-top
  from lowrank_attn.tasks.glue import glue_metrics, glue_task  # pylint: disable=g-import-not-at-top

  out = pathlib.Path(args.out)
  run = RunDir(args.run)
  step = run.check_step()
  model, config = run.model(step), run.config
  task = glue_task(config.data.name)[0]
  pipeline = lambda split, train: tasks.make_pipeline(
      config.data,
      split=split,
      seed=config.seed,
      global_batch_size=args.batch_size,
      train=train,
      workdir=run.path,
  )
  # Training examples in a shuffled order (the dev set only scores the pruned models).
  train_batches = first_examples(pipeline('train', True), args.importance_examples)
  importance = analysis.head_importance(model, train_batches, normalize_layers=True)['encoder']
  raw = analysis.head_importance(model, train_batches)['encoder']
  dev = list(pipeline('validation', False))
  shape = np.shape(importance)

  predictions = {}

  def point(method, order, level, removed, seed=None):
    keep = keep_after(order, removed, shape)
    name = point_name(method, seed, level)
    predicted, labels = dev_predictions(model, dev, keep)
    predictions[name] = stored(predicted)
    predictions.setdefault('labels', labels.tolist())
    metrics = glue_metrics(task, predictions[name], labels)  # what the kept file gives
    return {
        'name': name,
        'method': method,
        'seed': seed,
        'level': level,
        'removed': removed,
        'heads_kept': int(keep.sum()),
        'score': metrics['score'],
        'metrics': metrics,
        'keep': keep.astype(int).tolist(),
    }

  michel = importance_order(importance)
  orders = {
      ('michel', None): michel,
      **{('random', s): random_order(s, shape) for s in random_seeds},
  }
  points = []
  for (method, seed), order in orders.items():
    for level, removed in zip(levels, removal_counts(levels, int(np.prod(shape)))):
      points.append(point(method, order, level, removed, seed))
      print(
          f'{task} {points[-1]["name"]}: {points[-1]["heads_kept"]} heads, dev '
          f'{points[-1]["score"]:.2f}',
          flush=True,
      )

  finetune = write_pruned(
      run.path,
      step,
      {k: v for k, v in orders.items() if k[0] == 'michel' or k[1] in finetune_seeds},
      finetune_levels,
      shape,
      out,
  )

  recorded = {}
  final = pathlib.Path(run.path, 'final_eval', str(step), 'metrics.json')
  if final.exists():
    recorded = json.loads(final.read_text()).get('validation', {})
  record = {
      'task': task,
      'source': run.path,
      'source_step': step,
      'importance_examples': sum(int((b['weights'] > 0).sum()) for b in train_batches),
      'dev_examples': len(predictions['labels']),
      'importance': np.asarray(importance).tolist(),
      'importance_raw': np.asarray(raw).tolist(),
      'michel_order': michel.tolist(),
      # The unmasked model scored here must be the run's own final evaluation.
      'source_final_score': recorded.get('score'),
      'points': points,
      'finetune': finetune,
  }
  out.mkdir(parents=True, exist_ok=True)
  runner.files.write_text(out / ANALYSIS_PREDICTIONS, json.dumps(predictions) + '\n')
  runner.files.write_json(out / ANALYSIS_FILE, record)
  unpruned = next(p for p in points if p['method'] == 'michel' and p['removed'] == 0)
  runner.files.write_json(
      out / runner.RESULT_FILE,
      {
          'unpruned_score': unpruned['score'],
          'source_final_score': recorded.get('score'),
          'points': len(points),
          'finetune': sorted(finetune),
      },
  )


def write_pruned(source, step, orders, levels, shape, out: pathlib.Path) -> dict:
  """Each order's pruned model at each level, written as a run under `out/pruned/<point>`
  (`pruning.prune_run`); {point: where it is and what it keeps}, the fine-tunes' sources."""
  from lowrank_attn import pruning  # pylint: disable=g-import-not-at-top

  finetune = {}
  total = int(np.prod(shape))
  for (method, seed), order in orders.items():
    for level in levels:
      (removed,) = removal_counts([level], total)
      name = point_name(method, seed, level)
      directory = out / 'pruned' / name
      if directory.exists():  # an attempt that was cut off: write it again
        shutil.rmtree(directory)
      keep = {'encoder': keep_after(order, removed, shape)}
      overrides = pruning.prune_run(source, keep, directory, step=step)
      finetune[name] = {
          'dir': str(directory),
          'method': method,
          'seed': seed,
          'level': level,
          'removed': removed,
          'heads_kept': total - removed,
          'overrides': overrides,
      }
  return finetune


def prune(argv) -> None:
  """One random order's pruned models at the fine-tune levels, as runs to fine-tune: the
  random orders after the analysis's own (its command stays that of the runs it recorded)."""
  parser = argparse.ArgumentParser(prog='glue_pruning prune')
  parser.add_argument('--run', required=True, help='the fine-tuned run directory')
  parser.add_argument('--out', required=True)
  parser.add_argument('--random_seed', type=int, required=True)
  parser.add_argument('--levels', required=True)
  args = parser.parse_args(argv)
  from lowrank_attn.runs import RunDir  # pylint: disable=g-import-not-at-top

  run = RunDir(args.run)
  step = run.check_step()
  shape = (run.config.model.num_encoder_layers, run.config.model.attention.num_heads)
  order = random_order(args.random_seed, shape)
  levels = [float(x) for x in args.levels.split(',')]
  out = pathlib.Path(args.out)
  finetune = write_pruned(run.path, step, {('random', args.random_seed): order}, levels, shape, out)
  runner.files.write_json(out / PRUNED_FILE, finetune)
  runner.files.write_json(out / runner.RESULT_FILE, {'finetune': sorted(finetune)})


# ------------------------------------------------------------------------------ the grid


def arguments():
  parser = runner.arg_parser(__doc__, 'glue_pruning')
  parser.add_argument('--tasks', default=','.join(DEFAULT_TASKS))
  parser.add_argument('--seeds', default='0')
  parser.add_argument('--lambdas', default=','.join(map(str, LAMBDAS)))
  parser.add_argument(
      '--gate_learning_rate',
      type=float,
      default=GATE_LEARNING_RATE,
      help="peak learning rate of the gates (0: the model's)",
  )
  parser.add_argument(
      '--l0_epochs',
      type=float,
      default=None,
      help="epochs of the L0 fine-tune and its control (default: the config's)",
  )
  parser.add_argument('--importance_examples', type=int, default=2000)
  parser.add_argument('--levels', default=','.join(f'{x:g}' for x in LEVELS))
  parser.add_argument('--finetune_levels', default='0.3,0.5,0.7')
  parser.add_argument('--finetune_epochs', type=float, default=1.0)
  parser.add_argument('--random_seeds', default='0,1,2')
  parser.add_argument('--random_finetune_seeds', default='0')
  parser.add_argument('--roles', default=str(ROLES), help='roles.json of all-MiniLM-L6-v2')
  parser.add_argument(
      '--smoke',
      action='store_true',
      help='RTE, 4-step fine-tunes at max_length 32, 64 importance examples, '
      'levels 0 and 0.5, one lambda; results under --runs_dir',
  )
  args = parser.parse_args()
  floats = lambda s: [float(x) for x in s.split(',') if x]
  args.tasks = args.tasks.split(',')
  args.seeds = [int(s) for s in args.seeds.split(',')]
  args.lambdas = floats(args.lambdas)
  args.levels, args.finetune_levels = floats(args.levels), floats(args.finetune_levels)
  args.random_seeds = [int(s) for s in args.random_seeds.split(',') if s]
  args.random_finetune_seeds = [int(s) for s in args.random_finetune_seeds.split(',') if s]
  if set(args.tasks) - set(TASKS):
    parser.error(
        f'--tasks: {sorted(set(args.tasks) - set(TASKS))} unknown; valid: ' f'{",".join(TASKS)}'
    )
  if set(args.finetune_levels) - set(args.levels):
    parser.error(f'--finetune_levels {args.finetune_levels} must be among --levels')
  if set(args.random_finetune_seeds) - set(args.random_seeds):
    parser.error('--random_finetune_seeds must be among --random_seeds')
  args.out = OUT
  args.budget = {}
  if args.smoke:
    args.tasks, args.seeds, args.lambdas = ['rte'], [0], [0.1]
    args.levels, args.finetune_levels = [0.0, 0.5], [0.5]
    args.importance_examples, args.l0_epochs = 64, None
    args.budget = dict(SMOKE_BUDGET)
    args.out = pathlib.Path(args.runs_dir) / 'smoke_results'
  return args


def gate_overrides(args) -> dict:
  """The gates' own peak learning rate (`config.gate_learning_rate`); none with 0."""
  return {'gate_learning_rate': args.gate_learning_rate} if args.gate_learning_rate else {}


def keep_gates(results, args) -> dict:
  """{L0 run: the heads its gates keep (eval gate > 0) and the gate values}, read from each
  finished run's final checkpoint once and kept in `gates.json` (run directories may not
  survive). Called after the grid: reading a model starts JAX's threads, and the grid forks."""
  from lowrank_attn import pruning  # pylint: disable=g-import-not-at-top
  from lowrank_attn.runs import RunDir  # pylint: disable=g-import-not-at-top

  path = args.out / GATES_FILE
  gates = runner.files.read_json(path) or {}
  for entry in results['runs']:
    rundir = pathlib.Path(results['runs_dir'], entry['name'])
    if (
        entry.get('config', {}).get('method') != 'l0'
        or entry['name'] in gates
        or not RunDir(rundir).steps()
    ):
      continue
    model = RunDir(rundir).model()
    keep = np.asarray(pruning.keep_from_gates(model)['encoder'])
    values = np.stack([np.asarray(a.gate_values()) for a in model.attention_layers()['encoder']])
    gates[entry['name']] = {
        'keep': keep.astype(int).tolist(),
        'heads_kept': int(keep.sum()),
        'gates': np.round(values.astype(np.float64), 4).tolist(),
    }
  runner.files.write_json(path, gates)
  return gates


def main():
  if len(sys.argv) > 1 and sys.argv[1] in ('analyse', 'prune'):
    return {'analyse': analyse, 'prune': prune}[sys.argv[1]](sys.argv[2:])
  args = arguments()
  runs_dir = pathlib.Path(args.runs_dir).resolve()
  if args.plot_only:  # no runs; what the run directories of its runs still hold is kept first
    results = runner.load_results(args.out)
    keep_predictions(results, args)
    keep_analyses(results, args)
    keep_gates(results, args)
    return report(results, args)

  def run(name, task, seed, overrides, config='configs/glue.py:{task}', **record):
    train = runner.train_run(
        name, config.format(task=task), seed=seed, overrides={**overrides, **args.budget}
    )
    return dataclasses.replace(train, config={'task': task, **record, **train.config})

  # 1. The fine-tuned originals (glue_reparam's runs: same names and commands). A finished run
  # that results.json records counts as done without its directory, unless runs still to do
  # start from it: then it runs again (`needed`).
  first, sources, needed = [], {}, set()
  for seed in args.seeds:
    for task in args.tasks:
      name = f'{task}-original-s{seed}'
      first.append(run(name, task, seed, {}, method='original', stage=1))
      sources[task, seed] = runs_dir / name
      needed |= needed_runs(task, seed, args)
  results = grid(first, args, needed)
  if not finished(results, first):
    return print('the pruning needs every fine-tuned original; rerun when they are done')

  # 2. Importance and the curves without fine-tune, and the pruned runs to fine-tune.
  analyses = []
  for seed in args.seeds:
    for task in args.tasks:
      command = subcommand(
          'analyse',
          sources[task, seed],
          f'--importance_examples={args.importance_examples}',
          f'--levels={",".join(map(str, args.levels))}',
          f'--random_seeds={",".join(map(str, args.random_seeds))}',
          f'--finetune_levels={",".join(map(str, args.finetune_levels))}',
          f'--random_finetune_seeds={",".join(map(str, analysed_orders(args)))}',
      )
      analyses.append(
          runner.Run(
              f'{task}-analyse-s{seed}',
              command,
              seed=seed,
              config={'task': task, 'method': 'analyse', 'stage': 2},
          )
      )
      for order_seed in pruned_orders(args):
        command = subcommand(
            'prune',
            sources[task, seed],
            f'--random_seed={order_seed}',
            f'--levels={",".join(map(str, args.finetune_levels))}',
        )
        analyses.append(
            runner.Run(
                prune_name(task, order_seed, seed),
                command,
                seed=seed,
                config={'task': task, 'method': 'prune', 'random_seed': order_seed, 'stage': 2},
            )
        )
  results = grid(first + analyses, args, needed)
  keep_analyses(results, args)
  if not finished(results, analyses):
    return print('the fine-tunes need every analysis and pruned model; rerun when they are done')

  # 3. L0 gates and their control; 4. the pruned models fine-tuned.
  import configs.glue  # pylint: disable=g-import-not-at-top

  gates = gate_overrides(args) if args.lambdas else {}
  second = []
  for seed in args.seeds:
    for task in args.tasks:
      source = str(sources[task, seed])
      budget = {} if args.l0_epochs is None else configs.glue.epochs_budget(task, args.l0_epochs)
      second.append(
          run(
              again_name(task, seed, args),
              task,
              seed,
              {'init_from': source, **budget},
              method='original',
              stage=2,
          )
      )
      for lam in args.lambdas:
        second.append(
            run(
                l0_name(task, lam, seed),
                task,
                seed,
                {
                    'init_from': source,
                    'model.attention.gated': True,
                    'model.attention.gate_log_alpha_init': 'glorot',
                    'l0_penalty_weight': lam,
                    **gates,
                    **budget,
                },
                method='l0',
                l0_lambda=lam,
                stage=2,
            )
        )
      for name, pruned in to_finetune(task, seed, args).items():
        second.append(
            run(
                finetune_name(task, name, seed),
                task,
                seed,
                {
                    'init_from': pruned['dir'],
                    **configs.glue.epochs_budget(task, args.finetune_epochs),
                },
                config=f'experiments/heads/glue_pruning.py:{pruned["dir"]}',
                method=f'{pruned["method"]}+ft',
                level=pruned['level'],
                heads_kept=pruned['heads_kept'],
                random_seed=pruned['seed'],
                stage=2,
            )
        )
  results = grid(first + analyses + second, args, needed)
  keep_gates(results, args)
  report(results, args)


def subcommand(name: str, source, *flags: str) -> list[str]:
  """The argv of this file's `analyse` or `prune` on the fine-tuned run `source`."""
  module = 'experiments.heads.glue_pruning'
  return [sys.executable, '-m', module, name, f'--run={source}', '--out={rundir}', *flags]


def again_name(task: str, seed: int, args) -> str:
  budget = '' if args.l0_epochs is None else f'-e{args.l0_epochs:g}'
  return f'{task}-original-again{budget}-s{seed}'


def l0_name(task: str, lam: float, seed: int) -> str:
  return f'{task}-l0-{lam:g}-s{seed}'


def finetune_name(task: str, pruned: str, seed: int) -> str:
  return f'{task}-{pruned}-ft-s{seed}'


def prune_name(task: str, order_seed: int, seed: int) -> str:
  return f'{task}-prune-random{order_seed}-s{seed}'


# The analysis writes the pruned models of random order 0 (and Michel's), as it did for the
# runs recorded before `prune` existed, so its command stays theirs; every other random order
# fine-tuned gets a `prune` run of its own.
ANALYSED_ORDER = 0


def analysed_orders(args) -> list[int]:
  return [s for s in args.random_finetune_seeds if s == ANALYSED_ORDER]


def pruned_orders(args) -> list[int]:
  return [s for s in args.random_finetune_seeds if s != ANALYSED_ORDER]


def pruned_sources(task: str, seed: int, args) -> dict[str, dict | None]:
  """{analysis or prune run: its pruned models, None where not recorded yet}."""
  analyses = runner.files.read_json(args.out / ANALYSIS_FILE) or {}
  pruned = runner.files.read_json(args.out / PRUNED_FILE) or {}
  record = analyses.get(f'{task}-s{seed}')
  sources = {f'{task}-analyse-s{seed}': record and record['finetune']}
  for order_seed in pruned_orders(args):
    name = prune_name(task, order_seed, seed)
    sources[name] = pruned.get(name)
  return sources


def to_finetune(task: str, seed: int, args) -> dict[str, dict]:
  """{pruned model: where it is and what it keeps}: every model the fine-tunes start from."""
  out = {}
  for finetune in pruned_sources(task, seed, args).values():
    out.update(finetune)
  return out


def needed_runs(task: str, seed: int, args) -> set[str]:
  """The runs of `task` and `seed` that runs still to do start from, by what results.json,
  pruning.json and pruned.json record: the fine-tuned original (the analysis, the prune runs,
  the L0 runs and their control start from its checkpoint), the analysis and the prune runs
  (their pruned models are fine-tuned). A run directory lost between sessions is then made
  again instead of failing the runs after it."""
  done = runner.recorded(args.out)
  sources = pruned_sources(task, seed, args)
  needed = set()
  for name, finetune in sources.items():
    # Unrecorded: the fine-tunes are named by its record, so some must still be pending.
    if finetune is None or any(finetune_name(task, p, seed) not in done for p in finetune):
      needed.add(name)
  second = [again_name(task, seed, args)] + [l0_name(task, lam, seed) for lam in args.lambdas]
  if needed or not set(sources) <= done or not set(second) <= done:
    needed.add(f'{task}-original-s{seed}')
  return needed


def finished(results, runs) -> bool:
  """Whether every run of `runs` is among results.json's finished runs."""
  done = {entry['name'] for entry in results['runs']}
  return all(run.name in done for run in runs)


def keep_analyses(results, args) -> None:
  """Merges the analyses' records into `pruning.json` and copies their predictions; merges the
  prune runs' pruned models into `pruned.json` (by run name)."""
  path = args.out / ANALYSIS_FILE
  merged = runner.files.read_json(path) or {}
  pruned = runner.files.read_json(args.out / PRUNED_FILE) or {}
  for entry in results['runs']:
    method = entry.get('config', {}).get('method')
    rundir = pathlib.Path(results['runs_dir'], entry['name'])
    if method == 'prune' and (rundir / PRUNED_FILE).exists():
      pruned[entry['name']] = json.loads((rundir / PRUNED_FILE).read_text())
    if method != 'analyse':
      continue
    if not (rundir / ANALYSIS_FILE).exists():
      continue  # its run directory is gone: pruning.json has it
    key = f'{entry["config"]["task"]}-s{entry["seed"]}'
    merged[key] = json.loads((rundir / ANALYSIS_FILE).read_text())
    (args.out / 'predictions').mkdir(parents=True, exist_ok=True)
    shutil.copyfile(
        rundir / ANALYSIS_PREDICTIONS, args.out / 'predictions' / f'{entry["name"]}.json'
    )
  runner.files.write_json(path, merged)
  if pruned:
    runner.files.write_json(args.out / PRUNED_FILE, pruned)


# ------------------------------------------------------------------------------ the report


def _predictions(args, row):
  """(predictions, labels) of a row's model: its run's (`predictions/<name>.json`) or its
  analysis point's; None if not kept. Refused unless they give the row's recorded score (else
  they are not that model's, or not in the labels' order)."""
  name, key = row['source']
  path = args.out / 'predictions' / f'{name}.json'
  if not path.exists():
    return None
  found = json.loads(path.read_text())
  if (key or 'predictions') not in found:
    return None
  predictions = found[key or 'predictions']
  what = name if key is None else f'{name} ({key})'
  check_score(row['task'], predictions, found['labels'], row['score'], what)
  return predictions, found['labels']


def _interval(task, a_rows, b_rows, args) -> dict | None:
  """B - A of `task`'s score with its 95% paired bootstrap interval over dev examples, on the
  task seeds both have (a grid still running has some rows on fewer seeds than others); the
  rows of each system are averaged on each resample. None without predictions or a shared
  seed."""
  from experiments import stats  # pylint: disable=g-import-not-at-top

  shared = {r['seed'] for r in a_rows} & {r['seed'] for r in b_rows}
  a = [p for p in (_predictions(args, r) for r in a_rows if r['seed'] in shared) if p]
  b = [p for p in (_predictions(args, r) for r in b_rows if r['seed'] in shared) if p]
  if not a or not b:
    return None
  return stats.glue_difference({task: (a[0][1], [p for p, _ in a], [p for p, _ in b])}).as_dict()


def points_of(results, args) -> list[dict]:
  """One row per scored model: task, seed, method, level (or lambda), heads kept, dev score,
  and how to find its predictions."""
  analyses = runner.files.read_json(args.out / ANALYSIS_FILE) or {}
  gates = runner.files.read_json(args.out / GATES_FILE) or {}
  rows = []
  for row in runner.final(results, 'validation'):
    method = row.get('method')
    if 'score' not in row or method in ('analyse', 'prune'):
      continue
    base = {
        'task': row['task'],
        'seed': row['seed'],
        'score': row['score'],
        'source': (row['name'], None),
    }
    if method == 'original':
      rows.append(
          {
              **base,
              'method': 'unpruned' if row['stage'] == 1 else 'fine-tuned again',
              'heads_kept': 72,
              'level': 0.0,
          }
      )
    elif method == 'l0':
      if row['name'] not in gates:
        continue  # its checkpoint is gone and gates.json does not have it
      rows.append(
          {
              **base,
              'method': 'L0 gates',
              'lambda': row['l0_lambda'],
              'heads_kept': gates[row['name']]['heads_kept'],
              'keep': gates[row['name']]['keep'],
          }
      )
    else:
      rows.append(
          {
              **base,
              'method': method.replace('michel', 'Michel'),
              'level': row['level'],
              'random_seed': row.get('random_seed'),
              'heads_kept': row['heads_kept'],
          }
      )
  for key, record in analyses.items():
    seed = int(key.rsplit('-s', 1)[1])
    if not any(r['task'] == record['task'] and r['seed'] == seed for r in rows):
      continue  # not in this grid (other tasks or seeds of an earlier invocation)
    for p in record['points']:
      rows.append(
          {
              'task': record['task'],
              'seed': seed,
              'score': p['score'],
              'method': 'Michel' if p['method'] == 'michel' else 'random',
              'random_seed': p['seed'],
              'level': p['level'],
              'heads_kept': p['heads_kept'],
              'keep': p['keep'],
              'source': (f'{record["task"]}-analyse-s{seed}', p['name']),
          }
      )
  return rows


def report(results, args) -> None:
  rows = points_of(results, args)
  if not rows:
    print('no finished run has a final dev evaluation yet')
    return
  roles = load_roles(args.roles) if pathlib.Path(args.roles).exists() else None
  sections, summary = [], {}
  for task in [t for t in TASKS if any(r['task'] == t for r in rows)]:
    mine = [r for r in rows if r['task'] == task]
    table, roles_text, entry = task_report(task, mine, roles, args)
    summary[task] = entry
    sections += [f'#### {task}', '', table, '', f'![{task}]({task}.png)', '', roles_text, '']
  runner.files.write_json(args.out / 'table.json', summary)
  where = pathlib.Path(args.roles).resolve()
  if where.is_relative_to(runner.REPO_ROOT):  # as the README's readers have it
    where = where.relative_to(runner.REPO_ROOT)
  roles_note = (
      f'Roles: `{where}`.'
      if roles is not None
      else f'Roles: `{where}` does not exist yet; the role columns are left out.'
  )
  text = '\n'.join([runner.runs_summary(results), '', roles_note, '', *sections])
  (args.out / 'results.md').write_text(text + '\n')
  print(text)
  if not args.smoke:
    runner.write_section(HERE / 'README.md', 'glue_pruning', text)


def task_report(task, rows, roles, args):
  """The table, the roles table and the plot of one task; its numbers for table.json."""
  from experiments import stats  # pylint: disable=g-import-not-at-top
  from lowrank_attn.tasks.glue import constant_score  # pylint: disable=g-import-not-at-top

  by = lambda **kw: [r for r in rows if all(r.get(k) == v for k, v in kw.items())]
  unpruned = by(method='unpruned')
  lines = []
  found = _predictions(args, unpruned[0]) if unpruned else None
  constant = constant_score(task, found[1]) if found else None

  def line(label, group, against=unpruned, against_label='unpruned', **extra):
    if not group:
      return
    scores = [r['score'] for r in group]
    entry = {
        'method': label,
        **extra,
        'heads_kept': float(np.mean([r['heads_kept'] for r in group])),
        'score': float(np.mean(scores)),
        'min': min(scores),
        'max': max(scores),
        'n': len(group),
        'seeds': sorted({r['seed'] for r in group}),
    }
    if against and group is not against:
      entry[f'minus_{against_label}'] = _interval(task, against, group, args)
      entry['against'] = against_label
    lines.append(entry)
    return entry

  line('unpruned', unpruned, against=None)
  line('fine-tuned again (L0 control)', by(method='fine-tuned again'))
  levels = sorted({r['level'] for r in rows if r['method'] in ('Michel', 'random')})
  finetuned = set(args.finetune_levels)
  for level in levels:
    stated = level in finetuned  # intervals where the fine-tunes are: the table's comparisons
    for method in ('Michel', 'random', 'Michel+ft', 'random+ft'):
      group = by(method=method, level=level)
      if not group:
        continue
      entry = line(method, group, against=unpruned if stated else None, level=level)
      michel_too = by(method=method.replace('random', 'Michel'), level=level)
      if stated and method.startswith('random') and michel_too:
        # Does the order matter? The random orders against Michel's, both pruned alike.
        entry['minus_michel'] = _interval(task, michel_too, group, args)
  l0 = sorted({r['lambda'] for r in rows if r['method'] == 'L0 gates'})
  michel = {level: by(method='Michel', level=level) for level in levels}
  michel_ft = {level: by(method='Michel+ft', level=level) for level in levels}
  again = by(method='fine-tuned again')  # the same second fine-tune without gates
  for lam in l0:
    group = by(method='L0 gates', **{'lambda': lam})
    entry = line('L0 gates', group, **{'lambda': lam})
    if again:
      entry['minus_again'] = _interval(task, again, group, args)
    for label, curve in (('Michel', michel), ('Michel+ft', michel_ft)):
      done = {k: v for k, v in curve.items() if v}
      if not done:
        continue
      nearest = min(done, key=lambda k: abs(done[k][0]['heads_kept'] - entry['heads_kept']))
      entry[f'vs_{label}'] = {
          'level': nearest,
          'heads_kept': done[nearest][0]['heads_kept'],
          'difference': _interval(task, done[nearest], group, args),
      }

  interval = lambda d: str(stats.Interval(**d)) if d else ''
  what = lambda e: (
      f"λ={e['lambda']:g}"
      if 'lambda' in e
      else f"{round(100 * e['level'])}% removed"
      if 'level' in e
      else ''
  )
  score = lambda e: (
      f"{e['score']:.2f}"
      if e['n'] == 1 or e['method'] not in ('random', 'random+ft')
      else f"{e['score']:.2f} ({e['min']:.2f}–{e['max']:.2f})"
  )
  versus = lambda e, label: (
      f"{interval(e[f'vs_{label}']['difference'])} " f"({e[f'vs_{label}']['heads_kept']} heads)"
      if e.get(f'vs_{label}')
      else ''
  )
  table = runner.markdown_table(
      lines,
      [
          ('method', 'method'),
          ('pruning', what),
          ('heads kept', lambda e: f"{e['heads_kept']:g}"),
          ('dev score', score),
          ('− unpruned [95%]', lambda e: interval(e.get('minus_unpruned'))),
          ('random − Michel, same pruning [95%]', lambda e: interval(e.get('minus_michel'))),
          ('L0 − fine-tuned again [95%]', lambda e: interval(e.get('minus_again'))),
          ('L0 − Michel, nearest [95%]', lambda e: versus(e, 'Michel')),
          ('L0 − Michel+ft, nearest [95%]', lambda e: versus(e, 'Michel+ft')),
          ('seeds', lambda e: ','.join(map(str, e['seeds']))),
          ('runs', 'n'),
      ],
  )
  table += (
      "\n\nA score is the mean of its row's runs; a difference pairs the two rows on the task "
      'seeds both have.'
  )
  if constant is not None:
    table += (
        f'\n\nA constant prediction (`constant_score`: the best single answer for every dev '
        f'example) scores {constant:.2f}.'
    )
  plot(task, rows, args.out / f'{task}.png', constant)

  roles_rows = []
  if roles is not None:
    for lam in l0:
      for r in by(method='L0 gates', **{'lambda': lam}):
        roles_rows.append(
            {
                'path': f'L0 λ={lam:g}',
                'seed': r['seed'],
                **role_shares(np.asarray(r['keep'], bool), roles),
            }
        )
    for level in levels:
      for r in michel[level]:
        if level > 0:
          roles_rows.append(
              {
                  'path': f'Michel {round(100 * level)}% removed',
                  'seed': r['seed'],
                  **role_shares(np.asarray(r['keep'], bool), roles),
              }
          )
  cell = lambda kind: lambda e: (
      f"{e[kind]['kept']}/{e['kept']} = {100 * (e[kind]['share_kept'] or 0):.0f}% vs "
      f"{100 * e[kind]['share_all']:.0f}% (p≥ {e[kind]['p_at_least']:.2f}, "
      f"p≤ {e[kind]['p_at_most']:.2f})"
  )
  roles_text = (
      'Role heads among the survivors vs among all 72 (p≥, p≤: the chances of at least and '
      'of at most as many under random survival of as many heads, hypergeometric; one test '
      "per cell, not corrected for the table's many):\n\n"
      + runner.markdown_table(
          roles_rows,
          [
              ('path', 'path'),
              ('seed', 'seed'),
              ('heads kept', 'kept'),
              *[(f'{k} roles', cell(k)) for k in ('any', 'positional', 'syntactic', 'rare')],
          ],
      )
      if roles_rows
      else ''
  )
  return table, roles_text, {'rows': lines, 'roles': roles_rows, 'constant': constant}


def plot(task, rows, out, constant=None) -> None:
  """Dev score vs heads kept: one line per method, random's band over its order seeds."""
  labels = {
      'unpruned': 'unpruned',
      'fine-tuned again': 'fine-tuned again (no gates)',
      'L0 gates': 'L0 gates (whole model)',
      'Michel': 'Michel, no fine-tune',
      'Michel+ft': 'Michel + fine-tune',
      'random': 'random, no fine-tune',
      'random+ft': 'random + fine-tune',
  }
  points = [
      {'method': labels[r['method']], 'heads kept': r['heads_kept'], 'score': r['score']}
      for r in rows
  ]
  if constant is not None:  # a flat line across the plot
    points += [
        {'method': 'constant prediction', 'heads kept': kept, 'score': constant} for kept in (0, 72)
    ]
  runner.plot_lines(
      points,
      x='heads kept',
      y='score',
      group='method',
      out=out,
      spread='minmax',
      title=f"{task}: pruning all-MiniLM-L6-v2's 72 heads",
      ylabel='dev score (GLUE, x100)',
  )


if __name__ == '__main__':
  main()
