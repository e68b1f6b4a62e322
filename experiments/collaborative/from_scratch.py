r"""Experiment B: concat vs collaborative heads trained from scratch as the key width shrinks.

    python -m experiments.collaborative.from_scratch \
        --runs_dir=/work/runs/collaborative_from_scratch [--steps=600] [--smoke]

Multi30k en->de with the baseline model (`configs/nmt.py:multi30k`: D = 256, 3+3 layers, 8
heads), all three attention types (encoder, decoder, cross) at total query/key width
D~k in {256, 128, 64, 32} (D, D/2, D/4, D/8), values and outputs unchanged, 2 seeds each:

  concat         D~k = D: the plain baseline layer. Below D: concat heads of query/key width
                 D~k / 8 and value width 32, which `AttentionSpec` (one head_dim) cannot state
                 directly; they are collaborative layers whose block one-hot mixing stays
                 frozen (`mixing_init=concatenate`, `trainable='^(?!.*mixing)'`): the logits of
                 concat heads of that width, logit scale 1/sqrt(D~k / 8). One difference: the
                 key-content bias is a free D x 8 matrix instead of W_K^(i) b_Q^(i).
  collaborative  shared query/key projections of width D~k, trained mixing initialised as
                 in the paper's code (`mixing_init=random`), logit scale 1/sqrt(D~k / 8).

The step budget is smaller than the baseline's 1,800 (`--steps`, default 600, cosine schedule
with a sixth of it as warmup): every run is shorter, and all of them use the same budget. All
runs share one SentencePiece vocabulary and prepared data set (`<runs_dir>/shared/`).
Results: BLEU (beam 4, sacreBLEU) on test_2016_flickr and validation from each run's final
evaluation, parameters of the attention and of the model; a table and a plot (BLEU vs key
width, one line per kind, min-max over seeds) in the README. Resumable: rerun the command.
"""

import dataclasses
import importlib.util
import pathlib

from flax import nnx
import jax

from experiments import runner
from lowrank_attn import models
from lowrank_attn.runs import with_overrides
from lowrank_attn.train import config as config_lib

HERE = pathlib.Path(__file__).resolve().parent
OUT = HERE / 'from_scratch'
KINDS = ('concat', 'collaborative')


def arguments():
  parser = runner.arg_parser(__doc__, 'collaborative_from_scratch')
  parser.add_argument('--steps', type=int, default=600, help='training steps of every run')
  parser.add_argument('--key_widths', default='256,128,64,32', help='total query/key widths')
  parser.add_argument('--seeds', default='0,1')
  parser.add_argument(
      '--smoke',
      action='store_true',
      help='end to end in minutes: configs/nmt.py:tiny (D=128, 4 heads), 6 '
      'steps, key widths 128 and 32, one seed; results under --runs_dir',
  )
  args = parser.parse_args()
  args.config = 'configs/nmt.py:multi30k'
  args.key_widths = [int(k) for k in args.key_widths.split(',')]
  args.seeds = [int(s) for s in args.seeds.split(',')]
  args.out = OUT
  if args.smoke:
    args.config, args.steps, args.key_widths, args.seeds = 'configs/nmt.py:tiny', 6, [128, 32], [0]
    args.out = pathlib.Path(args.runs_dir) / 'smoke_results'
  return args


def load_config(config_file: str):
  """`configs/x.py:variant` as the command line loads it."""
  path, _, variant = config_file.partition(':')
  spec = importlib.util.spec_from_file_location('config_module', runner.REPO_ROOT / path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(variant or 'base')


def training_fields(kind: str, key_width: int, emb_dim: int, steps: int) -> dict:
  """The config overrides of one run."""
  fields = {
      'num_train_steps': steps,
      'warmup_steps': max(steps // 6, 1),
      'checkpoint_every_steps': max(steps // 4, 1),
      'eval_every_steps': 0,
      'decode.num_examples': 0,
  }  # BLEU once, in the final evaluation (validation, test)
  if kind == 'concat' and key_width == emb_dim:
    return fields  # the baseline layer
  fields |= {'model.attention.kind': 'collaborative', 'model.attention.key_dim': key_width}
  if kind == 'concat':  # concat heads of query/key width key_width / heads: frozen one-hot mixing
    return fields | {'model.attention.mixing_init': 'concatenate', 'trainable': '^(?!.*mixing)'}
  return fields | {'model.attention.mixing_init': 'random'}


def parameters(config) -> dict[str, int]:
  """Parameters of all attention layers and of the whole model a training config builds."""
  model_cfg = config_lib.model_config(config, config.data.vocab_size)
  model = nnx.eval_shape(lambda: models.EncoderDecoder(model_cfg, bos_id=1, rngs=nnx.Rngs(0)))
  return {
      'attention_params': sum(
          model_cfg.attention(t, i).num_params()
          for t in models.ATTENTION_TYPES
          for i in range(model_cfg.num_layers(t))
      ),
      'params': sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))),
  }


def main():
  args = arguments()
  base = load_config(args.config)
  emb_dim = base.model.emb_dim
  # One vocabulary and one prepared data set for all runs (the first run makes them).
  shared = pathlib.Path(args.runs_dir).resolve() / 'shared'
  data = {
      'data.tokenizer_path': str(shared / f'spm{base.data.vocab_size}.model'),
      'data.tfds_data_dir': str(shared / 'tfds'),
  }
  runs, sizes = [], {}
  for kind in KINDS:
    for key_width in args.key_widths:
      fields = training_fields(kind, key_width, emb_dim, args.steps) | data
      config = with_overrides(base, fields)
      config_lib.validate(config)  # before any run starts
      sizes[kind, key_width] = parameters(config)
      for seed in args.seeds:
        run = runner.train_run(
            f'{kind}-k{key_width}-s{seed}', args.config, seed=seed, overrides=fields
        )
        runs.append(
            dataclasses.replace(run, config={'kind': kind, 'key_width': key_width, **run.config})
        )
  # Seed by seed, and both kinds at a key width side by side: a grid stopped part way has
  # comparable pairs rather than one kind's whole sweep.
  runs.sort(
      key=lambda r: (
          args.seeds.index(r.seed),
          args.key_widths.index(r.config['key_width']),
          KINDS.index(r.config['kind']),
      )
  )
  if args.plot_only:
    results = runner.load_results(args.out)
  else:
    results = runner.run_grid(
        runs, args.out, runs_dir=args.runs_dir, parallel=args.parallel, refresh=args.refresh
    )
  report(results, sizes, args)


def report(results, sizes, args) -> None:
  rows = []
  for test, validation in zip(runner.final(results, 'test'), runner.final(results, 'validation')):
    rows.append(
        {
            **test,
            'bleu_test': runner.bleu_of(test),
            'bleu_validation': runner.bleu_of(validation),
            **sizes[test['kind'], test['key_width']],
        }
    )
  rows = [r for r in rows if r['bleu_test'] is not None]
  if not rows:
    print('no finished run has a final test evaluation yet')
    return
  runner.plot_lines(
      rows,
      x='key_width',
      y='bleu_test',
      group='kind',
      logx=True,
      out=args.out / 'bleu.png',
      xlabel='total query/key width D~k',
      ylabel='BLEU, test_2016_flickr',
      title='Multi30k en-de, trained from scratch',
  )
  summary = runner.aggregate(
      rows,
      by=['kind', 'key_width'],
      values=['bleu_test', 'bleu_validation', 'attention_params', 'params'],
  )
  summary.sort(key=lambda r: (KINDS.index(r['kind']), -r['key_width']))
  spread = lambda key: lambda r: (
      f"{r[key]:.2f} ({r[key + '_min']:.2f}-{r[key + '_max']:.2f})"
      if r['n'] > 1
      else f'{r[key]:.2f}'
  )
  table = runner.markdown_table(
      summary,
      [
          ('kind', 'kind'),
          ('D~k', 'key_width'),
          ('seeds', 'n'),
          ('BLEU test (min-max)', spread('bleu_test')),
          ('BLEU validation (min-max)', spread('bleu_validation')),
          ('attention params', lambda r: f"{r['attention_params']:,.0f}"),
          ('params', lambda r: f"{r['params']:,.0f}"),
      ],
  )
  (args.out / 'results.md').write_text(table)
  if not args.smoke:
    runner.write_section(
        HERE / 'README.md',
        'from_scratch',
        '\n'.join(
            [
                f'{args.steps} steps per run. ' + runner.runs_summary(results),
                '',
                table,
                '',
                '![BLEU vs key width](from_scratch/bleu.png)',
            ]
        ),
    )


if __name__ == '__main__':
  main()
