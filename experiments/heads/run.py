"""Heads of the Multi30k translation baseline: L0 gates (Voita et al. 2019), importance pruning
(Michel et al. 2019), random pruning, head roles, and the role map of all-MiniLM-L6-v2.

    python -m experiments.heads.run --base=/work/runs/multi30k/base --runs_dir=/work/runs/heads
    python -m experiments.heads.run --smoke --runs_dir=/tmp/heads_smoke     # minutes, tiny

Every step is a run of `experiments.runner` (resumable: rerun the same command). From the
converged baseline (`configs/nmt.py:multi30k`, a run directory given by --base):
  l0-<types>-<lambda>   fine-tunes head gates (encoder, or all three attention types) with the
                        L0 penalty lambda, gates only, from Voita et al.'s glorot-uniform init;
                        its -eval run scores the gated model and its physically pruned copy.
  analyse               head importance and confidence on the validation split.
  michel-<types>-k<K>   keeps the K most important heads (no retraining); -retrain trains the
                        pruned model for RETRAIN_STEPS steps; random-<types>-k<K>: K random heads.
  roles-base, roles-minilm   head roles on UD English-EWT dev+test (experiments.heads.roles).
BLEU: sacreBLEU on test_2016_flickr (1,000 sentences), beam 4 as the baseline's own evaluation.
The script then writes the tables and plots of README.md.

--protocol=voita: Voita et al.'s own protocol, the whole model fine-tuned with its gates (the
grid above trains the gates alone), and controls at the same budget; results in heads/voita/
and README.md's section `voita`:

    python -m experiments.heads.run --protocol=voita --base=/work/runs/multi30k/base \
        --runs_dir=/work/runs/heads
    python -m experiments.heads.run --protocol=voita --smoke --runs_dir=/tmp/voita_smoke

Every fine-tune starts from the baseline (or its pruned copy) with the same budget and
schedule (`finetune_overrides`): FINETUNE_STEPS = 600 steps, the length of the baseline's
flat tail (validation BLEU 34.81 at step 1,200, 34.86 at 1,500, 35.12 at 1,800:
experiments/multi30k/README.md), a third of its budget; the baseline's schedule (cosine to 0,
a sixth of the steps as warmup: its 300 of 1,800) restarted at FINETUNE_LR = 7e-4, the
baseline's own rate at step 1,200. A fine-tune replays the baseline's last third, where its
training had converged, so 600 steps let a converged model settle again after a change.
  1. analyse; voita-finetune-nogates: the baseline fine-tuned without gates (the control for
     what the fine-tune does on its own); voita-<types>-<lambda>: gates on the encoder (enc)
     or on all three types (all), glorot log-alpha init, L0 penalty lambda in
     VOITA_LAMBDAS, every parameter trainable, the gates at their own peak rate 0.05
     (`gate_learning_rate`, same schedule: at 7e-4 a log-alpha could not travel the ~3 units
     that close a gate).
  2. voita-<types>-<lambda>-eval: `steps evaluate --prune gates` (the gated model, its
     physically pruned copy, the heads kept: K, encoder heads for enc, all heads for all).
  3. prune-random-<types>-k<K>-s<seed> (seeds 0, 1, 2) and prune-importance-<types>-k<K>
     (Michel et al.'s global order from `analyse`): the baseline pruned to each K that a
     lambda left (`steps evaluate --prune_only`; a K of every head has no control to prune).
     prune-l0heads-<types>-<lambda>: the baseline pruned to exactly the heads that lambda's L0
     run kept (`--prune mask`; for each lambda that closed some heads but not all of them).
  4. random-<types>-k<K>-s<seed>-ft, importance-<types>-k<K>-ft, l0heads-<types>-<lambda>-ft:
     each pruned copy fine-tuned like the L0 runs (the pruned heads are gone from the copy, so
     they stay pruned). l0heads separates L0's choice of heads from what its gates do during
     the fine-tune: the same heads, removed before a fine-tune without gates.
The report (`voita_report`) reads each fine-tune's own final evaluation (BLEU on validation and
test), keeps its translations in heads/voita/translations/<run>/ and states B - A with 95%
paired bootstrap intervals (`experiments.stats.bleu_difference`, random's seeds averaged): each
system against the no-gates fine-tune (that one against the baseline), and each L0 run against
random and importance pruning at its own K and against its own heads pruned first; every BLEU
is recomputed from the kept translations first and must equal the recorded one.
"""

import dataclasses
import json
import pathlib
import shutil
import sys

import numpy as np

from experiments import runner

HERE = pathlib.Path(__file__).parent
PYTHON = sys.executable
VOITA_OUT = HERE / 'voita'
VOITA_LAMBDAS = (0.01, 0.03, 0.1, 0.3)
# The budget of every fine-tune of --protocol=voita: the length of the baseline's flat tail
# (validation BLEU 34.81 at step 1,200, 35.12 at 1,800 of its 1,800), a third of its steps.
FINETUNE_STEPS = 600
# Its peak rate: the baseline's own at step 1,200, where that tail starts (2e-3 x (1 +
# cos(pi 900 / 1500)) / 2 = 6.9e-4, its cosine after 300 warmup steps); with the baseline's
# schedule (cosine to 0, a sixth of the steps as warmup) a fine-tune replays its last third.
FINETUNE_LR = 7e-4
RANDOM_SEEDS = (0, 1, 2)


class Settings:
  """The grid: full size, or `--smoke` (tiny model, a few steps, a few sentences)."""

  def __init__(self, smoke: bool, beam_size: int | None = None):
    self.smoke = smoke
    self.beam_size = beam_size  # None: the baseline's own (decode.beam_size, 4)
    if smoke:
      self.lambdas = {'enc': (0.1,), 'all': (0.1,)}
      self.gate_steps, self.retrain_steps = 4, 3
      self.keep = {'enc': (4,), 'all': (12,)}  # of 8 and 24 heads
      self.num_sentences, self.max_batches, self.max_role_sentences = 16, 2, 20
    else:
      # A probe (lambda 0.1, 80 steps) had closed 17 of the 24 encoder gates: lambdas from there
      # down to where few close. With gates on all 9 layers, the penalty (averaged over gated
      # layers, as Voita's) presses each gate 3x less than on the 3 encoder layers: lambda 0.1
      # closed only 9 of 72 gates there, hence 0.3 and 1.0 as well.
      self.lambdas = {'enc': (0.003, 0.01, 0.03, 0.1, 0.3), 'all': (0.01, 0.03, 0.1, 0.3, 1.0)}
      self.gate_steps, self.retrain_steps = 200, 100
      self.keep = {'enc': (20, 16, 12, 8, 4), 'all': (60, 48, 36, 24, 12)}  # of 24 and 72
      self.num_sentences, self.max_batches, self.max_role_sentences = 0, 0, 0
    # Gates only, with a learning rate that lets a log-alpha cross the closing threshold
    # (log(1/11) = -2.4) in a few hundred Adam steps; the rest of the model stays as trained.
    self.gate_lr = 0.05
    # --protocol=voita: the whole model fine-tuned with its gates, and its controls.
    self.finetune_lr = FINETUNE_LR
    if smoke:  # some gates close within 12 steps of the tiny model (~2.4 of log-alpha travel)
      self.voita_lambdas = {'enc': (0.3,), 'all': (1.0,)}
      self.finetune_steps, self.eval_every, self.voita_gate_lr = 12, 6, 0.4
      self.random_seeds = (0, 1)
    else:
      self.voita_lambdas = {'enc': VOITA_LAMBDAS, 'all': VOITA_LAMBDAS}
      self.finetune_steps, self.eval_every = FINETUNE_STEPS, FINETUNE_STEPS // 6
      self.voita_gate_lr = self.gate_lr  # as the gates-only grid and glue_pruning.py
      self.random_seeds = RANDOM_SEEDS


def base_config_file(base: pathlib.Path, runs_dir: pathlib.Path) -> pathlib.Path:
  """A config file holding the baseline's own config (its config.json): fine-tunes start
  from exactly the settings the baseline trained with, whatever configs/ says today."""
  path = runs_dir / 'base_config.py'
  path.write_text(
      f'"""The config of the baseline run {base} (its config.json)."""\n\n'
      'from lowrank_attn.runs import RunDir\n\n\n'
      'def get_config():\n'
      f'  return RunDir({str(base)!r}).config\n'
  )
  return path


def smoke_base(runs_dir: pathlib.Path, args) -> pathlib.Path:
  """A tiny translation run to start from (the real experiment uses the trained baseline)."""
  run = runner.train_run(
      'base',
      'configs/nmt.py:tiny',
      overrides={'num_train_steps': 20, 'decode.num_examples': 0, 'log_every_steps': 10},
  )
  runner.run_grid([run], runs_dir / 'stage-base', runs_dir=runs_dir, parallel=1)
  return runs_dir / 'base'


def steps(*args) -> list[str]:
  return [PYTHON, '-m', 'experiments.heads.steps', *map(str, args)]


# Gates on the encoder, or on all three attention types, from Voita et al.'s glorot-uniform
# log-alpha init (both grids).
GATED = {
    'enc': {
        'model.encoder_attention.gated': True,
        'model.encoder_attention.gate_log_alpha_init': 'glorot',
    },
    'all': {'model.attention.gated': True, 'model.attention.gate_log_alpha_init': 'glorot'},
}


def score_args(s: Settings) -> list:
  """How `steps evaluate` scores every point: test sentences (0: all) and the beam."""
  args = ['--num_sentences', s.num_sentences]
  if s.beam_size:
    args += ['--beam_size', s.beam_size]
  return args


def analyse_run(base: pathlib.Path, s: Settings) -> runner.Run:
  """Head importance and confidence of the baseline (both grids: one run where they share
  --runs_dir)."""
  return runner.Run(
      'analyse',
      steps('analyse', '--run', base, '--out', '{rundir}', '--max_batches', s.max_batches),
      config={'method': 'analyse'},
  )


def grid(base: pathlib.Path, runs_dir: pathlib.Path, s: Settings) -> list[runner.Run]:
  from lowrank_attn.runs import RunDir  # pylint: disable=g-import-not-at-top

  config_file = str(base_config_file(base, runs_dir))
  data = RunDir(base).data_overrides()
  sentences = score_args(s)
  beam = {'decode.beam_size': s.beam_size} if s.beam_size else {}
  runs = [
      runner.Run(
          'base-eval',
          steps('evaluate', '--run', base, '--out', '{rundir}', *sentences),
          config={'method': 'baseline'},
      ),
      analyse_run(base, s),
  ]
  roles = ['--max_sentences', s.max_role_sentences]
  for name, model in (('roles-base', base), ('roles-minilm', 'minilm')):
    runs.append(
        runner.Run(
            name,
            [
                PYTHON,
                '-m',
                'experiments.heads.roles',
                f'--model={model}',
                '--out={rundir}',
                *map(str, roles),
            ],
            config={'method': name},
        )
    )

  for types, lambdas in s.lambdas.items():
    for lam in lambdas:
      name = f'l0-{types}-{lam:g}'
      runs.append(
          runner.train_run(
              name,
              config_file,
              overrides={
                  'init_from': str(base),
                  **data,
                  **GATED[types],
                  'l0_penalty_weight': lam,
                  'trainable': 'gate_log_alpha',
                  'learning_rate': s.gate_lr,
                  'lr_schedule': 'constant',
                  'warmup_steps': 0,
                  'num_train_steps': s.gate_steps,
                  'eval_every_steps': 0,
                  'checkpoint_every_steps': max(s.gate_steps // 3, 1),
                  'decode.num_examples': 0,
                  **beam,
              },
          )
      )
      runs.append(
          runner.Run(
              f'{name}-eval',
              steps(
                  'evaluate',
                  '--run',
                  runs_dir / name,
                  '--out',
                  '{rundir}',
                  '--prune',
                  'gates',
                  *sentences,
              ),
              config={'method': f'L0 gates ({types})', 'lambda': lam, 'types': types},
          )
      )

  for types, keeps in s.keep.items():
    type_arg = 'encoder' if types == 'enc' else 'all'
    for k in keeps:
      name = f'michel-{types}-k{k}'
      runs.append(
          runner.Run(
              name,
              steps(
                  'evaluate',
                  '--run',
                  base,
                  '--out',
                  '{rundir}',
                  '--prune',
                  'importance',
                  '--keep',
                  k,
                  '--types',
                  type_arg,
                  '--importance',
                  runs_dir / 'analyse',
                  *sentences,
              ),
              config={'method': f'importance ({types})', 'k': k, 'types': types},
          )
      )
      if types == 'enc':
        runs.append(
            runner.Run(
                f'{name}-retrain',
                steps(
                    'retrain',
                    '--pruned',
                    runs_dir / name / 'pruned',
                    '--out',
                    '{rundir}',
                    '--steps',
                    s.retrain_steps,
                    *sentences,
                ),
                config={'method': f'importance + retrain ({types})', 'k': k, 'types': types},
            )
        )
      runs.append(
          runner.Run(
              f'random-{types}-k{k}-s0',
              steps(
                  'evaluate',
                  '--run',
                  base,
                  '--out',
                  '{rundir}',
                  '--prune',
                  'random',
                  '--keep',
                  k,
                  '--types',
                  type_arg,
                  '--seed',
                  0,
                  *sentences,
              ),
              seed=0,
              config={'method': f'random ({types})', 'k': k, 'types': types},
          )
      )
  return runs


# ------------------------------------------------------------------------------ report


def points(results) -> list[dict]:
  """One row per scored model: method, heads kept, BLEU (and the gated model's BLEU)."""
  rows = []
  for row in runner.final(results):
    if 'bleu' not in row:
      continue
    point = {
        'name': row['name'],
        'method': row.get('method'),
        'lambda': row.get('lambda'),
        'k': row.get('k'),
        'encoder_heads': row['encoder_heads'],
        'total_heads': row['total_heads'],
        'heads': row['heads'],
        'bleu': row['bleu'],
        'params': row['params'],
    }
    if 'unpruned' in row:
      point['bleu_gated'] = row['unpruned']['bleu']
    rows.append(point)
  return rows


ROLES_KEPT = 'roles-base.json'  # the baseline's roles.json, kept in the experiment folder


def keep_roles(runs_dir: pathlib.Path, out: pathlib.Path) -> None:
  """The role runs' heat maps, and the baseline's roles.json that `roles_table` reads, copied
  into the experiment folder, where they outlive the run directories."""
  for role_run in ('roles-base', 'roles-minilm'):
    for png in sorted((runs_dir / role_run).glob('roles_*.png')):
      shutil.copy(png, out / f'{role_run}_{png.name.removeprefix("roles_")}')
  if (runs_dir / 'roles-base' / 'roles.json').exists():
    shutil.copy(runs_dir / 'roles-base' / 'roles.json', out / ROLES_KEPT)


def roles_table(results, lambdas, out: pathlib.Path) -> str:
  """Encoder heads of the baseline: importance, confidence, roles, and which L0 runs keep them.

  Roles come from the copy of the `roles-base` run's roles.json in `out` (`ROLES_KEPT`, made
  by `keep_roles`, so it outlives the run directory); without it the table has no roles column
  and says so, rather than leaving the committed importances and L0 path unreported."""
  by_name = {r['name']: r for r in results['runs']}
  analysed = (by_name.get('analyse') or {}).get('result')
  if not analysed:
    return 'Not run yet.'
  roles_path = out / ROLES_KEPT
  shape = np.shape(analysed['importance_normalized']['encoder'])
  heads = [(layer, head) for layer in range(shape[0]) for head in range(shape[1])]
  roles = (
      {(e['layer'], e['head']): e['roles'] for e in json.loads(roles_path.read_text())}
      if roles_path.exists()
      else None
  )
  kept = {}
  for lam in lambdas:
    entry = by_name.get(f'l0-enc-{lam:g}-eval')
    if entry and entry.get('result'):
      kept[lam] = entry['result']['keep']['encoder']
  rows = []
  for layer, head in heads:
    alive = [lam for lam in kept if kept[lam][layer][head]]
    rows.append(
        {
            'head': f'{layer}.{head}',
            'importance': analysed['importance_normalized']['encoder'][layer][head],
            'confidence': analysed['confidence']['encoder'][layer][head],
            'roles': ', '.join(roles[layer, head]) or '-' if roles is not None else None,
            'survives up to lambda': max(alive) if alive else '-',
            **{f'λ={lam:g}': '✓' if kept[lam][layer][head] else '·' for lam in kept},
        }
    )
  rows.sort(
      key=lambda r: (
          -(r['survives up to lambda'] if r['survives up to lambda'] != '-' else -1),
          -r['importance'],
      )
  )
  columns = ['head', 'importance', 'confidence'] + ['roles'] * (roles is not None)
  columns += [c for c in rows[0] if c.startswith('λ=')]
  table = runner.markdown_table(rows, columns, floatfmt='.3f')
  if roles is None:
    table += (
        '\nRoles: the `roles-base` run directory is gone and the report kept no copy of its'
        f' roles.json (`{ROLES_KEPT}`), so this table has none.\n'
    )
  return table


def report(results, runs_dir: pathlib.Path, out: pathlib.Path, s: Settings) -> None:
  rows = points(results)
  baseline = [r for r in rows if r['method'] == 'baseline']
  curves = [r for r in rows if r['method'] != 'baseline']
  enc = [r for r in curves if r['method'].endswith('(enc)')] + baseline
  everything = [r for r in curves if r['method'].endswith('(all)')] + baseline
  runner.plot_lines(
      enc,
      x='encoder_heads',
      y='bleu',
      group='method',
      out=out / 'bleu_encoder.png',
      xlabel='encoder heads kept',
      ylabel='test BLEU',
      spread=None,
      title='Pruning encoder heads (Multi30k en-de)',
  )
  runner.plot_lines(
      everything,
      x='total_heads',
      y='bleu',
      group='method',
      out=out / 'bleu_all.png',
      xlabel='heads kept (encoder + decoder + cross)',
      ylabel='test BLEU',
      spread=None,
      title='Pruning all attention types',
  )
  heads = lambda r: '/'.join(str(sum(r['heads'][t])) for t in ('encoder', 'decoder', 'cross'))
  table = runner.markdown_table(
      sorted(curves, key=lambda r: (r['method'], -r['total_heads'])) + baseline,
      [
          ('method', 'method'),
          ('λ', lambda r: '' if r['lambda'] is None else f"{r['lambda']:g}"),
          ('K', 'k'),
          ('heads enc/dec/cross', heads),
          ('BLEU', 'bleu'),
          ('BLEU gated (before pruning)', 'bleu_gated'),
          ('parameters', 'params'),
      ],
      floatfmt='.2f',
  )
  keep_roles(runs_dir, out)
  text = '\n'.join(
      [
          runner.runs_summary(results),
          '',
          '### Pruning curves',
          '',
          table,
          '![BLEU vs encoder heads](bleu_encoder.png) ![BLEU vs all heads](bleu_all.png)',
          '',
          '### Encoder heads of the baseline and the L0 path',
          '',
          roles_table(results, s.lambdas['enc'], out),
          '',
          '### Role maps',
          '',
          'Baseline encoder: ![positional](roles-base_positional.png) '
          '![syntactic](roles-base_syntactic.png) ![rare](roles-base_rare.png) '
          '![confidence](roles-base_confidence.png)',
          '',
          'all-MiniLM-L6-v2: ![positional](roles-minilm_positional.png) '
          '![syntactic](roles-minilm_syntactic.png) ![rare](roles-minilm_rare.png) '
          '![confidence](roles-minilm_confidence.png)',
      ]
  )
  readme = out / 'README.md'
  if not readme.exists():  # the smoke test writes a fresh one
    readme.write_text('# heads (smoke test)\n\n<!-- results -->\n<!-- /results -->\n')
  runner.write_section(readme, 'results', text)


# --------------------------------------------------------- --protocol=voita: the grid

TYPE_ARGS = {'enc': 'encoder', 'all': 'all'}  # steps.py's --types
LABELS = {  # method -> its name in the tables and plots
    'baseline': 'baseline (no fine-tune)',
    'nogates': 'fine-tune, no gates',
    'l0': 'L0 gates + whole model',
    'random': 'random + fine-tune',
    'importance': 'importance + fine-tune',
    'l0heads': "L0's heads pruned first + fine-tune",
}


@dataclasses.dataclass(frozen=True)
class Base:
  """What the Voita grid takes from the converged baseline: its run directory, the config file
  holding its config (`base_config_file`), the overrides that read its vocabulary and prepared
  data, and its learning-rate schedule."""

  path: pathlib.Path
  config_file: str
  data: dict
  lr_schedule: str
  end_learning_rate_factor: float

  @classmethod
  def of(cls, base: pathlib.Path, runs_dir: pathlib.Path) -> 'Base':
    from lowrank_attn.runs import RunDir  # pylint: disable=g-import-not-at-top

    run = RunDir(base)
    config = run.config
    return cls(
        base,
        str(base_config_file(base, runs_dir)),
        run.data_overrides(),
        config.lr_schedule,
        float(config.end_learning_rate_factor),
    )


def finetune_overrides(b: Base, s: Settings) -> dict:
  """Budget and schedule of every fine-tune of the grid, the L0 runs and all their controls:
  the baseline's schedule restarted at `s.finetune_lr` for `s.finetune_steps` steps, a sixth
  of them as warmup (the baseline's 300 of 1,800; Adam's moments start again from zero)."""
  steps_ = s.finetune_steps
  return {
      'learning_rate': s.finetune_lr,
      'lr_schedule': b.lr_schedule,
      'end_learning_rate_factor': b.end_learning_rate_factor,
      'warmup_steps': max(steps_ // 6, 1),
      'num_train_steps': steps_,
      'eval_every_steps': s.eval_every,  # validation loss only: the fine-tune's curve
      'checkpoint_every_steps': max(steps_ // 3, 1),
      'decode.num_examples': 0,  # BLEU once, in the final evaluation (validation and test)
      **({'decode.beam_size': s.beam_size} if s.beam_size else {}),
  }


def _record(run: runner.Run, **record) -> runner.Run:
  """`run` with `record` (method, types, ...) in its results.json config; the command is
  unchanged."""
  return dataclasses.replace(run, config={**record, **run.config})


def voita_name(types: str, lam: float) -> str:
  return f'voita-{types}-{lam:g}'


def voita_first(b: Base, s: Settings) -> list[runner.Run]:
  """Stage 1, from the baseline: its head importance, the no-gates fine-tune and the L0 runs
  (whole model trainable, gates at their own rate)."""
  finetune = finetune_overrides(b, s)
  start = {'init_from': str(b.path), **b.data}
  runs = [
      analyse_run(b.path, s),
      _record(
          runner.train_run(
              'voita-finetune-nogates', b.config_file, overrides={**start, **finetune}
          ),
          method='nogates',
      ),
  ]
  for types, lambdas in s.voita_lambdas.items():
    for lam in lambdas:
      overrides = {
          **start,
          **GATED[types],
          'l0_penalty_weight': lam,
          'gate_learning_rate': s.voita_gate_lr,
          **finetune,
      }
      runs.append(
          _record(
              runner.train_run(voita_name(types, lam), b.config_file, overrides=overrides),
              method='l0',
              types=types,
              **{'lambda': lam},
          )
      )
  return runs


def voita_evals(runs_dir: pathlib.Path, s: Settings) -> list[runner.Run]:
  """Stage 2: each L0 run's gated model and its physically pruned copy scored (`steps
  evaluate --prune gates`); the result records the heads kept."""
  return [
      runner.Run(
          f'{voita_name(types, lam)}-eval',
          steps(
              'evaluate',
              '--run',
              runs_dir / voita_name(types, lam),
              '--out',
              '{rundir}',
              '--prune',
              'gates',
              *score_args(s),
          ),
          config={'method': 'l0-eval', 'types': types, 'lambda': lam},
      )
      for types, lambdas in s.voita_lambdas.items()
      for lam in lambdas
  ]


def surviving(results, s: Settings) -> dict[tuple[str, float], dict]:
  """{(types, lambda): {'k': heads its gates keep among the gated types, 'of': heads there}}
  of every finished eval run (encoder heads for 'enc', all heads for 'all')."""
  by_name = {entry['name']: entry for entry in results['runs']}
  out = {}
  for types, lambdas in s.voita_lambdas.items():
    for lam in lambdas:
      result = (by_name.get(f'{voita_name(types, lam)}-eval') or {}).get('result')
      if not result:
        continue
      gated = ['encoder'] if types == 'enc' else list(result['keep'])
      out[types, lam] = {
          'k': result['encoder_heads'] if types == 'enc' else result['total_heads'],
          'of': sum(len(layer) for t in gated for layer in result['keep'][t]),
      }
  return out


def control_counts(counts: dict[tuple[str, float], dict]) -> dict[str, list[int]]:
  """{types: the head counts K the controls prune to}: each lambda's survivors, once per K;
  a K of every head is left out (nothing to prune: the no-gates fine-tune is that control)."""
  out = {}
  for (types, _), c in counts.items():
    if c['k'] < c['of']:
      out.setdefault(types, set()).add(c['k'])
  return {types: sorted(ks, reverse=True) for types, ks in out.items()}


def prune_name(method: str, types: str, k: int, seed: int | None = None) -> str:
  return f'prune-{method}-{types}-k{k}' + ('' if seed is None else f'-s{seed}')


def finetune_name(method: str, types: str, k: int, seed: int | None = None) -> str:
  return f'{method}-{types}-k{k}' + ('' if seed is None else f'-s{seed}') + '-ft'


def control_runs(
    b: Base, runs_dir: pathlib.Path, s: Settings, ks: dict[str, list[int]]
) -> tuple[list[runner.Run], list[runner.Run]]:
  """Stages 3 and 4: the baseline pruned to each K (random heads, one copy per seed, and the K
  most important by the analyse run: Michel et al.'s global order; at K = 0, where both prune
  every head, one random copy), then each pruned copy
  fine-tuned with exactly the L0 runs' budget and schedule. The pruned heads are gone from the
  copy (`lowrank_attn.pruning.prune_run`, as `michel-...-retrain`), so they stay pruned."""
  finetune = finetune_overrides(b, s)
  prunes, finetunes = [], []
  for types, kset in ks.items():
    for k in kset:
      # At K = 0 every head of the pruned types goes, in any order: random (each seed) and
      # importance pruning give the same copy, so one control stands for both.
      methods = (
          (('random', s.random_seeds[:1]),)
          if k == 0
          else (('random', s.random_seeds), ('importance', (None,)))
      )
      for method, seeds in methods:
        for seed in seeds:
          how = ['--seed', seed] if method == 'random' else ['--importance', runs_dir / 'analyse']
          prune, run = _prune_then_finetune(
              b,
              runs_dir,
              finetune,
              names=(prune_name(method, types, k, seed), finetune_name(method, types, k, seed)),
              how=[method, '--keep', k, '--types', TYPE_ARGS[types], *how],
              method=method,
              record={'types': types, 'k': k, 'random_seed': seed},
          )
          prunes.append(prune)
          finetunes.append(run)
  return prunes, finetunes


def _prune_then_finetune(b, runs_dir, finetune, names, how, method, record):
  """A control's two runs: `steps evaluate --prune <how...> --prune_only` writes the pruned
  copy of the baseline; the fine-tune trains it with the L0 runs' budget (`finetune`)."""
  name, finetuned = names
  seed = record.get('random_seed')
  prune = runner.Run(
      name,
      steps('evaluate', '--run', b.path, '--out', '{rundir}', '--prune', *how, '--prune_only'),
      seed=seed,
      config={'method': 'prune', 'pruning': method, **record},
  )
  pruned = runs_dir / name / 'pruned'
  run = runner.train_run(
      finetuned,
      # the pruned copy's own config: its per-layer head counts are no override
      f'experiments/heads/glue_pruning.py:{pruned}',
      overrides={'init_from': str(pruned), **b.data, **finetune},
  )
  return prune, _record(run, method=method, pruned_by=name, **record)


def l0_heads_runs(
    b: Base, runs_dir: pathlib.Path, s: Settings, counts: dict[tuple[str, float], dict]
) -> tuple[list[runner.Run], list[runner.Run]]:
  """Stages 3 and 4 for one more control: for each L0 run that closed some heads of its types
  but not all (`surviving`), the baseline pruned to exactly the heads it kept (`steps evaluate
  --prune mask` from its eval run), then fine-tuned like the other controls, without gates."""
  finetune = finetune_overrides(b, s)
  prunes, finetunes = [], []
  for (types, lam), c in counts.items():
    if not 0 < c['k'] < c['of']:  # all kept: the no-gates fine-tune; none: the K = 0 control
      continue
    name = f'prune-l0heads-{voita_name(types, lam).removeprefix("voita-")}'
    prune, run = _prune_then_finetune(
        b,
        runs_dir,
        finetune,
        names=(name, name.removeprefix('prune-') + '-ft'),
        how=['mask', '--mask_from', runs_dir / f'{voita_name(types, lam)}-eval'],
        method='l0heads',
        record={'types': types, 'lambda': lam, 'k': c['k'], 'random_seed': None},
    )
    prunes.append(prune)
    finetunes.append(run)
  return prunes, finetunes


def finished(results, runs) -> bool:
  done = {entry['name'] for entry in results['runs']}
  return all(run.name in done for run in runs)


def voita_grid(b: Base, runs_dir: pathlib.Path, out: pathlib.Path, s: Settings, args) -> dict:
  """The four stages, each started once the one before has finished (a rerun resumes)."""
  grid_ = lambda runs: runner.run_grid(
      runs,
      out,
      runs_dir=runs_dir,
      exit_on_failure=False,
      **runner.grid_options(args),
  )

  def controls(results):
    counts = surviving(results, s)
    prunes, finetunes = control_runs(b, runs_dir, s, control_counts(counts))
    l0_prunes, l0_finetunes = l0_heads_runs(b, runs_dir, s, counts)
    return prunes + l0_prunes, finetunes + l0_finetunes

  runs = voita_first(b, s)
  results = grid_(runs)
  for stage in (
      lambda: voita_evals(runs_dir, s),
      lambda: controls(results)[0],
      lambda: controls(results)[1],
  ):
    if not finished(results, runs):
      print('voita: the next stage needs every run above; rerun when they are done')
      break
    runs = runs + stage()
    results = grid_(runs)
  return results


# -------------------------------------------------------- --protocol=voita: the report


def voita_rows(results) -> list[dict]:
  """One row per finished fine-tune: method, types, lambda, K, its heads and its BLEU on
  validation and test (its own final evaluation); L0 rows add the pruned copy's test BLEU."""
  by_name = {entry['name']: entry for entry in results['runs']}
  result_of = lambda name: (by_name.get(name) or {}).get('result') or {}
  full = result_of('analyse')  # the baseline's heads
  rows = []
  for test, validation in zip(runner.final(results, 'test'), runner.final(results, 'validation')):
    method = test.get('method')
    if method not in LABELS or runner.bleu_of(test) is None:
      continue
    if method == 'nogates':
      sizes = full
    elif method == 'l0':
      sizes = result_of(f'{test["name"]}-eval')
    else:  # random, importance: the prune run that wrote the copy
      sizes = result_of(test.get('pruned_by'))
    row = {
        'name': test['name'],
        'method': method,
        'types': test.get('types'),
        'lambda': test.get('lambda'),
        'k': test.get('k'),
        'random_seed': test.get('random_seed'),
        'bleu_validation': runner.bleu_of(validation),
        'bleu_test': runner.bleu_of(test),
        **{key: sizes.get(key) for key in ('heads', 'encoder_heads', 'total_heads')},
    }
    if method == 'l0' and sizes:
      row['k'] = sizes['encoder_heads'] if row['types'] == 'enc' else sizes['total_heads']
      row['bleu_test_pruned'] = sizes.get('bleu')
      row['bleu_test_gated'] = (sizes.get('unpruned') or {}).get('bleu')
    rows.append(row)
  return rows


def keep_baseline(base, out: pathlib.Path, full: dict, s: Settings) -> dict | None:
  """The baseline's own final evaluation as a row (its translations copied beside the grid's,
  its record to out/baseline.json: its run directory may not survive; base None: that
  record); None without one, or when --beam_size scores the grid with another beam."""
  from experiments.collaborative.from_scratch import keep_translations  # pylint: disable=g-import-not-at-top

  path = out / 'baseline.json'
  found = sorted(
      pathlib.Path(base).glob('final_eval/*/metrics.json') if base else (),
      key=lambda p: int(p.parent.name),
  )
  if found:
    metrics = json.loads(found[-1].read_text())
    runner.files.write_json(
        path,
        {
            'name': base.name,
            'method': 'baseline',
            'run': str(base),
            'step': int(found[-1].parent.name),
            'beam_size': int(metrics['test'].get('beam_size', 0)),
            'bleu_validation': runner.bleu_of(metrics['validation']),
            'bleu_test': runner.bleu_of(metrics['test']),
        },
    )
    keep_translations(
        {'runs_dir': str(base.parent), 'runs': [{'name': base.name}]}, out / 'translations'
    )
  row = runner.files.read_json(path)
  if row is None or (s.beam_size and row['beam_size'] != s.beam_size):
    return None
  return {**row, **{key: full.get(key) for key in ('heads', 'encoder_heads', 'total_heads')}}


def group_key(row: dict) -> tuple:
  """Rows of one system: random pruning's seeds together, every other run alone."""
  return (row['method'], row.get('types'), row.get('lambda'), row.get('k'))


def comparison_pairs(rows: list[dict]) -> list[dict]:
  """The differences the report states, each B - A with the runs of A and of B (seeds of a
  random K are one system): every method against the no-gates fine-tune at the same budget
  (and that fine-tune against the baseline), and each L0 run against random pruning (its
  seeds averaged) and importance pruning at the L0 run's own head count, both fine-tuned, and
  against its own heads pruned from the baseline first, fine-tuned without gates (l0heads)."""
  groups = {}
  for row in rows:
    groups.setdefault(group_key(row), []).append(row)
  names = lambda members: sorted(r['name'] for r in members)
  nogates = [r for r in rows if r['method'] == 'nogates']
  baseline = [r for r in rows if r['method'] == 'baseline']
  pairs = []
  for (method, types, lam, k), members in groups.items():
    what = {'method': method, 'types': types, 'lambda': lam, 'k': k}
    if method == 'nogates' and baseline:
      pairs.append({'kind': 'minus_baseline', **what, 'a': names(baseline), 'b': names(members)})
    elif method not in ('baseline', 'nogates') and nogates:
      pairs.append({'kind': 'minus_nogates', **what, 'a': names(nogates), 'b': names(members)})
    if method != 'l0' or k is None:
      continue
    own = groups.get(('l0heads', types, lam, k))
    if own:
      pairs.append({'kind': 'l0_minus_l0heads', **what, 'a': names(own), 'b': names(members)})
    for other in ('random', 'importance'):
      control = groups.get((other, types, None, k))
      if k == 0:  # one control for both at K = 0 (`control_runs`)
        control = groups.get(('random', types, None, k))
      if control:
        pairs.append(
            {'kind': f'l0_minus_{other}', **what, 'a': names(control), 'b': names(members)}
        )
  return pairs


def bleu_intervals(pairs, rows, translations: pathlib.Path) -> list[dict]:
  """Each pair's B - A in BLEU on validation and test, with its 95% paired bootstrap interval
  over sentences (`experiments.stats.bleu_difference`, seeds averaged on each resample), from
  the kept translations; pairs with a run whose translations were not kept are left out."""
  from experiments import stats  # pylint: disable=g-import-not-at-top
  from experiments.collaborative.from_scratch import REFERENCES, checked_translations, read_lines  # pylint: disable=g-import-not-at-top
  from experiments.heads.roles import raw_file  # pylint: disable=g-import-not-at-top

  by_name = {r['name']: r for r in rows}
  pairs = [p for p in pairs if all((translations / n).is_dir() for n in p['a'] + p['b'])]
  if not pairs:
    return []
  references = {split: read_lines(raw_file(path)) for split, path in REFERENCES.items()}
  cache = {}

  def system(names, split):
    for name in names:
      if (name, split) not in cache:
        cache[name, split] = checked_translations(
            by_name[name], split, references[split], translations
        )
    return [cache[name, split] for name in names]

  out = []
  for pair in pairs:
    entry = dict(pair)
    for split in ('validation', 'test'):
      entry[split] = stats.bleu_difference(
          references[split], system(pair['a'], split), system(pair['b'], split)
      ).as_dict()
    out.append(entry)
  return out


def voita_table(rows: list[dict], intervals: list[dict]) -> list[dict]:
  """One line per system (random's seeds together): its mean BLEU (min, max), mean heads per
  type, and its difference to the no-gates fine-tune."""
  groups = {}
  for row in rows:
    groups.setdefault(group_key(row), []).append(row)
  against = {
      (i['method'], i['types'], i['lambda'], i['k']): i
      for i in intervals
      if i['kind'] in ('minus_nogates', 'minus_baseline')
  }
  order = lambda key: (
      list(LABELS).index(key[0]),
      ('enc', 'all').index(key[1]) if key[1] else -1,
      key[2] if key[2] is not None else 0,
      -(key[3] if key[3] is not None else 10**6),
  )
  lines = []
  for key in sorted(groups, key=order):
    members = groups[key]
    line = {
        'method': key[0],
        'types': key[1],
        'lambda': key[2],
        'k': key[3],
        'runs': len(members),
        'names': [r['name'] for r in members],
    }
    for split in ('validation', 'test'):
      scores = [r[f'bleu_{split}'] for r in members]
      line[f'bleu_{split}'] = float(np.mean(scores))
      line[f'bleu_{split}_min'], line[f'bleu_{split}_max'] = min(scores), max(scores)
    if all(r.get('heads') for r in members):
      line['heads'] = {
          t: float(np.mean([sum(r['heads'][t]) for r in members])) for t in members[0]['heads']
      }
      for key_ in ('encoder_heads', 'total_heads'):
        line[key_] = float(np.mean([r[key_] for r in members]))
    if key in against:
      line['minus'] = {
          'of': 'baseline' if against[key]['kind'] == 'minus_baseline' else 'nogates',
          'validation': against[key]['validation'],
          'test': against[key]['test'],
      }
    lines.append(line)
  return lines


def voita_report(results, b_path, out: pathlib.Path, s: Settings, images: str) -> None:
  """Tables, plots and intervals of the Voita grid: out/table.json, out/*.png and the
  `voita` section of out/../README.md (the smoke: out/README.md); `images`: the plots' path
  from that README."""
  from experiments import stats  # pylint: disable=g-import-not-at-top
  from experiments.collaborative.from_scratch import keep_translations  # pylint: disable=g-import-not-at-top

  translations = out / 'translations'
  keep_translations(results, translations)
  rows = voita_rows(results)
  full = next((e.get('result') or {} for e in results['runs'] if e['name'] == 'analyse'), {})
  baseline = keep_baseline(b_path, out, full, s)
  rows += [baseline] if baseline else []
  intervals = bleu_intervals(comparison_pairs(rows), rows, translations)
  lines = voita_table(rows, intervals)
  runner.files.write_json(
      out / 'table.json', {'rows': rows, 'systems': lines, 'intervals': intervals}
  )

  interval = lambda d: str(stats.Interval(**d)) if d else ''
  spread = lambda split: lambda e: (
      f"{e[f'bleu_{split}']:.2f}"
      if e['runs'] == 1
      else f"{e[f'bleu_{split}']:.2f} ({e[f'bleu_{split}_min']:.2f}–{e[f'bleu_{split}_max']:.2f})"
  )
  heads = lambda e: (
      '/'.join(format(round(e['heads'][t], 1), 'g') for t in ('encoder', 'decoder', 'cross'))
      if e.get('heads')
      else ''
  )
  point = lambda e: (
      f"λ={e['lambda']:g}"
      if e['lambda'] is not None
      else f"K={e['k']}"
      if e['k'] is not None
      else ''
  )
  table = runner.markdown_table(
      lines,
      [
          ('method', lambda e: LABELS[e['method']]),
          ('gates / pruned', lambda e: e['types'] or ''),
          ('λ or K', point),
          ('runs', 'runs'),
          ('heads enc/dec/cross', heads),
          ('BLEU val', spread('validation')),
          ('BLEU test', spread('test')),
          ('val − no-gates ft [95%]', lambda e: interval((e.get('minus') or {}).get('validation'))),
          ('test − no-gates ft [95%]', lambda e: interval((e.get('minus') or {}).get('test'))),
      ],
  )
  l0_lines = [
      {**e, 'pruned': r.get('bleu_test_pruned'), 'gated': r.get('bleu_test_gated')}
      for e in lines
      if e['method'] == 'l0'
      for r in rows
      if r['name'] == e['names'][0]
  ]
  versus = {
      (i['types'], i['lambda'], i['kind']): i for i in intervals if i['kind'].startswith('l0_')
  }
  matched = lambda kind, split: lambda e: interval(
      (versus.get((e['types'], e['lambda'], kind)) or {}).get(split)
  )
  gated_pruned = lambda e: (
      f"{e['gated']:.2f} / {e['pruned']:.2f}" if e['gated'] is not None and e['pruned'] else ''
  )
  table_l0 = runner.markdown_table(
      l0_lines,
      [
          ('gates', 'types'),
          ('λ', lambda e: f"{e['lambda']:g}"),
          ('heads kept K', 'k'),
          ('L0 − random, val [95%]', matched('l0_minus_random', 'validation')),
          ('L0 − random, test [95%]', matched('l0_minus_random', 'test')),
          ('L0 − importance, val [95%]', matched('l0_minus_importance', 'validation')),
          ('L0 − importance, test [95%]', matched('l0_minus_importance', 'test')),
          ('L0 − its heads pruned first, val [95%]', matched('l0_minus_l0heads', 'validation')),
          ('L0 − its heads pruned first, test [95%]', matched('l0_minus_l0heads', 'test')),
          ('test BLEU gated / pruned copy', gated_pruned),
      ],
      floatfmt='.2f',
  )
  if rows:
    full_rows = [r for r in rows if r['method'] in ('baseline', 'nogates')]
    for types, x, label, png in (
        ('enc', 'encoder_heads', 'encoder heads kept', 'bleu_encoder.png'),
        ('all', 'total_heads', 'heads kept (encoder + decoder + cross)', 'bleu_all.png'),
    ):
      runner.plot_lines(
          [{**r, 'method': LABELS[r['method']]} for r in rows if r.get('types') == types]
          + [{**r, 'method': LABELS[r['method']]} for r in full_rows],
          x=x,
          y='bleu_test',
          group='method',
          out=out / png,
          xlabel=label,
          ylabel='test BLEU (test_2016_flickr)',
          spread='minmax',
          title=f"Voita et al.'s protocol, gates on {TYPE_ARGS[types]} ({s.finetune_steps} steps)",
      )
    curves = [
        {**line, 'run': line['name']}
        for line in runner.history(results, 'eval')
        if line.get('method') in ('nogates', 'l0') and 'loss' in line
    ]
    runner.plot_lines(
        curves,
        x='step',
        y='loss',
        group='run',
        out=out / 'finetune_loss.png',
        spread=None,
        xlabel='fine-tune step',
        ylabel='validation cross entropy',
        title='Fine-tunes from the baseline: L0 runs and the no-gates control',
    )
  text = '\n'.join(
      [
          runner.runs_summary(results),
          '',
          "BLEU of each run's own final evaluation (sacreBLEU, validation and "
          'test_2016_flickr); random: mean (min–max) over its pruning seeds; intervals: '
          'B − A with its 95% paired bootstrap interval over sentences, seeds averaged on '
          'each resample, recomputed from the kept translations (`voita/translations/`). '
          "The baseline row is the baseline's own final evaluation (before any fine-tune), "
          'its interval the no-gates fine-tune minus it.',
          '',
          table if lines else 'No finished fine-tune yet.\n',
          'L0 against the controls pruned to its own head count K, both fine-tuned the same '
          'way (a λ that closes no gate has no control: the no-gates fine-tune is it; at K = 0 '
          'random and importance pruning remove the same heads, all of them, and one '
          'fine-tuned copy is the control of both columns; "its heads pruned first": the '
          'baseline pruned to the heads the L0 run kept, then fine-tuned without gates, which '
          "separates L0's choice of heads from what its gates do during the fine-tune):",
          '',
          table_l0 if l0_lines else '(none yet)\n',
          f'![BLEU vs encoder heads]({images}bleu_encoder.png) '
          f'![BLEU vs all heads]({images}bleu_all.png)',
          '',
          f'![validation loss of the fine-tunes]({images}finetune_loss.png)',
      ]
  )
  readme = out.parent / 'README.md' if images else out / 'README.md'
  if not readme.exists():  # the smoke test writes a fresh one
    readme.write_text('# heads, --protocol=voita (smoke test)\n\n<!-- voita -->\n<!-- /voita -->\n')
  runner.write_section(readme, 'voita', text)
  print(text)


def checked_base(base: pathlib.Path) -> pathlib.Path:
  from lowrank_attn.runs import RunDir  # pylint: disable=g-import-not-at-top

  if not RunDir(base).is_run():
    raise SystemExit(
        f'--base={base} is not a trained run (no config.json); train it with '
        'python -m lowrank_attn.main --config=configs/nmt.py:multi30k '
        f'--workdir={base}'
    )
  return base


def voita_main(args, s: Settings, runs_dir: pathlib.Path) -> None:
  out = runs_dir / 'voita-smoke-results' if args.smoke else VOITA_OUT
  images = '' if args.smoke else 'voita/'
  if args.plot_only:
    results = runner.load_results(out)
    # The baseline's row needs only its final evaluation: read it when the run is there (else
    # the report falls back on the record a grid's report left in baseline.json).
    given = pathlib.Path(args.base)
    base = given.resolve() if not args.smoke and (given / 'config.json').exists() else None
  else:
    base = smoke_base(runs_dir, args) if args.smoke else pathlib.Path(args.base).resolve()
    base = checked_base(base)
    results = voita_grid(Base.of(base, runs_dir), runs_dir, out, s, args)
  voita_report(results, base, out, s, images)
  if results.get('failed'):
    raise SystemExit(f"failed runs: {results['failed']} (rerun to retry)")


def main():
  parser = runner.arg_parser(__doc__, 'heads')
  parser.add_argument(
      '--base',
      default='/work/runs/multi30k/base',
      help='the trained baseline run directory (configs/nmt.py:multi30k)',
  )
  parser.add_argument(
      '--beam_size',
      type=int,
      default=None,
      help="beam of every test translation; default: the baseline's (4). "
      '1 (greedy) is ~4x faster',
  )
  parser.add_argument(
      '--smoke',
      action='store_true',
      help='tiny end-to-end check: a 20-step tiny base, a few steps and '
      'sentences per run; results go to RUNS_DIR/smoke-results '
      '(--protocol=voita: RUNS_DIR/voita-smoke-results)',
  )
  parser.add_argument(
      '--protocol',
      choices=('gates', 'voita'),
      default='gates',
      help='gates: gates trained alone, importance and random pruning (the first grid); '
      "voita: Voita et al.'s whole-model fine-tune with gates and its controls at the same "
      'budget (results in experiments/heads/voita/)',
  )
  args = parser.parse_args()
  s = Settings(args.smoke, args.beam_size)
  runs_dir = pathlib.Path(args.runs_dir).resolve()
  runs_dir.mkdir(parents=True, exist_ok=True)
  if args.protocol == 'voita':
    return voita_main(args, s, runs_dir)
  out = runs_dir / 'smoke-results' if args.smoke else HERE
  if args.plot_only:
    results = runner.load_results(out)
  else:
    base = smoke_base(runs_dir, args) if args.smoke else pathlib.Path(args.base).resolve()
    results = runner.run_grid(
        grid(checked_base(base), runs_dir, s),
        out,
        runs_dir=runs_dir,
        **runner.grid_options(args),
        exit_on_failure=False,
    )
  report(results, runs_dir, out, s)
  if results.get('failed'):
    raise SystemExit(f"failed runs: {results['failed']} (rerun to retry)")


if __name__ == '__main__':
  main()
