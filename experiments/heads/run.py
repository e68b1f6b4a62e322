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
"""

import json
import pathlib
import shutil
import sys

from experiments import runner

HERE = pathlib.Path(__file__).parent
PYTHON = sys.executable


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


def grid(base: pathlib.Path, runs_dir: pathlib.Path, s: Settings) -> list[runner.Run]:
  from lowrank_attn.runs import RunDir  # pylint: disable=g-import-not-at-top

  config_file = str(base_config_file(base, runs_dir))
  data = RunDir(base).data_overrides()
  sentences = ['--num_sentences', s.num_sentences]  # and the beam: how every point is scored
  if s.beam_size:
    sentences += ['--beam_size', s.beam_size]
  beam = {'decode.beam_size': s.beam_size} if s.beam_size else {}
  runs = [
      runner.Run(
          'base-eval',
          steps('evaluate', '--run', base, '--out', '{rundir}', *sentences),
          config={'method': 'baseline'},
      ),
      runner.Run(
          'analyse',
          steps('analyse', '--run', base, '--out', '{rundir}', '--max_batches', s.max_batches),
          config={'method': 'analyse'},
      ),
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

  gated = {
      'enc': {
          'model.encoder_attention.gated': True,
          'model.encoder_attention.gate_log_alpha_init': 'glorot',
      },
      'all': {'model.attention.gated': True, 'model.attention.gate_log_alpha_init': 'glorot'},
  }
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
                  **gated[types],
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


def roles_table(results, runs_dir: pathlib.Path, lambdas) -> str:
  """Encoder heads of the baseline: importance, confidence, roles, and which L0 runs keep them."""
  by_name = {r['name']: r for r in results['runs']}
  analysed = (by_name.get('analyse') or {}).get('result')
  roles_path = runs_dir / 'roles-base' / 'roles.json'
  if not analysed or not roles_path.exists():
    return 'Not run yet.'
  roles = {(e['layer'], e['head']): e for e in json.loads(roles_path.read_text())}
  kept = {}
  for lam in lambdas:
    entry = by_name.get(f'l0-enc-{lam:g}-eval')
    if entry and entry.get('result'):
      kept[lam] = entry['result']['keep']['encoder']
  rows = []
  for (layer, head), e in sorted(roles.items()):
    alive = [lam for lam in kept if kept[lam][layer][head]]
    rows.append(
        {
            'head': f'{layer}.{head}',
            'importance': analysed['importance_normalized']['encoder'][layer][head],
            'confidence': analysed['confidence']['encoder'][layer][head],
            'roles': ', '.join(e['roles']) or '-',
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
  columns = ['head', 'importance', 'confidence', 'roles'] + [
      c for c in rows[0] if c.startswith('λ=')
  ]
  return runner.markdown_table(rows, columns, floatfmt='.3f')


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
  for role_run in ('roles-base', 'roles-minilm'):  # heat maps into the experiment folder
    for png in sorted((runs_dir / role_run).glob('roles_*.png')):
      shutil.copy(png, out / f'{role_run}_{png.name.removeprefix("roles_")}')
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
          roles_table(results, runs_dir, s.lambdas['enc']),
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
      'sentences per run; results go to RUNS_DIR/smoke-results',
  )
  args = parser.parse_args()
  s = Settings(args.smoke, args.beam_size)
  runs_dir = pathlib.Path(args.runs_dir).resolve()
  runs_dir.mkdir(parents=True, exist_ok=True)
  out = runs_dir / 'smoke-results' if args.smoke else HERE
  if args.plot_only:
    results = runner.load_results(out)
  else:
    base = smoke_base(runs_dir, args) if args.smoke else pathlib.Path(args.base).resolve()
    from lowrank_attn.runs import RunDir  # pylint: disable=g-import-not-at-top

    if not RunDir(base).is_run():
      raise SystemExit(
          f'--base={base} is not a trained run (no config.json); train it with '
          'python -m lowrank_attn.main --config=configs/nmt.py:multi30k '
          f'--workdir={base}'
      )
    results = runner.run_grid(
        grid(base, runs_dir, s),
        out,
        runs_dir=runs_dir,
        parallel=args.parallel,
        refresh=args.refresh,
        exit_on_failure=False,
    )
  report(results, runs_dir, out, s)
  if results.get('failed'):
    raise SystemExit(f"failed runs: {results['failed']} (rerun to retry)")


if __name__ == '__main__':
  main()
