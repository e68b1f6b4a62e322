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
"""

import json
import pathlib

from experiments import runner
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
  parser.add_argument(
      '--smoke',
      action='store_true',
      help='collaborative at D~k=128 only, a 2-step fine-tune, greedy decoding '
      'of at most 8 tokens; results under --runs_dir',
  )
  args = parser.parse_args()
  args.key_dims = [int(k) for k in args.key_dims.split(',')]
  args.types = args.types.split(',')
  args.methods, args.out, args.decode = METHODS, HERE / 'nmt', {}
  if args.smoke:
    args.key_dims, args.methods, args.finetune_steps = [128], ('collaborative',), 2
    args.out = pathlib.Path(args.runs_dir) / 'smoke_results'
    args.decode = {'decode.beam_size': 1, 'decode.max_length': 8}
  return args


def convert(model, method: str, key_dim: int, types):
  if method == 'per_head_svd':
    return to_low_rank_concat(model, key_dim, types)
  return to_collaborative(model, key_dim, types, rescale_logits=method == 'collaborative_rescaled')


def main():
  args = arguments()
  source = RunDir(args.source)
  source_config, source_model = source.config, source.model()
  data = source.data_overrides()
  converted_dir = pathlib.Path(args.runs_dir).resolve() / 'converted'
  common = {**data, **args.decode}

  def run(name, fields, **config):
    train = runner.train_run(
        name, args.config, seed=source_config.seed, overrides={**common, **fields}
    )
    return runner.Run(name, train.command, config={**config, **train.config}, seed=train.seed)

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
      run(
          'original-ft',
          {**tune, 'init_from': source.path},
          method='original',
          key_dim=width,
          finetuned=True,
      ),
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
      runs.append(
          run(
              f'{name}-ft',
              {**fields, **tune, **frozen},
              method=method,
              key_dim=key_dim,
              finetuned=True,
          )
      )
  if args.plot_only:
    results = runner.load_results(args.out)
  else:
    results = runner.run_grid(
        runs, args.out, runs_dir=args.runs_dir, parallel=args.parallel, refresh=args.refresh
    )
  report(results, errors, args)


def report(results, errors, args) -> None:
  rows = {}
  for test, validation in zip(runner.final(results, 'test'), runner.final(results, 'validation')):
    key = (test['method'], test['key_dim'])
    row = rows.setdefault(key, {'method': key[0], 'key_dim': key[1]})
    when = 'after' if test['finetuned'] else 'before'
    row[f'test_{when}'] = runner.bleu_of(test)
    row[f'validation_{when}'] = runner.bleu_of(validation)
    row[f'loss_{when}'] = validation.get('loss')
    name = f'{key[0]}-k{key[1]}'
    if name in errors:
      row['mean_error'] = sum(errors[name].values()) / len(errors[name])
  cell = lambda key, digits=2: lambda r: '' if r.get(key) is None else f'{r[key]:.{digits}f}'
  table = runner.markdown_table(
      list(rows.values()),
      [
          ('method', 'method'),
          ('D~k', 'key_dim'),
          ('mean error', lambda r: f"{r['mean_error']:.3f}" if 'mean_error' in r else ''),
          ('BLEU test, converted', cell('test_before')),
          ('fine-tuned', cell('test_after')),
          ('BLEU validation, converted', cell('validation_before')),
          ('fine-tuned ', cell('validation_after')),
          ('validation loss, converted', cell('loss_before', 3)),
          ('fine-tuned  ', cell('loss_after', 3)),
      ],
  )
  (args.out / 'results.md').write_text(table)
  print(table)
  if not args.smoke:
    runner.write_section(
        HERE / 'README.md',
        'nmt',
        '\n'.join(
            [
                f'Source {args.source}; converted types {args.types}; fine-tune {args.finetune_steps} '
                f'steps at peak learning rate {args.learning_rate}. '
                + runner.runs_summary(results),
                '',
                table,
            ]
        ),
    )


if __name__ == '__main__':
  main()
