"""The head-size bottleneck trained to convergence, then fixed_head at a smaller width.

    LOWRANK_ATTN_DATA=../shared/data nice -n 19 python -m experiments.bottleneck.convergence \\
        --runs_dir=/work/runs/bottleneck_convergence

The sweep (`sweep.py`, 250 steps) left its models just past the bigram plateau with one
learning rate for 1.2M-9.5M-parameter models. This script trains the same character LM
(`configs/lm.py:bottleneck`: n = 128, 2 layers, 16 x 128 characters per step, AdamW, cosine
decay to 0.1x, no dropout) for `--steps` steps (default 3,000: 6.1M characters, 1.3 passes
over the 4.6M characters of the training split; budget and measured step times: README), in
three stages (`--stage`; `all`, the default, runs them in order):

  lr     six arms at D = 256: concat (d = D/h) at h in {1, 2, 8, 32} and fixed_head with
         d_p = n = 128 at h in {8, 32}, each at learning rates {1e-3, 3e-3, 1e-2}, seed 0.
  seeds  per arm, its best rate (lowest final bits/char in stage lr; a run that diverged counts
         as worst) at seeds 0 and 1; seed 0 is stage lr's run (same name: not trained again).
         An arm whose rate sweep is not finished is left out, with a note.
  width  the paper's claim: fixed_head at D = 128, h = 8, d_p = 128 (MLP 4D = 512, 2 layers)
         against concat at D = 256, h = 8 (d = 32). The D = 128 model gets its own 3-rate sweep
         (seed 0; concat h = 8's sweep is stage lr's, rerun here only if missing), then both at
         their best rates with seeds 0 and 1: (a) equal steps; (b) equal compute: the model with
         fewer training FLOPs per step (analytic: 3 x `model.flops`, as the sweep counts them)
         trains round(steps x FLOPs per step of the other / its own) steps, the other `steps`.

A longer budget need not sweep the rates again: `--steps=12000 --rate_steps=3000` trains stages
seeds and width at 12,000 steps at the rates the 3,000-step sweep picked (its runs must be
finished, here or in `convergence/results.json`), `--seeds=0` only seed 0. Each budget other
than the default writes its own README section (`convergence-<steps>st`) and plots. Whether the
pick holds at the longer budget: `--steps=24000 --stage=lr` (no `--rate_steps`) sweeps there, and
`--only=<patterns>` (the runner's) runs part of it on a slow machine, e.g.
`--only='concat-h32-*-lr0.001-*'`; the section of `--rate_steps` shows those runs in a table of
their own (fixed_head minus concat at equal rates) once one is at another rate than the pick.

`--dropout=0.1` trains stages seeds and width with dropout 0.1 on the embeddings, every residual
branch, the MLP's hidden layer and the attention probabilities (BERT's two rates), as runs of
their own (names, plots and README section end in `-drop0.1`), at the rates of the sweep
without dropout (at `--rate_steps`; stage lr never trains with dropout), and reports each
against the same run without dropout where that has finished: whether the overfitting of the
long runs without dropout changes a verdict.

Every run: warmup 12% of its steps (the bottleneck config's 30 of 250, scaled), cosine decay over
its own length; an evaluation every steps/12 steps on the first 24 validation batches (49k
characters, the same ones each time: the learning curve), and at the end bits per character on the
whole validation split (Julius Caesar, Twelfth Night; nats / ln 2 of the token-level loss, as the
sweep reports it), computed from the final checkpoint when the run's results are collected
(`evaluate_run`, cached in the run directory), with each validation row's summed loss
(`validation_rows`). A difference between arms gives a 95% paired bootstrap interval over the
validation text in blocks of 32 rows (`text_interval`) where every run it compares has its rows;
runs collected before they were recorded get them from `--refresh` while their final checkpoint
survives, or from `--rerun_lost` (trained again) where their directory is gone. A run has flattened
when its last periodic evaluation is within 0.01 bits/char of the one steps/12 earlier (the change
is reported with its sign). Run names hold everything that varies (arm, D, rate, steps, seed), so
runs of other `--steps` never collide.

Results: `convergence/results.json` (the runner's), the plots in `convergence/`, and the
README section `convergence`. `--smoke`: every stage end to end on 12 steps, two arms and two
rates, 2-batch evaluations, under <runs_dir>/smoke (its report in smoke/report.md); writes
nothing here. `--plot_only`: report from `convergence/results.json`.
"""

import argparse
from collections.abc import Iterable, Mapping, Sequence
import dataclasses
import functools
import importlib.util
import itertools
import json
import math
import pathlib
import subprocess
import sys
import time

import numpy as np

from experiments import runner
from experiments import stats
from experiments.bottleneck import sweep

HERE = pathlib.Path(__file__).parent
OUT = HERE / 'convergence'
SECTION = 'convergence'
CONFIG = sweep.CONFIG
LENGTH, EMB_DIM = sweep.LENGTH, sweep.EMB_DIM
NUM_HEADS, KIND, HEAD_DIM = sweep.NUM_HEADS, sweep.KIND, sweep.HEAD_DIM
DROPOUT, ATTENTION_DROPOUT = 'model.dropout_rate', 'model.attention.dropout_rate'
STEPS = 3000
RATES = (1e-3, 3e-3, 1e-2)
SEEDS = (0, 1)
EVALS = 12  # periodic evaluations per run
EVAL_BATCHES = 24  # validation batches per periodic evaluation (of ~112 in the split)
FLAT_TOL = 0.01  # bits/char between the last two periodic evaluations
TRAIN_HEADER = 'train bits/char, last twelfth (gap)'
# From this commit on a logged training record is the mean over the steps since the record
# before; up to it, over the steps since the step metrics were last fetched (a save, an
# evaluation, the progress line). What the older records covered: train_records.py's JSON.
LOGGING_FIX = '4b15d5b'
TRAIN_RECORDS = 'train_records.json'
WARMUP_SHARE = 30 / 250  # configs/lm.py:bottleneck's warmup, as a share of its 250 steps
KEEP_CHECKPOINTS = 2
# The character vocabulary of the works' training split (every run of the sweep has it; the
# collector checks each run's): sizes the output layer in the FLOPs that set equal compute.
VOCAB_SIZE = 89
WHOLE_FILE = 'whole_validation.json'  # <rundir>/: the final evaluation of `evaluate_run`
# The rows' nll against the evaluation's total: float32 sums over <= 2,048 tokens a batch and
# ~112 batches err by at most ~2,160 x 2^-24 = 1.3e-4 relative; a lost row moves tokens exactly.
ROW_SUM_TOL = 1e-3
# text_interval's unit: 32 consecutive rows, 4,096 characters, past which the per-row
# differences of runs no longer correlate (`interval_blocks.py`).
BLOCK_ROWS = 32
SIZE_KEYS = ('params', 'attention_params', 'train_flops_per_token', 'train_flops', 'vocab_size')
MODULE = 'experiments.bottleneck.convergence'
SMOKE_STEPS = 12
SMOKE_RATES = (3e-3, 1e-2)
SMOKE_EVAL_BATCHES = 2


@dataclasses.dataclass(frozen=True)
class Arm:
  """A model: concat (head_dim None: d = D / h) or fixed_head with d_p = head_dim, at width D."""

  heads: int
  head_dim: int | None = None
  emb_dim: int = EMB_DIM

  @property
  def kind(self) -> str:
    return 'concat' if self.head_dim is None else 'fixed_head'

  @property
  def d(self) -> int:
    return self.emb_dim // self.heads if self.head_dim is None else self.head_dim

  @property
  def key(self) -> str:
    """'concat-h8-D256', 'fixed128-h8-D128': the run names' prefix."""
    kind = 'concat' if self.head_dim is None else f'fixed{self.head_dim}'
    return f'{kind}-h{self.heads}-D{self.emb_dim}'

  @property
  def label(self) -> str:
    size = f'd = {self.d}' if self.head_dim is None else f'd_p = {self.d}'
    return f'{self.kind}, h = {self.heads}, {size}, D = {self.emb_dim}'

  def overrides(self) -> dict:
    out = {NUM_HEADS: self.heads}
    if self.head_dim is not None:
      out.update({KIND: 'fixed_head', HEAD_DIM: self.head_dim})
    if self.emb_dim != EMB_DIM:
      out.update({'model.emb_dim': self.emb_dim, sweep.MLP: 4 * self.emb_dim})
    return out


LR_ARMS = (
    Arm(1),
    Arm(2),
    Arm(8),
    Arm(32),
    Arm(8, head_dim=LENGTH),
    Arm(32, head_dim=LENGTH),
)
WIDTH_ARM = Arm(8, head_dim=LENGTH, emb_dim=128)  # the paper's claim: smaller D, d_p = n
WIDTH_BASELINE = Arm(8)  # concat at D = 256, d = 32
SMOKE_ARMS = (WIDTH_BASELINE, Arm(8, head_dim=LENGTH))


@dataclasses.dataclass(frozen=True)
class Point:
  """One training run: an arm at a learning rate, seed and length [and dropout rate]."""

  arm: Arm
  lr: float
  seed: int
  steps: int
  dropout: float = 0.0

  @property
  def name(self) -> str:
    return f'{self.arm.key}-lr{self.lr:g}-{self.steps}st-s{self.seed}{_drop_tag(self.dropout)}'

  def overrides(self) -> dict:
    """The arm's, and the dropout rate on embeddings, residual branches, the MLP's hidden layer
    and the attention probabilities (BERT's `hidden_dropout_prob` and
    `attention_probs_dropout_prob` in one number); none without dropout, which is the config's."""
    drop = {DROPOUT: self.dropout, ATTENTION_DROPOUT: self.dropout} if self.dropout else {}
    return {**self.arm.overrides(), **drop}


def _drop_tag(dropout: float) -> str:
  """'-drop0.1' in run names, plots and README sections of a plan with dropout; '' without."""
  return f'-drop{dropout:g}' if dropout else ''


@dataclasses.dataclass(frozen=True)
class Plan:
  """What a stage runs: the budget and grid, and where the runs and their results go."""

  steps: int = STEPS
  rates: tuple[float, ...] = RATES
  arms: tuple[Arm, ...] = LR_ARMS
  seeds: tuple[int, ...] = SEEDS
  eval_batches: int = EVAL_BATCHES
  final_batches: int = -1  # the final evaluation: -1, the whole validation split
  out_dir: pathlib.Path = OUT
  runs_dir: pathlib.Path = pathlib.Path('runs')
  rate_steps: int | None = None  # the budget whose stage-lr sweep picks the rates (None: steps)
  dropout: float = 0.0  # stages seeds and width; stage lr never (see rate_plan)

  def __post_init__(self):
    if not 0.0 <= self.dropout < 1.0:
      raise ValueError(f'dropout={self.dropout!r} must be in [0, 1).')

  @property
  def rate_plan(self) -> 'Plan':
    """The plan of the stage-lr runs that pick each arm's rate: this one, or the same grid at
    `rate_steps` (a longer budget reusing a shorter budget's rate sweep), always without
    dropout: a plan with dropout takes its rates from the sweep without (a deviation its
    README section names), which at 1.3 passes over the data barely overfits."""
    if self.rate_steps in (None, self.steps) and not self.dropout:
      return self
    return dataclasses.replace(
        self, steps=self.rate_steps or self.steps, rate_steps=None, dropout=0.0
    )

  @property
  def tag(self) -> str:
    """The suffix of this budget's README section and plots ('' for the default budget)."""
    return ('' if self.steps == STEPS else f'-{self.steps}st') + _drop_tag(self.dropout)

  @classmethod
  def smoke(cls, runs_dir: pathlib.Path) -> 'Plan':
    smoke_dir = runs_dir / 'smoke'
    return cls(
        steps=SMOKE_STEPS,
        rates=SMOKE_RATES,
        arms=SMOKE_ARMS,
        eval_batches=SMOKE_EVAL_BATCHES,
        final_batches=SMOKE_EVAL_BATCHES + 1,
        out_dir=smoke_dir,
        runs_dir=smoke_dir,
    )


# ------------------------------------------------------------------------------- the runs


def schedule(steps: int, eval_batches: int = EVAL_BATCHES) -> dict:
  """The config fields that follow a run's length: warmup, evaluations, checkpoints, logs."""
  every = max(1, steps // EVALS)
  return {
      'num_train_steps': steps,
      'warmup_steps': max(1, round(steps * WARMUP_SHARE)),
      'eval_every_steps': every,
      'num_eval_steps': eval_batches,
      'checkpoint_every_steps': every,
      'keep_checkpoints': KEEP_CHECKPOINTS,
      'log_every_steps': max(1, steps // 100),
  }


def make_run(point: Point, plan: Plan) -> runner.Run:
  overrides = {
      **point.overrides(),
      'learning_rate': point.lr,
      **schedule(point.steps, plan.eval_batches),
      'data.tfds_data_dir': str(plan.runs_dir / 'tfds'),  # the data set, prepared once
  }
  return runner.train_run(
      point.name,
      CONFIG,
      seed=point.seed,
      overrides=overrides,
      collect=functools.partial(collect, final_batches=plan.final_batches),
      # The final evaluation in the run's own attempt: collecting it in the grid's process
      # would keep the next runs from starting while it lasts.
      then=[evaluate_command('{rundir}', plan.final_batches)],
  )


def evaluate_command(rundir, batches: int) -> list[str]:
  return [sys.executable, '-m', MODULE, f'--evaluate_run={rundir}', f'--eval_batches={batches}']


def lr_points(plan: Plan, arms: Sequence[Arm] | None = None) -> list[Point]:
  """Stage lr: every arm at every rate, seed 0."""
  return [
      Point(arm, lr, 0, plan.steps, plan.dropout) for arm in arms or plan.arms for lr in plan.rates
  ]


def best_rates(
    finals: Mapping[str, float], arms: Iterable[Arm], plan: Plan
) -> tuple[dict[Arm, float], list[str]]:
  """Per arm whose rate sweep is complete in `finals` (run name -> final bits/char; a run that
  diverged: inf), its rate of lowest final bits/char (the lower rate on a tie). Returns those
  rates and a note per arm left out (a rate without a result, or every rate diverged)."""
  best, notes = {}, []
  for arm in arms:
    points = lr_points(plan, [arm])
    missing = [p.name for p in points if p.name not in finals]
    if missing:
      notes.append(f'{arm.label}: no rate picked, no result yet for {", ".join(missing)}')
      continue
    point = min(points, key=lambda p: (finals[p.name], p.lr))
    if not math.isfinite(finals[point.name]):
      notes.append(f'{arm.label}: no rate picked, every rate diverged')
      continue
    best[arm] = point.lr
  return best, notes


def seed_points(best: Mapping[Arm, float], plan: Plan) -> list[Point]:
  """Stage seeds: each arm at its best rate, every seed (seed 0 is stage lr's run)."""
  return [
      Point(arm, lr, seed, plan.steps, plan.dropout)
      for arm, lr in best.items()
      for seed in plan.seeds
  ]


@functools.cache
def arm_config(arm: Arm):
  """configs/lm.py:bottleneck with the arm's overrides (validated)."""
  from lowrank_attn import runs  # pylint: disable=import-outside-toplevel

  path = runner.REPO_ROOT / CONFIG.split(':')[0]
  spec = importlib.util.spec_from_file_location('lm_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return runs.with_overrides(module.get_config(CONFIG.split(':')[1]), arm.overrides())


@functools.cache
def train_flops_per_token(arm: Arm) -> float:
  """Training FLOPs per token (3 x the model's analytic forward FLOPs, as the sweep counts)."""
  return sweep.model_size(arm_config(arm), VOCAB_SIZE)['train_flops_per_token']


def equal_compute_steps(steps: int, flops_other: float, flops_own: float) -> int:
  """The steps at which a model of `flops_own` per step spends what `steps` steps of a model of
  `flops_other` per step spend."""
  return round(steps * flops_other / flops_own)


def width_flops(in_subprocess: bool = False) -> dict[Arm, float]:
  """`train_flops_per_token` of the width stage's two models; computed by a process of its own
  if `in_subprocess` (the grid's process then starts no JAX threads before it forks)."""
  arms = (WIDTH_ARM, WIDTH_BASELINE)
  if not in_subprocess:
    return {arm: train_flops_per_token(arm) for arm in arms}
  command = [sys.executable, '-m', MODULE, '--print_width_flops']
  done = subprocess.run(command, cwd=runner.REPO_ROOT, capture_output=True, text=True, check=True)
  values = json.loads(done.stdout.strip().splitlines()[-1])
  return {arm: values[arm.key] for arm in arms}


def width_points(
    best: Mapping[Arm, float], plan: Plan, flops: Mapping[Arm, float]
) -> dict[str, list[Point]]:
  """Stage width at the arms' best rates: {'equal steps': ..., 'equal compute': ...}; in the
  second, the model with fewer training FLOPs per token (`flops`) trains longer by the ratio."""
  arms = (WIDTH_ARM, WIDTH_BASELINE)
  cheap, dear = sorted(arms, key=flops.get)
  longer = equal_compute_steps(plan.steps, flops[dear], flops[cheap])
  at = lambda arm, steps: [Point(arm, best[arm], s, steps, plan.dropout) for s in plan.seeds]
  return {
      'equal steps': at(WIDTH_ARM, plan.steps) + at(WIDTH_BASELINE, plan.steps),
      'equal compute': at(dear, plan.steps) + at(cheap, longer),
  }


def unique(points: Iterable[Point]) -> list[Point]:
  seen, out = set(), []
  for point in points:
    if point.name not in seen:
      seen.add(point.name)
      out.append(point)
  return out


# ------------------------------------------------------------------- results of one run


def flatness(curve: Sequence[Sequence[float]], window: int, tol: float = FLAT_TOL) -> dict:
  """Whether a learning curve [(step, bits/char), ...] (ascending steps) has flattened: its
  last point against the latest one at least `window` steps earlier. `flat` is None when the
  curve has no such earlier point."""
  if not curve:
    return {'flat': None, 'last_change': None, 'last_change_from': None}
  last_step, last = curve[-1]
  earlier = [(step, value) for step, value in curve if step <= last_step - window]
  if not earlier:
    return {'flat': None, 'last_change': None, 'last_change_from': None}
  step, value = earlier[-1]
  change = last - value
  return {'flat': abs(change) < tol, 'last_change': change, 'last_change_from': step}


def train_curve(train: Sequence[Mapping], eval_steps: Sequence[int]) -> list[list[float]]:
  """[(step, bits/char)] at each evaluation step: the mean training loss logged since the
  evaluation before it (the model still moves over the interval, so it sits a little above the
  training loss at the step itself). An interval with no training line is left out."""
  out, start = [], -math.inf
  for step in eval_steps:
    losses = [m['loss'] for m in train if start < m['step'] <= step]
    if losses:
      out.append([step, sum(losses) / len(losses) / math.log(2)])
    start = step
  return out


def collect(rundir: pathlib.Path, final_batches: int = -1) -> dict:
  """The runner's record of the run with its periodic curve, its flatness, and (from
  `evaluate_run`, in a process of its own: the grid's process stays free of JAX threads, which
  its next fork would inherit) bits/char on the whole validation split (`final_batches`
  batches if not -1), parameters and training FLOPs."""
  out = runner.read_run(rundir)
  final = final_evaluation(rundir, final_batches)
  if final['vocab_size'] != VOCAB_SIZE:
    raise ValueError(
        f'{rundir}: vocabulary of {final["vocab_size"]} symbols, not the {VOCAB_SIZE} that '
        'sized the equal-compute FLOPs: update VOCAB_SIZE'
    )
  evals = [m for m in out['metrics'] if m['split'] == 'eval']
  if not evals:
    raise ValueError(f'{rundir}: no eval line in metrics.jsonl')
  curve = [[m['step'], m['loss'] / math.log(2)] for m in evals]
  # Every train line of metrics.jsonl: `read_run` keeps only a few (what results.json stores).
  train = [m for m in runner.read_metrics(rundir) if m['split'] == 'train']
  train_bits = train_curve(train, [step for step, _ in curve])
  every = out['full_config']['eval_every_steps']
  window = train_curve(train, [curve[-1][0] - every, curve[-1][0]])
  end = window[-1][1] if window and window[-1][0] == curve[-1][0] else None
  out['result'] = {
      **out['result'],
      **{key: final[key] for key in SIZE_KEYS},
      'bits_per_char': final['loss'] / math.log(2),
      'bits_per_char_periodic': curve[-1][1],  # the last periodic evaluation
      'final_eval': {k: v for k, v in final.items() if k not in SIZE_KEYS},
      'curve': curve,
      'train_curve': train_bits,
      # Against bits_per_char, the gap between the training data and unseen text at the end.
      # Over the run's last eval_every_steps steps (its last evaluation may follow the one
      # before by less: a run of 25,663 steps evaluates at 25,656 and at its end).
      'train_bits_per_char': end,
      'train_secs': max((m.get('train_secs', 0.0) for m in train), default=None),
      **flatness(curve, out['full_config']['eval_every_steps']),
  }
  out['metrics'] = evals  # the train lines every steps/100: the curve is enough
  return out


def final_evaluation(rundir: pathlib.Path, batches: int = -1) -> dict:
  """`evaluate_run`'s record, run in a process of its own once and cached in the run dir; run
  again where the cached one predates `validation_rows` and the final checkpoint is still there
  (the grid's `--refresh` so gives surviving runs their rows)."""
  rundir = pathlib.Path(rundir)
  path = rundir / WHOLE_FILE
  record = runner.files.read_json(path)
  steps = (runner.files.read_json(rundir / 'config.json') or {}).get('num_train_steps')
  rows_missing = record is not None and 'row_nll' not in record
  if rows_missing and not (rundir / 'checkpoints' / str(steps)).is_dir():
    rows_missing = False  # keep the record: nothing to score again
  if record is None or record.get('batches') != batches or rows_missing:
    command = evaluate_command(rundir, batches)
    done = subprocess.run(command, cwd=runner.REPO_ROOT, capture_output=True, text=True)
    if done.returncode != 0:
      raise RuntimeError(f'{" ".join(command)} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}')
    record = runner.files.read_json(path)
  return record


def evaluate_run(rundir: pathlib.Path, batches: int = -1) -> dict:
  """Loss on the validation split (`batches` batches; -1: all) of a finished run's last
  checkpoint, with the training loop's own eval step and evaluators; written to WHOLE_FILE."""
  # pylint: disable=import-outside-toplevel
  import jax

  from lowrank_attn import tasks as tasks_lib
  from lowrank_attn.runs import RunDir, write_atomic
  from lowrank_attn.train import state as state_lib

  start = time.monotonic()
  run = RunDir(rundir)
  config = run.config
  step = run.check_step()
  if step != config.num_train_steps:
    raise ValueError(
        f'{rundir}: last checkpoint {step}, not the run length {config.num_train_steps}'
    )
  s = run.setup(config)
  pipeline = tasks_lib.make_pipeline(
      config.data,
      split=config.eval_split,
      seed=config.seed,
      global_batch_size=config.per_device_batch_size * jax.device_count(),
      train=False,
      workdir=run.path,
  )
  _, lowered = state_lib.lower_steps(s, pipeline.element_spec, pipeline.element_spec)
  eval_step = lowered.compile()
  params = run.restore_params(step, s.abstract_state['params'])
  context = tasks_lib.EvalContext(s, eval_step, run.tokenizer)
  metrics = {}
  for evaluator in s.task.make_evaluators(context):
    metrics.update(evaluator.evaluate(params, pipeline, batches))
  rows = validation_rows(context, params, pipeline, batches)
  if sum(rows['row_tokens']) != metrics['tokens'] or not math.isclose(
      sum(rows['row_nll']), metrics['loss'] * metrics['tokens'], rel_tol=ROW_SUM_TOL
  ):
    raise RuntimeError(
        f'{rundir}: the rows sum to {sum(rows["row_nll"]):.1f} nats over '
        f'{sum(rows["row_tokens"])} tokens, the evaluation to '
        f'{metrics["loss"] * metrics["tokens"]:.1f} over {metrics["tokens"]:.0f}'
    )
  vocab_size = run.tokenizer.vocab_size
  record = {
      'step': step,
      'split': config.eval_split,
      'batches': batches,
      **metrics,
      **rows,
      'seconds': round(time.monotonic() - start, 1),
      **sweep.model_size(config, vocab_size),
      'vocab_size': vocab_size,
  }
  write_atomic(pathlib.Path(rundir) / WHOLE_FILE, json.dumps(record, indent=1))
  print(json.dumps(record))
  return record


def validation_rows(context, params, pipeline, batches: int = -1) -> dict:
  """Each validation row's summed nll in nats (`row_nll`, 3 decimals) and tokens (`row_tokens`),
  padding rows left out, in the split's order, and a digest of their targets (`rows_digest`):
  the units of `text_interval`, which pairs runs row by row only where they saw the same text."""
  # pylint: disable=import-outside-toplevel
  import hashlib

  import jax

  from lowrank_attn.train import steps

  s = context.setup
  row_sums = jax.jit(functools.partial(steps.row_sums, options=s.options))
  nll, tokens, digest = [], [], hashlib.sha256()
  for batch in context.batches(pipeline, batches):
    with s.activate():
      sums = jax.device_get(row_sums(params, s.global_batch(batch)))
    keep = np.asarray(sums['weight']) > 0
    nll += [round(float(x), 3) for x in np.asarray(sums['nll'])[keep]]
    tokens += [int(x) for x in np.asarray(sums['weight'])[keep]]
    digest.update(np.asarray(batch['targets'], np.int32)[keep].tobytes())
  return {'row_nll': nll, 'row_tokens': tokens, 'rows_digest': digest.hexdigest()[:16]}


# ----------------------------------------------------------------------------- reporting


def finished(results) -> dict[str, dict]:
  """Run name -> the collected result (with wall time and machine) of each finished run."""
  return {
      run['name']: {
          **(run.get('result') or {}),
          'wall_time_s': run.get('wall_time_total_s', run.get('wall_time_s')),
          'machine': machine_name(run.get('machine') or {}),
      }
      for run in results['runs']
  }


def machine_name(machine: Mapping) -> str:
  """A run's machine in a few words: its GPU where it had one, else its CPU."""
  return (machine.get('gpus') or [machine.get('cpu', '?')])[0]


def diverged(plan: Plan, names: Iterable[str], done: Mapping[str, dict]) -> set[str]:
  """The runs among `names` without a result whose log says their loss became NaN/inf."""
  out = set()
  for name in names:
    log = plan.runs_dir / name / runner.LOG_FILE
    if name not in done and log.exists() and 'non-finite' in log.read_text(errors='replace'):
      out.add(name)
  return out


def finals(plan: Plan, points: Iterable[Point], done: Mapping[str, dict]) -> dict[str, float]:
  """Run name -> final bits/char for `best_rates`: inf for a run that diverged."""
  points = list(points)
  out = {p.name: done[p.name]['bits_per_char'] for p in points if p.name in done}
  out.update({name: math.inf for name in diverged(plan, [p.name for p in points], done)})
  return out


def row(point: Point, result: Mapping) -> dict:
  final_s = (result.get('final_eval') or {}).get('seconds', 0.0)
  return {
      'run': point.name,
      'arm': point.arm.label,
      'kind': point.arm.kind,
      'key': point.arm.key,
      'h': point.arm.heads,
      'd': point.arm.d,
      'D': point.arm.emb_dim,
      'lr': point.lr,
      'seed': point.seed,
      'steps': point.steps,
      'bits_per_char': result['bits_per_char'],
      'flat': result.get('flat'),
      'last_change': result.get('last_change'),
      'train_bits_per_char': result.get('train_bits_per_char'),
      'params': result['params'],
      'train_flops': result['train_flops'],
      'minutes': (result['wall_time_s'] + final_s) / 60,
      'machine': result.get('machine', '?'),
      'curve': result.get('curve', []),
      'rows': _rows(result.get('final_eval') or {}),
  }


def _rows(final_eval: Mapping) -> tuple | None:
  """(row_nll, row_tokens, rows_digest) of `validation_rows`; None for a run collected before
  they were recorded."""
  if 'row_nll' not in final_eval:
    return None
  return final_eval['row_nll'], final_eval['row_tokens'], final_eval['rows_digest']


def seed_summary(rows: Sequence[dict]) -> list[dict]:
  """Rows grouped over seeds: mean, each seed's value, range, all flattened?"""
  groups: dict[tuple, list] = {}
  for r in rows:
    groups.setdefault((r['key'], r['lr'], r['steps']), []).append(r)
  out = []
  for members in groups.values():
    members = sorted(members, key=lambda r: r['seed'])
    values = [r['bits_per_char'] for r in members]
    flats = [r['flat'] for r in members]
    trains = [r.get('train_bits_per_char') for r in members]
    out.append(
        {
            **{
                k: members[0][k]
                for k in ('arm', 'kind', 'key', 'h', 'd', 'D', 'lr', 'steps', 'params')
            },
            'seeds': [r['seed'] for r in members],
            'values': values,
            'bits_per_char': sum(values) / len(values),
            'range': max(values) - min(values),
            'flat': None if None in flats else all(flats),
            'last_change': [r['last_change'] for r in members],
            'train_bits_per_char': None if None in trains else sum(trains) / len(trains),
            'train_flops': members[0]['train_flops'],
            'minutes': [(r['minutes'], r['machine']) for r in members],
            'rows': [r.get('rows') for r in members],
        }
    )
  return out


def _bits(summary: Mapping) -> str:
  if len(summary['values']) == 1:
    return f"{summary['bits_per_char']:.4f}"
  values = ', '.join(f'{v:.4f}' for v in summary['values'])
  return f"{summary['bits_per_char']:.4f} (seeds: {values}; range {summary['range']:.4f})"


def _flat(summary: Mapping) -> str:
  changes = ', '.join(f'{c:+.3f}' for c in summary['last_change'] if c is not None)
  word = {True: 'yes', False: 'no', None: '?'}[summary['flat']]
  return f'{word} ({changes})' if changes else word


def _train(summary: Mapping) -> str | None:
  train = summary.get('train_bits_per_char')
  if train is None:
    return None
  return f"{train:.4f} (gap {summary['bits_per_char'] - train:+.4f})"


def _minutes(summary: Mapping) -> str:
  """The seeds' mean, or where they ran on different machines each one's, not a mean of both."""
  per_seed = summary['minutes']
  if len({machine for _, machine in per_seed}) == 1:
    return f'{sum(minutes for minutes, _ in per_seed) / len(per_seed):.1f}'
  return ', '.join(f'{minutes:.1f} ({machine})' for minutes, machine in per_seed)


def table(
    summaries: Sequence[Mapping], best: Mapping[str, float] | None = None, word: str = 'best'
) -> str:
  """The runs' table, each arm's rate in `best` marked with `word`; the training bits/char
  column only where a run has it (runs collected before it was recorded have not)."""
  mark = lambda s: f' ({word})' if best and best.get(s['key']) == s['lr'] else ''
  train = [(TRAIN_HEADER, _train)] if any(_train(s) for s in summaries) else []
  return runner.markdown_table(
      summaries,
      [
          ('arm', 'kind'),
          ('h', 'h'),
          ('d', 'd'),
          ('D', 'D'),
          ('lr', lambda s: f"{s['lr']:g}{mark(s)}"),
          ('steps', 'steps'),
          ('seeds', lambda s: len(s['seeds'])),
          ('final bits/char', _bits),
          ('flattened? (last change)', _flat),
          *train,
          ('params', lambda s: f"{s['params'] / 1e6:.2f}M"),
          ('train PFLOP', lambda s: f"{s['train_flops'] / 1e15:.3f}"),
          ('minutes per run', _minutes),
      ],
  )


def difference(a: Mapping, b: Mapping, what: str) -> str:
  """A line: a minus b, in means and per seed, against each one's seed range. Where one arm has
  seeds the other lacks (a grid half done), the headline is the mean over the common seeds, so
  that it compares like with like."""
  b_by_seed = dict(zip(b['seeds'], b['values']))
  paired = {s: va - b_by_seed[s] for s, va in zip(a['seeds'], a['values']) if s in b_by_seed}
  per_seed = [f'seed {s}: {d:+.4f}' for s, d in paired.items()]
  delta = a['bits_per_char'] - b['bits_per_char']
  common = ''
  if paired and set(a['seeds']) != set(b['seeds']):
    delta = sum(paired.values()) / len(paired)
    common = f' on the common seed{"s" * (len(paired) > 1)} {", ".join(map(str, paired))}'
  largest = max(a['range'], b['range'])
  if min(len(a['values']), len(b['values'])) < 2:
    # A range over one seed is zero: comparing with it would call any difference real.
    verdict = 'seed noise unmeasured, an arm having one seed'
  elif abs(delta) > largest:
    verdict = 'larger than both seed ranges'
  else:
    verdict = 'within a seed range'
  interval = text_interval(a, b, list(paired))
  note = f"{len(a['values'])} and {len(b['values'])} seeds"
  if interval is None:
    shown, note = '', f'{note}, no interval claimed'
    # Runs collected before the validation rows were recorded have none: the seeds whose runs
    # both have them still give their own difference its interval over the text.
    scored = [s for s in paired if _has_rows(a, s) and _has_rows(b, s)]
    if scored:
      part = text_interval(a, b, scored)
      which = (
          f'seed {scored[0]} alone' if len(scored) == 1 else f"seeds {', '.join(map(str, scored))}"
      )
      note = (
          f'{note} over all of them; {which}, where both runs recorded their validation rows: '
          f'{part.estimate:+.4f} [{part.low:+.4f}, {part.high:+.4f}], the interval resampling '
          'the validation text, not the seeds'
      )
  else:
    shown = f' [{interval.low:+.4f}, {interval.high:+.4f}]'
    note = f'{note}; the interval resamples the validation text, not the seeds'
  return (
      f"- {what}: {delta:+.4f}{shown} bits/char{common} ({a['arm']} at lr {a['lr']:g}, "
      f"{a['steps']} steps: {_bits(a)}; {b['arm']} at lr {b['lr']:g}, {b['steps']} steps: "
      f"{_bits(b)}; {'; '.join(per_seed) or 'no common seed'}): {verdict} ({note})."
  )


def _has_rows(summary: Mapping, seed: int) -> bool:
  rows = summary.get('rows') or [None] * len(summary['seeds'])
  return dict(zip(summary['seeds'], rows))[seed] is not None


def text_interval(a: Mapping, b: Mapping, seeds: Sequence[int]) -> stats.Interval | None:
  """a minus b in bits/char, `seeds` of each averaged, with the 95% paired bootstrap interval
  over the validation split in blocks of BLOCK_ROWS consecutive rows (neighbouring rows share a
  scene, so single rows would understate the spread): how much the difference owes to which
  text was scored, not to training noise (the seed ranges). None unless every run has its rows."""
  by_seed = [dict(zip(x['seeds'], x.get('rows') or [None] * len(x['seeds']))) for x in (a, b)]
  runs = [[side[seed] for seed in seeds] for side in by_seed]
  if not seeds or any(rows is None for side in runs for rows in side):
    return None
  if len({rows[2] for side in runs for rows in side}) != 1:
    raise ValueError(
        f"{a['arm']} and {b['arm']}: runs scored on different validation rows (digests "
        f'{sorted({rows[2] for side in runs for rows in side})}): no paired interval'
    )
  # The same text gives every run the same tokens.
  return block_interval([r[0] for r in runs[0]], [r[0] for r in runs[1]], runs[0][0][1])


def block_interval(nll_a, nll_b, tokens, block_rows: int = BLOCK_ROWS) -> stats.Interval:
  """a minus b in bits/char from per-row nats (`[seeds][rows]` each, seeds averaged) over rows
  of `tokens` characters, with the 95% paired bootstrap interval drawing blocks of `block_rows`
  consecutive rows (the last block holds what is left)."""
  tokens = np.asarray(tokens, np.float64)
  starts = np.arange(0, len(tokens), block_rows)
  blocks = lambda values: np.add.reduceat(np.asarray(values, np.float64), starts, axis=-1)
  block_tokens = blocks(tokens)
  nll_a, nll_b = blocks(nll_a), blocks(nll_b)  # [seeds, blocks]

  def difference(indices):
    (i,) = indices
    return (
        (nll_a[:, i].sum(1).mean() - nll_b[:, i].sum(1).mean())
        / block_tokens[i].sum()
        / math.log(2)
    )

  return stats.bootstrap(difference, [len(starts)])


def plot_rates(rows: Sequence[dict], arms: Sequence[Arm], out: pathlib.Path, ylabel: str) -> None:
  """One panel per arm: the periodic validation curve at each rate (seed 0), each rate in the
  same colour in every panel, also where an arm has not run them all."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=import-outside-toplevel
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel

  arms = [arm for arm in arms if any(r['key'] == arm.key for r in rows)]
  if not arms:
    return
  cols = min(3, len(arms))
  nrows = math.ceil(len(arms) / cols)
  fig = Figure(figsize=(4.2 * cols, 3.2 * nrows), layout='constrained')
  FigureCanvasAgg(fig)
  axes = fig.subplots(nrows, cols, sharey=True, squeeze=False).ravel()
  rates = sorted({r['lr'] for r in rows})
  for ax, arm in zip(axes, arms):
    for r in sorted((r for r in rows if r['key'] == arm.key), key=lambda r: r['lr']):
      steps, bits = zip(*r['curve']) if r['curve'] else ((), ())
      color = f"C{rates.index(r['lr'])}"
      ax.plot(steps, bits, marker='o', markersize=3, color=color, label=f"lr {r['lr']:g}")
    ax.set_title(arm.label, fontsize='small')
    ax.set_xlabel('step')
    ax.grid(alpha=0.3)
    ax.legend(fontsize='small')
  for ax in axes[: len(arms) : cols]:
    ax.set_ylabel(ylabel)
  for ax in axes[len(arms) :]:
    ax.set_visible(False)
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, dpi=110)


def plot_best(rows: Sequence[dict], out: pathlib.Path, title: str, ylabel: str) -> None:
  """One line per arm (its best rate): mean over seeds, band min..max."""
  points = [
      {'arm': f"{r['arm']}, lr {r['lr']:g}, {r['steps']} steps", 'step': step, 'bits': bits}
      for r in rows
      for step, bits in r['curve']
  ]
  if points:
    runner.plot_lines(
        points,
        x='step',
        y='bits',
        group='arm',
        out=out,
        title=title,
        xlabel='step (16 x 128 characters)',
        ylabel=ylabel,
    )


def _before_logging_fix(commit: str) -> bool | None:
  """Whether `commit` lacks LOGGING_FIX; None where git cannot tell (no repository here, or
  a commit it does not have)."""
  try:
    code = subprocess.run(
        ['git', 'merge-base', '--is-ancestor', LOGGING_FIX, commit],
        cwd=HERE,
        capture_output=True,
        check=False,
    ).returncode
  except OSError:
    return None
  return {0: False, 1: True}.get(code)


def train_records_note(results, names: Iterable[str], out_dir: pathlib.Path) -> str:
  """How many of the runs `names` with a training column logged it the old way (their last
  attempt's commit), and what such records covered (`train_records.py`'s JSON in out_dir,
  intervals past each run's first quarter, where the loss drifts little)."""
  names = set(names)
  runs = [
      run
      for run in results['runs']
      if run['name'] in names and (run.get('result') or {}).get('train_bits_per_char') is not None
  ]
  before = [_before_logging_fix(run['code'][-1]['commit']) for run in runs if run.get('code')]
  if all(b is False for b in before):  # no run, or every one logged the new way
    return ''
  unknown = f' ({before.count(None)} unknown to git here)' if None in before else ''
  note = (
      f' {before.count(True)} of the {len(runs)} runs with that column{unknown} trained before '
      f'{LOGGING_FIX}, where a training record was the mean over the steps since the step '
      'metrics were last fetched (a save, an evaluation, the progress line every 5 s), not over '
      'all the steps since the record before: a sample of the last twelfth, not all of it.'
  )
  path = out_dir / TRAIN_RECORDS
  read = json.loads(path.read_text()) if path.exists() else {}
  late = [i for r in read.values() for i in r['intervals'] if i['end'] > r['num_train_steps'] / 4]
  if late:
    shares = [i['steps_covered'] / i['steps'] for i in late]
    errors = [i['standard_error'] for i in late]
    median = float(np.median(errors))
    note += (
        f' Read from {len(read)} runs while they trained on this CPU (`{path.parent.name}/'
        f'{TRAIN_RECORDS}`, {len(late)} intervals past their first quarter), such records '
        f"covered {min(shares):.1%}-{max(shares):.1%} of an interval's steps, and their spread "
        f'puts the standard error of its mean at {min(errors):.3f}-{max(errors):.3f} bits/char '
        f'(median {median:.3f}), so the difference of two such runs has a 95% half-width of '
        f'about {1.96 * math.sqrt(2) * median:.3f} at the median. A run on a GPU, hundreds of '
        'steps between two progress lines, sampled a larger share (not measured: their '
        'directories are gone).'
    )
  return note


def report(results, plan: Plan, failures: Mapping[str, str] | None = None) -> str:
  """The README section: its runs' summary (only the runs it reports: a results.json holds
  every budget's), then per stage its table, plots and differences."""
  done = finished(results)
  ylabel = f'validation bits/char ({plan.eval_batches} batches)'
  rel = lambda path: path.relative_to(plan.out_dir.parent).as_posix()
  body = stages_report(plan, done, ylabel, rel)
  reported = [p.name for p in body.points]
  if plan.dropout:  # the runs without dropout that dropout_effect compares with
    reported += [dataclasses.replace(p, dropout=0.0).name for p in body.points if p.name in done]
  tabled = [r for rows in body.tables for r in rows]
  lines = [
      runner.runs_summary(results, reported),
      '',
      f'Budget: {plan.steps} steps of 16 x 128 characters '
      f'({plan.steps * 16 * 128:,} characters) per run unless stated; final bits/char '
      'on the whole validation split; curves: the periodic evaluations on its first '
      f'{plan.eval_batches} batches. Flattened: the last two periodic evaluations differ by '
      f'less than {FLAT_TOL} bits/char (the change in brackets).'
      + (
          f' Rates: the best of the {plan.rate_plan.steps}-step sweep (stage lr below).'
          if plan.rate_plan is not plan
          else ''
      )
      + (
          f' Dropout {plan.dropout:g} on the embeddings, every residual branch, the MLP hidden '
          "layer and the attention probabilities in stages seeds and width (BERT's rate); the "
          'rate sweep ran without.'
          if plan.dropout
          else ''
      )
      + (
          f' {TRAIN_HEADER}: the mean training loss logged over the last twelfth of the run '
          '(seed means), and the final bits/char minus it: the gap between text seen in training '
          'and unseen text'
          + (', the training loss measured with dropout on.' if plan.dropout else '.')
          + train_records_note(results, reported, plan.out_dir)
          if any(r.get('train_bits_per_char') is not None for r in tabled)
          else ''
      ),
      '',
      *body.lines,
  ]
  return _with_failures(lines, failures, body.diverged)


@dataclasses.dataclass
class _Stages:
  """The stages' part of a README section: its lines, the runs it reports (finished or not),
  the rows of its tables and the runs that diverged."""

  lines: list[str]
  points: list[Point]
  tables: list[list[dict]]
  diverged: set[str]


def stages_report(plan: Plan, done: Mapping[str, dict], ylabel: str, rel) -> _Stages:
  """Per stage its table, plots and differences (`report` puts the summary above them)."""
  lines, tables = [], []
  # Stage lr (at the budget that picks the rates).
  rp = plan.rate_plan
  lr_pts = lr_points(rp)
  rows_lr = [row(p, done[p.name]) for p in lr_pts if p.name in done]
  best, notes = best_rates(finals(rp, lr_pts, done), plan.arms, rp)
  width_lr = lr_points(rp, [WIDTH_ARM])
  bad = diverged(plan, [p.name for p in lr_pts + width_lr], done)
  tables.append(rows_lr)
  lines += [
      f'**Stage lr** (seed 0, every rate, {rp.steps} steps):',
      '',
      table(seed_summary(rows_lr), _by_key(best)),
  ]
  if bad:
    lines += [
        f'Diverged (loss NaN/inf, no result; stages lr and width): {", ".join(sorted(bad))}.',
        '',
    ]
  lines += [f'- {note}' for note in notes] + ([''] if notes else [])
  if rows_lr:
    rates_png = plan.out_dir / f'convergence_rates{rp.tag}.png'
    plot_rates(rows_lr, plan.arms, rates_png, ylabel)
    lines += [f'![learning curves per arm and rate]({rel(rates_png)})', '']
  check = rate_check(plan, done, ylabel, rel) if rp is not plan and not plan.dropout else None
  if check:
    lines += check.lines
    tables += check.tables
  # Stage seeds.
  rows_seeds = [row(p, done[p.name]) for p in seed_points(best, plan) if p.name in done]
  tables.append(rows_seeds)
  if rows_seeds:
    summaries = {s['key']: s for s in seed_summary(rows_seeds)}
    best_png = plan.out_dir / f'convergence_best{plan.tag}.png'
    plot_best(rows_seeds, best_png, 'Each arm at its best rate (min-max over seeds)', ylabel)
    lines += [
        '**Stage seeds** (each arm at its best rate):',
        '',
        table(list(summaries.values())),
        f'![learning curves at the best rates]({rel(best_png)})',
        '',
    ]
    diffs = []
    for h in sorted({arm.heads for arm in plan.arms}):
      fixed, concat = Arm(h, head_dim=LENGTH).key, Arm(h).key
      if fixed in summaries and concat in summaries:
        diffs.append(difference(summaries[fixed], summaries[concat], f'h = {h}'))
    if diffs:
      lines += [
          'fixed_head (d_p = n = 128) minus concat at the same h (negative: fixed_head better):',
          '',
          *diffs,
          '',
      ]
    else:
      lines += [
          'No fixed_head run has finished beside concat at the same h at this budget yet: no '
          'difference.',
          '',
      ]
  # Stage width.
  trained = seed_points(best, plan)  # stages seeds and width: what dropout_effect compares
  rows_wlr = [row(p, done[p.name]) for p in width_lr if p.name in done]
  tables.append(rows_wlr)
  if rows_wlr:
    wbest, wnotes = best_rates(
        finals(rp, width_lr + lr_points(rp, [WIDTH_BASELINE]), done),
        (WIDTH_ARM, WIDTH_BASELINE),
        rp,
    )
    lines += [
        f'**Stage width**: {WIDTH_ARM.label} (MLP {4 * WIDTH_ARM.emb_dim}) against '
        f"{WIDTH_BASELINE.label}; the D = 128 model's own rate sweep (seed 0):",
        '',
        table(seed_summary(rows_wlr), _by_key(wbest)),
    ]
    lines += [f'- {note}' for note in wnotes] + ([''] if wnotes else [])
    if len(wbest) == 2:
      flops = width_flops()
      groups = width_points(wbest, plan, flops)
      lines += [
          f'Training FLOPs per token (analytic): {WIDTH_ARM.label} {flops[WIDTH_ARM] / 1e6:.2f}M, '
          f'{WIDTH_BASELINE.label} {flops[WIDTH_BASELINE] / 1e6:.2f}M (ratio '
          f'{flops[WIDTH_ARM] / flops[WIDTH_BASELINE]:.3f}); at equal compute the cheaper one '
          'trains the longer run below.',
          '',
      ]
      trained += sum(groups.values(), [])
      rows_w = [row(p, done[p.name]) for p in unique(sum(groups.values(), [])) if p.name in done]
      tables.append(rows_w)
      if rows_w:
        png = plan.out_dir / f'convergence_width{plan.tag}.png'
        lines += width_comparison(rows_w, groups, png, ylabel)
        lines += ['', f'![width stage learning curves]({rel(png)})']
      else:
        with_dropout = f' with dropout {plan.dropout:g}' if plan.dropout else ''
        lines += [f'No run of {plan.steps} steps{with_dropout} has finished yet.']
  if plan.dropout:
    lines += dropout_effect(plan, trained, done)
  checked = check.points if check else []
  return _Stages(lines, unique(lr_pts + width_lr + trained + checked), tables, bad)


def rate_check(plan: Plan, done: Mapping[str, dict], ylabel: str, rel) -> _Stages | None:
  """A budget taking its rates from a shorter budget's sweep (`--rate_steps`): stage lr's runs
  at this budget (seed 0, the width arm's sweep with them) as far as they have run, once one
  at a rate other than the picked one has: whether the pick holds here, and fixed_head minus
  concat at equal rates. None before that (the picked rates' runs are stage seeds' seed 0)."""
  rp, arms = plan.rate_plan, (*plan.arms, WIDTH_ARM)
  here = dataclasses.replace(rp, steps=plan.steps)
  picked = _by_key(best_rates(finals(rp, lr_points(rp, arms), done), arms, rp)[0])
  points = lr_points(here, arms)
  rows = [row(p, done[p.name]) for p in points if p.name in done]
  if all(picked.get(r['key']) == r['lr'] for r in rows):
    return None
  by = {(s['key'], s['lr']): s for s in seed_summary(rows)}
  lines = [
      f'**Stage lr at {plan.steps} steps** (seed 0) as far as it has run, {len(rows)} of '
      f'{len(points)} runs: does the rate picked at {rp.steps} steps ("picked"; its runs are '
      "stages seeds' and width's seed 0) hold at this budget?",
      '',
      table(list(by.values()), picked, word='picked'),
  ]
  best, notes = best_rates(finals(here, points, done), arms, here)
  lines += [
      f'- {arm.label}: best at {plan.steps} steps lr {lr:g}, at {rp.steps} steps '
      f'{picked[arm.key]:g}.'
      for arm, lr in best.items()
      if arm.key in picked
  ]
  # Each swept arm's other rates against its best: by how much the best leads, with the paired
  # interval over the validation text where both runs recorded their rows.
  behind = [
      difference(by[arm.key, lr], by[arm.key, top], f'{arm.label}, lr {lr:g} minus {top:g}')
      for arm, top in best.items()
      for lr in plan.rates
      if lr != top and math.isfinite(by[arm.key, lr]['bits_per_char'])
  ]
  if behind:
    lines += ['', f'Each swept arm, its other rates minus its best at {plan.steps} steps:', '']
    lines += behind
  # Where the best rate's run predates the validation rows, the lines above claim no interval;
  # its other rates against each other still have one where both runs recorded their rows.
  recorded = lambda s: all(_has_rows(s, seed) for seed in s['seeds'])
  among = [
      difference(worse, better, f"{arm.label}, lr {worse['lr']:g} minus {better['lr']:g}")
      for arm, top in best.items()
      if (arm.key, top) in by and not recorded(by[arm.key, top])
      for a, b in itertools.combinations(
          [by[arm.key, lr] for lr in plan.rates if lr != top and (arm.key, lr) in by], 2
      )
      if recorded(a) and recorded(b)
      for worse, better in [sorted((a, b), key=lambda s: -s['bits_per_char'])]
  ]
  if among:
    lines += [
        '',
        'Where the best rate ran before runs recorded their validation rows, the other two '
        'rates, the worse minus the better:',
        '',
        *among,
    ]
  diffs = [
      difference(by[fixed, lr], by[concat, lr], f'h = {h}, lr {lr:g}')
      for h in sorted({arm.heads for arm in plan.arms})
      for fixed, concat in [(Arm(h, head_dim=LENGTH).key, Arm(h).key)]
      for lr in plan.rates
      if (fixed, lr) in by and (concat, lr) in by
  ]
  if diffs:
    lines += [
        '',
        f'fixed_head minus concat at the same h and rate, {plan.steps} steps (negative: '
        'fixed_head better):',
        '',
        *diffs,
    ]
  png = plan.out_dir / f'convergence_rates{plan.tag}.png'
  plot_rates(rows, arms, png, ylabel)
  lines += ['', f'![learning curves per arm and rate, {plan.steps} steps]({rel(png)})', '']
  own_lines, own_points, own_rows = at_own_best_rates(plan, best, notes, done)
  lines += own_lines
  return _Stages(lines, unique(points + own_points), [rows, own_rows], set())


def at_own_best_rates(
    plan: Plan, best: Mapping[Arm, float], notes: Sequence[str], done: Mapping[str, dict]
) -> tuple[list[str], list[Point], list[dict]]:
  """Each arm whose rate sweep at this budget is complete (`best`, its best rate there), at
  that rate with the plan's seeds as far as they have run: the issue's seeds at the best rate
  of the budget where the curves flatten, which stage seeds of `--rate_steps` takes from the
  shorter sweep instead. Then fixed_head minus concat at the same h, and the width arm minus
  concat D = 256 at equal steps, each at its own best rate; `notes`: the arms left out (their
  sweep unfinished). Returns the lines, the runs they report (finished or not) and the rows of
  their table."""
  points = [Point(arm, lr, seed, plan.steps) for arm, lr in best.items() for seed in plan.seeds]
  rows = [row(p, done[p.name]) for p in points if p.name in done]
  if not rows:
    return [], points, rows
  by = {s['key']: s for s in seed_summary(rows)}
  # The issue asks for the default seeds; a further seed some stage ran is shown, not awaited.
  missing = [p.name for p in points if p.name not in done and p.seed in SEEDS]
  lines = [
      f'**Each arm at its best rate at {plan.steps} steps** (the sweep above, where it is '
      f'complete), seeds {", ".join(map(str, plan.seeds))} as far as they have run:',
      '',
      table(list(by.values())),
  ]
  lines += [f'- {note}' for note in notes]
  if missing:
    lines.append(f'- Not finished yet at these rates: {", ".join(missing)}.')
  lr = lambda key: f"lr {by[key]['lr']:g}"
  pairs = [
      (Arm(h, head_dim=LENGTH).key, Arm(h).key, f'h = {h}, fixed_head at {{}} minus concat at {{}}')
      for h in sorted({arm.heads for arm in plan.arms})
  ]
  pairs.append(
      (
          WIDTH_ARM.key,
          WIDTH_BASELINE.key,
          'equal steps, fixed_head D = 128 at {} minus concat D = 256 at {}',
      )
  )
  diffs = [
      difference(by[a], by[b], what.format(lr(a), lr(b)))
      for a, b, what in pairs
      if a in by and b in by
  ]
  if diffs:
    lines += [
        *([''] if notes or missing else []),
        f'Each at its best rate at {plan.steps} steps (negative: fixed_head better):',
        '',
        *diffs,
    ]
  return [*lines, ''], points, rows


def width_comparison(
    rows_w: Sequence[dict], groups: Mapping[str, list[Point]], png: pathlib.Path, ylabel: str
) -> list[str]:
  """Stage width at the budget: the table of its runs and its two differences; draws `png`."""
  summaries = seed_summary(rows_w)
  lines = [table(summaries)]
  by = {(s['key'], s['steps']): s for s in summaries}
  for what, points in groups.items():
    keys = list(dict.fromkeys((p.arm.key, p.steps) for p in points))
    if all(k in by for k in keys):
      a, b = (by[k] for k in keys)
      if a['key'] != WIDTH_ARM.key:
        a, b = b, a
      lines.append(difference(a, b, f'{what}, fixed_head D = 128 minus concat D = 256'))
  plot_best(rows_w, png, 'fixed_head D = 128 vs concat D = 256 (min-max over seeds)', ylabel)
  return lines


def dropout_effect(plan: Plan, points: Iterable[Point], done: Mapping[str, dict]) -> list[str]:
  """Per arm and budget of a plan with dropout: its finished runs minus the same runs (arm,
  rate, steps, seeds) without dropout, where those have finished too."""
  pairs: dict[tuple, tuple[list, list]] = {}
  for point in unique(points):
    without = dataclasses.replace(point, dropout=0.0)
    if point.name in done and without.name in done:
      with_rows, without_rows = pairs.setdefault((point.arm.key, point.steps), ([], []))
      with_rows.append(row(point, done[point.name]))
      without_rows.append(row(without, done[without.name]))
  if not pairs:
    return []
  lines = [
      '',
      f'Dropout {plan.dropout:g} minus none, the same arm, rate, steps and seeds (negative: '
      'dropout better):',
      '',
  ]
  for with_rows, without_rows in pairs.values():
    (a,), (b,) = seed_summary(with_rows), seed_summary(without_rows)
    what = f"{a['arm']}, {a['steps']} steps"
    a, b = {**a, 'arm': f'dropout {plan.dropout:g}'}, {**b, 'arm': 'none'}
    lines.append(difference(a, b, what))
  return lines


def _with_failures(lines: list[str], failures: Mapping[str, str] | None, bad) -> str:
  """The report's text, ending with the runs that failed (a diverged run is reported apart)."""
  failures = {k: v for k, v in (failures or {}).items() if k not in bad}
  if failures:
    lines += ['', 'Failed: ' + '; '.join(f'{k} ({v})' for k, v in failures.items())]
  return '\n'.join(lines)


def _by_key(best: Mapping[Arm, float]) -> dict[str, float]:
  return {arm.key: lr for arm, lr in best.items()}


# ----------------------------------------------------------------------------- main


def main(argv=None):
  parser = runner.arg_parser(__doc__, 'bottleneck_convergence')
  parser.add_argument(
      '--stage',
      choices=('all', 'lr', 'seeds', 'width'),
      default='all',
      help='which stage to run (default: all, in order)',
  )
  parser.add_argument(
      '--steps', type=int, default=STEPS, help='training steps per run (default %(default)s)'
  )
  parser.add_argument(
      '--rerun_lost',
      action='store_true',
      help='run again the runs results.json has but whose run directories are gone, so that '
      'they record validation rows and their differences get intervals; their old entries '
      'stand until then',
  )
  parser.add_argument(
      '--rate_steps',
      type=int,
      help="pick each arm's rate from the stage-lr sweep of this budget (default: --steps); "
      'a longer budget then trains stages seeds and width only',
  )
  parser.add_argument(
      '--seeds',
      default=','.join(map(str, SEEDS)),
      help='seeds of stages seeds and width (default %(default)s)',
  )
  parser.add_argument(
      '--dropout',
      type=float,
      default=0.0,
      help='dropout rate of stages seeds and width, at the rates of the sweep without dropout '
      '(run names, plots and README section end in -drop<rate>; default: none, as the config)',
  )
  parser.add_argument(
      '--smoke',
      action='store_true',
      help=f'every stage on {SMOKE_STEPS} steps, two arms and two rates, under <runs_dir>/smoke',
  )
  parser.add_argument('--evaluate_run', help=argparse.SUPPRESS)  # collect's final evaluation
  parser.add_argument('--eval_batches', type=int, default=-1, help=argparse.SUPPRESS)
  parser.add_argument('--print_width_flops', action='store_true', help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.evaluate_run:
    return evaluate_run(pathlib.Path(args.evaluate_run), args.eval_batches)
  if args.print_width_flops:
    flops = {arm.key: value for arm, value in width_flops().items()}
    print(json.dumps(flops))
    return flops
  runs_dir = pathlib.Path(args.runs_dir).resolve()
  if args.smoke:
    plan = dataclasses.replace(Plan.smoke(runs_dir), dropout=args.dropout)
  else:
    seeds = tuple(int(seed) for seed in args.seeds.split(','))
    plan = Plan(
        steps=args.steps,
        runs_dir=runs_dir,
        rate_steps=args.rate_steps,
        seeds=seeds,
        dropout=args.dropout,
    )
  failures: dict[str, str] = {}
  if args.plot_only:
    results = runner.load_results(plan.out_dir)
    failures = {f['name']: f['why'] for f in results.get('failed', [])}
  else:
    options = runner.grid_options(args)
    results = run_stages(plan, args.stage, options, failures, rerun_lost=args.rerun_lost)
  text = report(results, plan, failures)
  if args.smoke:
    (plan.out_dir / 'report.md').write_text(text + '\n')
    print(text)
  else:
    runner.write_section(HERE / 'README.md', SECTION + plan.tag, text)
  failures = {
      name: why
      for name, why in failures.items()
      if name not in diverged(plan, [name], finished(results))
  }
  if failures and not args.plot_only:
    raise SystemExit(f'{len(failures)} runs failed: {", ".join(failures)} (see above; rerun)')
  return results


def run_stages(
    plan: Plan, stage: str, options: dict, failures: dict, rerun_lost: bool = False
) -> dict:
  """Runs the stage(s) in order; each reads the best rates from the runs finished so far.
  rerun_lost: the runs of this budget that results.json records but whose directories are gone
  train again (never a shorter budget's rate sweep, whose picks they would move)."""
  rp = plan.rate_plan

  def grid(points: Iterable[Point], sweep_of: Plan = plan) -> dict:
    points = unique(points)
    # A run whose loss became NaN/inf does so again from its checkpoint (resuming is exact).
    skip = diverged(plan, [p.name for p in points], {})
    skip = {name for name in skip if not (plan.runs_dir / name / runner.DONE_FILE).exists()}
    for name in sorted(skip):
      print(f'convergence: not rerunning {name}: it diverged (its log.txt)', flush=True)
    runs = [make_run(p, plan) for p in points if p.name not in skip]
    again = [run.name for run in runs] if rerun_lost and sweep_of is plan else False
    results = runner.run_grid(
        runs,
        plan.out_dir,
        runs_dir=plan.runs_dir,
        exit_on_failure=False,
        rerun_lost=again,
        **options,
    )
    failures.update({f['name']: f['why'] for f in results['failed']})
    for name in finished(results):  # failed in an earlier stage, finished in this one
      failures.pop(name, None)
    return results

  def picked(points: list[Point], arms: Sequence[Arm]) -> dict[Arm, float]:
    path = plan.out_dir / runner.RESULTS_FILE
    results = runner.load_results(path) if path.exists() else None
    done = finished(results) if results else {}
    best, notes = best_rates(finals(plan, points, done), arms, plan.rate_plan)
    for note in notes:
      print(f'convergence: {note}', flush=True)
    return best

  results = None
  if stage in ('all', 'lr'):
    results = grid(lr_points(rp), rp)
  if stage in ('all', 'seeds'):
    best = picked(lr_points(rp), plan.arms)
    print(f'convergence: best rates {_by_key(best)}', flush=True)
    if best:
      results = grid(seed_points(best, plan))
  if stage in ('all', 'width'):
    sweep_points = lr_points(rp, [WIDTH_ARM, WIDTH_BASELINE])
    results = grid(sweep_points, rp)
    best = picked(sweep_points, (WIDTH_ARM, WIDTH_BASELINE))
    print(f'convergence: width stage rates {_by_key(best)}', flush=True)
    if len(best) == 2:
      flops = width_flops(in_subprocess=True)
      results = grid(sum(width_points(best, plan, flops).values(), []))
  if results is None:
    path = plan.out_dir / runner.RESULTS_FILE
    return runner.load_results(path) if path.exists() else {'runs': [], 'failed': []}
  return results


if __name__ == '__main__':
  main(sys.argv[1:])
