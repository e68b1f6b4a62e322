r"""Experiment A on translation: re-parametrize the trained Multi30k baseline's self-attention.

    python -m experiments.collaborative.reparametrize_nmt --source=/work/runs/multi30k/base \
        --runs_dir=/work/runs/collaborative_nmt [--key_dims=128,64,32] [--types=encoder,decoder]
        [--finetune_steps=300] [--smoke]

The source run (trained with `configs/nmt.py:multi30k`, `--config`) is loaded, and its
attention of `--types` converted at each key width D~k by `collaborative` (CP, logit scale
kept), `collaborative_rescaled` (the paper's code's scale 1/sqrt(D~k / heads)) and
`per_head_svd` (each head truncated to rank D~k / heads). Each converted model is written as a
run directory (`lowrank_attn.reparam.write_run`) and then goes through the normal training CLI
twice, as runs of `experiments/runner/`: evaluated as it is (one step at learning rate 0,
which leaves every parameter unchanged, so the run's final evaluation scores the converted
model), and fine-tuned for `--finetune_steps` (cosine schedule, peak `--learning_rate`; the
per-head SVD's mixing frozen so it stays concat heads). The source itself is evaluated the same
way and, as the control for what the extra steps do on their own, fine-tuned the same way.
BLEU (beam of the source config, sacreBLEU) on test_2016_flickr and validation from each run's
final evaluation; table in the README. Resumable: rerun the same command.

Seeds and intervals (issue 24): `--seeds=0,1,2` fine-tunes every model (the control too) once
per seed (the training seed: data order and dropout; the conversion is seedless); the run of
the source's own seed keeps the plain name `<model>-ft`, the others are `<model>-ft-s<seed>`.
Each conversion's relative errors (per attention layer, by model name) are kept in
`<name>/conversions.json`, so that `--plot_only` redraws the table from committed files alone
(no source run, no conversion). Each finished run's translations are kept in
`<name>/translations/`, and every model's BLEU minus the original's, before fine-tuning and
after (against the control, on the seeds both have, seeds averaged on each resample), gets a
95% paired bootstrap interval over sentences (`experiments.stats.bleu_difference`), written to
`<name>/intervals.json` and the README.
`--name` picks the output folder and README section (default `nmt`); `--methods` a subset.

    python -m experiments.collaborative.reparametrize_nmt --name=nmt_seeds --key_dims=64,32 \
        --methods=collaborative --seeds=0,1,2 --runs_dir=/work/runs/collaborative_nmt_seeds
"""

import json
import pathlib

from experiments import runner
from experiments import stats
from experiments.collaborative import from_scratch  # the translation keeping and checking
from lowrank_attn.reparam import to_collaborative, to_low_rank_concat, write_run
from lowrank_attn.runs import RunDir, with_overrides

HERE = pathlib.Path(__file__).resolve().parent
METHODS = ('collaborative', 'collaborative_rescaled', 'per_head_svd')
# One step that changes nothing: the run's final evaluation then scores the model it starts from.
EVALUATE_ONLY = {
    'num_train_steps': 1,
    'learning_rate': 0.0,
    'warmup_steps': 0,
    'checkpoint_every_steps': 1,
    'eval_every_steps': 0,
    'decode.num_examples': 0,
}


def arguments():
  parser = runner.arg_parser(__doc__, 'collaborative_nmt')
  parser.add_argument('--source', default='/work/runs/multi30k/base', help='a trained nmt run')
  parser.add_argument(
      '--config',
      default='configs/nmt.py:multi30k',
      help='the config file the source run was trained with',
  )
  parser.add_argument('--key_dims', default='128,64,32')
  parser.add_argument('--types', default='encoder,decoder', help='attention types to convert')
  parser.add_argument('--finetune_steps', type=int, default=300)
  parser.add_argument('--learning_rate', type=float, default=5e-4)
  parser.add_argument('--methods', default=','.join(METHODS), help='conversions to run')
  parser.add_argument('--seeds', help="fine-tune seeds (default: the source run's seed)")
  parser.add_argument('--name', default='nmt', help='output folder and README section')
  parser.add_argument(
      '--smoke',
      action='store_true',
      help='collaborative at D~k=128 only, a 2-step fine-tune, greedy decoding '
      'of at most 8 tokens; results under --runs_dir',
  )
  args = parser.parse_args()
  args.key_dims = [int(k) for k in args.key_dims.split(',')]
  args.types = args.types.split(',')
  args.methods = tuple(args.methods.split(','))
  unknown = sorted(set(args.methods) - set(METHODS))
  if unknown:
    parser.error(f'--methods: unknown {unknown}; valid: {list(METHODS)}')
  args.seeds = None if args.seeds is None else [int(seed) for seed in args.seeds.split(',')]
  args.out, args.decode = HERE / args.name, {}
  if args.smoke:
    args.key_dims, args.methods, args.finetune_steps = [128], ('collaborative',), 2
    args.out = pathlib.Path(args.runs_dir) / 'smoke_results'
    args.decode = {'decode.beam_size': 1, 'decode.max_length': 8}
  return args


def finetune_name(name: str, seed: int, source_seed: int) -> str:
  """A fine-tune's run name: `<name>-ft` at the source run's seed (the name runs had before
  seeds), `<name>-ft-s<seed>` at any other."""
  return f'{name}-ft' if seed == source_seed else f'{name}-ft-s{seed}'


def convert(model, method: str, key_dim: int, types):
  if method == 'per_head_svd':
    return to_low_rank_concat(model, key_dim, types)
  return to_collaborative(model, key_dim, types, rescale_logits=method == 'collaborative_rescaled')


CONVERSIONS = 'conversions.json'


def main():
  args = arguments()
  if args.plot_only:  # from the committed files: no source run, no conversion
    results = runner.load_results(args.out)
    # A grid stopped before its end has run directories to keep translations from.
    from_scratch.keep_translations(results, args.out / 'translations')
    return report(results, runner.files.read_json(args.out / CONVERSIONS) or {}, args)
  source = RunDir(args.source)
  source_config, source_model = source.config, source.model()
  data = source.data_overrides()
  converted_dir = pathlib.Path(args.runs_dir).resolve() / 'converted'
  common = {**data, **args.decode}

  def run(name, fields, seed=source_config.seed, **config):
    train = runner.train_run(name, args.config, seed=seed, overrides={**common, **fields})
    return runner.Run(name, train.command, config={**config, **train.config}, seed=train.seed)

  seeds = args.seeds or [source_config.seed]

  def finetunes(name, fields, **config):
    return [
        run(
            finetune_name(name, seed, source_config.seed),
            fields,
            seed=seed,
            finetuned=True,
            **config,
        )
        for seed in seeds
    ]

  tune = {
      'num_train_steps': args.finetune_steps,
      'learning_rate': args.learning_rate,
      'warmup_steps': max(args.finetune_steps // 10, 1),
      'lr_schedule': 'cosine',
      'checkpoint_every_steps': max(args.finetune_steps // 3, 1),
      'eval_every_steps': 0,
      'decode.num_examples': 0,
  }
  width = source_model.cfg.emb_dim
  # The original fine-tuned the same way is the control: what the extra steps do on their own.
  runs = [
      run(
          'original',
          {**EVALUATE_ONLY, 'init_from': source.path},
          method='original',
          key_dim=width,
          finetuned=False,
      ),
      *finetunes('original', {**tune, 'init_from': source.path}, method='original', key_dim=width),
  ]
  errors = {}
  for key_dim in args.key_dims:
    for method in args.methods:
      name = f'{method}-k{key_dim}'
      directory = converted_dir / name
      if not (directory / 'conversion.json').exists():
        print(f'converting: {name}', flush=True)
        write_run(
            convert(source_model, method, key_dim, args.types),
            directory,
            with_overrides(source_config, data),
        )
      conversion = json.loads((directory / 'conversion.json').read_text())
      errors[name] = conversion['relative_errors']
      fields = {**conversion['overrides'], 'init_from': str(directory)}
      runs.append(
          run(name, {**EVALUATE_ONLY, **fields}, method=method, key_dim=key_dim, finetuned=False)
      )
      frozen = {'trainable': '^(?!.*mixing)'} if method == 'per_head_svd' else {}
      runs += finetunes(name, {**fields, **tune, **frozen}, method=method, key_dim=key_dim)
  # Kept beside results.json, so that --plot_only needs neither the source nor the conversions.
  kept = runner.files.read_json(args.out / CONVERSIONS) or {}
  args.out.mkdir(parents=True, exist_ok=True)
  runner.files.write_json(args.out / CONVERSIONS, {**kept, **errors})
  results = runner.run_grid(runs, args.out, runs_dir=args.runs_dir, **runner.grid_options(args))
  from_scratch.keep_translations(results, args.out / 'translations')
  report(results, errors, args)


def collect_rows(results, errors) -> dict[tuple[str, int], dict]:
  """(method, D~k) -> {'before': the converted model's run, 'after': its fine-tunes (one per
  seed)}; each run with `bleu_test`, `bleu_validation` and the validation loss."""
  rows = {}
  for test, validation in zip(runner.final(results, 'test'), runner.final(results, 'validation')):
    r = {
        **test,
        'bleu_test': runner.bleu_of(test),
        'bleu_validation': runner.bleu_of(validation),
        'loss': validation.get('loss'),
    }
    key = (r['method'], r['key_dim'])
    row = rows.setdefault(key, {'method': key[0], 'key_dim': key[1], 'after': []})
    if r['finetuned']:
      row['after'] = sorted(row['after'] + [r], key=lambda run: run['seed'])
    else:
      row['before'] = r
    name = f'{key[0]}-k{key[1]}'
    if name in errors:
      row['mean_error'] = sum(errors[name].values()) / len(errors[name])
  return rows


def intervals(rows, translations: pathlib.Path) -> list[dict]:
  """BLEU of each converted model minus the original's, paired bootstrap over sentences: before
  fine-tuning (one run each), and after against the control on the seeds both have (seeds
  averaged on each resample). Runs whose translations were not kept are left out."""
  originals = [row for (method, _), row in rows.items() if method == 'original']
  if not originals:
    return []
  (original,) = originals
  kept = lambda run: (translations / run['name']).is_dir()
  references = from_scratch.read_references()
  out = []
  for (method, key_dim), row in rows.items():
    if method == 'original':
      continue
    pairs = {}
    if (
        'before' in row
        and 'before' in original
        and kept(row['before'])
        and kept(original['before'])
    ):
      pairs['before'] = ([original['before']], [row['before']])
    seeds = sorted(
        {r['seed'] for r in row['after'] if kept(r)}
        & {r['seed'] for r in original['after'] if kept(r)}
    )
    if seeds:
      pick = lambda runs: [r for r in runs if r['seed'] in seeds]
      pairs['after'] = (pick(original['after']), pick(row['after']))
    for when, (theirs, ours) in pairs.items():
      entry = {'method': method, 'key_dim': key_dim, 'when': when, 'seeds': len(ours)}
      for split, refs in references.items():
        systems = [
            [from_scratch.checked_translations(r, split, refs, translations) for r in group]
            for group in (theirs, ours)
        ]
        entry[split] = stats.bleu_difference(refs, *systems).as_dict()
      out.append(entry)
  return out


def _mean(runs, key):
  values = [r[key] for r in runs if r.get(key) is not None]
  return sum(values) / len(values) if values else None


def report(results, errors, args) -> None:
  rows = collect_rows(results, errors)
  table_rows = []
  for row in rows.values():
    before, after = row.get('before', {}), row['after']
    table_rows.append(
        {
            'method': row['method'],
            'key_dim': row['key_dim'],
            'mean_error': row.get('mean_error'),
            'seeds': len(after),
            **{
                f'{key}_before': before.get(key) for key in ('bleu_test', 'bleu_validation', 'loss')
            },
            **{
                f'{key}_after': _mean(after, key)
                for key in ('bleu_test', 'bleu_validation', 'loss')
            },
        }
    )
  cell = lambda key, digits=2: lambda r: '' if r.get(key) is None else f'{r[key]:.{digits}f}'
  table = runner.markdown_table(
      table_rows,
      [
          ('method', 'method'),
          ('D~k', 'key_dim'),
          ('mean error', cell('mean_error', 3)),
          ('BLEU test, converted', cell('bleu_test_before')),
          ('fine-tuned', cell('bleu_test_after')),
          ('BLEU validation, converted', cell('bleu_validation_before')),
          ('fine-tuned ', cell('bleu_validation_after')),
          ('validation loss, converted', cell('loss_before', 3)),
          ('fine-tuned  ', cell('loss_after', 3)),
          ('fine-tune seeds', 'seeds'),
      ],
  )
  differences = intervals(rows, args.out / 'translations')
  runner.files.write_json(args.out / 'intervals.json', differences)
  interval = lambda split: lambda d: str(stats.Interval(**d[split]))
  diff_table = runner.markdown_table(
      differences,
      [
          ('method', 'method'),
          ('D~k', 'key_dim'),
          (
              'compared',
              lambda d: {'before': 'converted vs original', 'after': 'fine-tuned vs control'}[
                  d['when']
              ],
          ),
          ('seeds', 'seeds'),
          ('test BLEU difference [95%]', interval('test')),
          ('validation BLEU difference [95%]', interval('validation')),
      ],
  )
  (args.out / 'results.md').write_text(table + '\n' + diff_table)
  print(table)
  print(diff_table)
  if not args.smoke:
    runner.write_section(
        HERE / 'README.md',
        args.name,
        '\n'.join(
            [
                f'Source {args.source}; converted types {args.types}; fine-tune {args.finetune_steps} '
                f'steps at peak learning rate {args.learning_rate}. '
                + runner.runs_summary(results),
                '',
                'Fine-tuned columns: the mean over the fine-tune seeds.',
                '',
                table,
                'BLEU of the converted model minus the original (converted: both as they are; '
                'fine-tuned: against the original fine-tuned the same way, seeds averaged on each '
                'resample), 95% paired bootstrap over sentences (`'
                + args.name
                + '/intervals.json`):',
                '',
                diff_table
                if differences
                else f'None: no run has its translations kept in `{args.name}/translations/`.',
            ]
        ),
    )


if __name__ == '__main__':
  main()
