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

Controls for collaborative's lead at D~k = D (`--kinds`, run at full width only):

  collaborative_concat_init  collaborative at D~k = D with trained mixing initialised block
                 one-hot (`mixing_init=concatenate`): exactly the concat layer at step 0;
  collaborative_ones_init    the same from all-ones mixing (`mixing_init=all_ones`);
  collaborative_ones_init_scaled  all-ones mixing with logit scale 1/sqrt(D) instead of
                 1/sqrt(D / 8): each head's logits at step 0 then have a concat head's variance
                 (a sum of D products, not D / 8), so what is left of ones_init's failure is its
                 identical heads, not its 8x larger logits;
  fixed_head_64  concat heads of size 64 (`kind=fixed_head`, head_dim 64: query/key/value width
                 8 x 64 = 512): each head's logits a rank-64 form instead of rank 32, the rank
                 control (Bhojanapalli et al.'s remedy).

The step budget is smaller than the baseline's 1,800 (`--steps`, default 600, cosine schedule
with a sixth of it as warmup): every run is shorter, and all of them use the same budget; runs
of another budget are named `...-n<steps>` and tabled apart. All runs share one SentencePiece
vocabulary and prepared data set (`<runs_dir>/shared/`). Results: BLEU (beam 4, sacreBLEU) on
test_2016_flickr and validation from each run's final evaluation, parameters of the attention
and of the model; a table, a plot (BLEU vs key width, one line per kind and budget, min-max over
seeds) and paired bootstrap intervals of the differences to concat at the same width and budget
(seeds averaged on each resample; the translations are kept in `from_scratch/translations/`)
in the README. Resumable: rerun the command. A run that results.json records but whose run
directory (and so its translations) is gone counts as finished; `--rerun_lost` runs it again.
"""

import dataclasses
import gzip
import importlib.util
import math
import os
import pathlib
import shutil

from flax import nnx
import jax

from experiments import runner
from experiments import stats
from lowrank_attn import models
from lowrank_attn.runs import with_overrides
from lowrank_attn.train import config as config_lib

HERE = pathlib.Path(__file__).resolve().parent
OUT = HERE / 'from_scratch'
KINDS = ('concat', 'collaborative')  # swept over --key_widths
# Run at D~k = D only: what explains collaborative's lead at full width (issue 24).
CONTROLS = (
    'collaborative_concat_init',
    'collaborative_ones_init',
    'collaborative_ones_init_scaled',
    'fixed_head_64',
)
DEFAULT_STEPS = 600
# The final evaluation's splits and their reference files (under LOWRANK_ATTN_DATA).
REFERENCES = {'test': 'multi30k/test_2016_flickr.de.gz', 'validation': 'multi30k/val.de.gz'}


def arguments():
  parser = runner.arg_parser(__doc__, 'collaborative_from_scratch')
  parser.add_argument('--steps', type=int, default=600, help='training steps of every run')
  parser.add_argument('--key_widths', default='256,128,64,32', help='total query/key widths')
  parser.add_argument('--seeds', default='0,1')
  parser.add_argument(
      '--kinds',
      default=','.join(KINDS),
      help=f'of {",".join(KINDS + CONTROLS)}; the controls run at D~k = D only',
  )
  parser.add_argument(
      '--rerun_lost',
      action='store_true',
      help='run again the runs results.json has but whose run directories (and translations) '
      'are gone, so that they get intervals; their old entries stand until then',
  )
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
  args.kinds = args.kinds.split(',')
  unknown = sorted(set(args.kinds) - set(KINDS + CONTROLS))
  if unknown:
    parser.error(f'--kinds: {unknown} unknown; valid: {",".join(KINDS + CONTROLS)}')
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


# The collaborative controls' mixing initialisations.
CONTROL_INITS = {
    'collaborative_concat_init': 'concatenate',
    'collaborative_ones_init': 'all_ones',
    'collaborative_ones_init_scaled': 'all_ones',
}


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
  if kind == 'fixed_head_64':
    return fields | {'model.attention.kind': 'fixed_head', 'model.attention.head_dim': 64}
  if kind in CONTROL_INITS:
    fields |= {
        'model.attention.kind': 'collaborative',
        'model.attention.key_dim': emb_dim,
        'model.attention.mixing_init': CONTROL_INITS[kind],
    }
    if kind == 'collaborative_ones_init_scaled':
      fields['model.attention.logit_scale'] = 1 / math.sqrt(emb_dim)
    return fields
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
  runs = []
  budget = '' if args.steps == DEFAULT_STEPS else f'-n{args.steps}'
  for kind in args.kinds:
    for key_width in args.key_widths if kind in KINDS else [key_width_of(kind, base)]:
      fields = training_fields(kind, key_width, emb_dim, args.steps) | data
      config_lib.validate(with_overrides(base, fields))  # before any run starts
      for seed in args.seeds:
        run = runner.train_run(
            f'{kind}-k{key_width}-s{seed}{budget}', args.config, seed=seed, overrides=fields
        )
        runs.append(
            dataclasses.replace(
                run,
                config={'kind': kind, 'key_width': key_width, 'steps': args.steps, **run.config},
            )
        )
  # Seed by seed, and both kinds at a key width side by side: a grid stopped part way has
  # comparable pairs rather than one kind's whole sweep.
  runs.sort(
      key=lambda r: (
          args.seeds.index(r.seed),
          args.key_widths.index(r.config['key_width']) if r.config['kind'] in KINDS else 0,
          args.kinds.index(r.config['kind']),
      )
  )
  if args.plot_only:
    results = runner.load_results(args.out)
  else:
    results = runner.run_grid(
        runs,
        args.out,
        runs_dir=args.runs_dir,
        rerun_lost=args.rerun_lost,
        **runner.grid_options(args),
    )
  keep_translations(results, args.out / 'translations')
  report(results, base, args)


def key_width_of(kind: str, base) -> int:
  """Total query/key width of a control (`CONTROLS`) on the model of config `base`."""
  model = base.model
  return model.attention.num_heads * 64 if kind == 'fixed_head_64' else model.emb_dim


def steps_of(row) -> int:
  """A run's step budget (runs of before `steps` was recorded: their config's)."""
  return row.get('steps') or DEFAULT_STEPS


def keep_translations(results, target: pathlib.Path) -> None:
  """Copies each finished run's final translations (`final_eval/<last step>/<split>.txt`) to
  `target/<run>/`: the bootstrap reads them, and run directories may not survive. A run whose
  directory is here wrote its entry, so its translations replace kept ones (a run trained
  again, e.g. `--rerun_lost`); a run whose directory is gone keeps what was kept."""
  for entry in results['runs']:
    found = sorted(
        pathlib.Path(results['runs_dir'], entry['name'], 'final_eval').glob('*/test.txt'),
        key=lambda p: int(p.parent.name),
    )
    if not found:
      continue
    (target / entry['name']).mkdir(parents=True, exist_ok=True)
    for split in REFERENCES:
      shutil.copyfile(found[-1].parent / f'{split}.txt', target / entry['name'] / f'{split}.txt')


def read_lines(path) -> list[str]:
  opener = gzip.open if str(path).endswith('.gz') else open
  with opener(path, 'rt', encoding='utf-8') as f:
    return [line.rstrip('\n') for line in f]


def read_references() -> dict[str, list[str]]:
  """The German references of the splits BLEU is reported on, from the data directory."""
  data = pathlib.Path(os.environ.get('LOWRANK_ATTN_DATA', runner.REPO_ROOT.parent / 'shared/data'))
  return {split: read_lines(data / path) for split, path in REFERENCES.items()}


def checked_translations(row: dict, split: str, references, translations: pathlib.Path):
  """A run's kept translations of `split`, refused unless their corpus BLEU against the
  references is the one its final evaluation recorded (else the two are not in one order)."""
  hypotheses = read_lines(translations / row['name'] / f'{split}.txt')
  recomputed = stats.corpus_bleu(references, hypotheses)
  if abs(recomputed - row[f'bleu_{split}']) > 0.01:
    raise ValueError(
        f'{row["name"]}: {split} BLEU {recomputed:.2f} from the kept translations, '
        f'{row[f"bleu_{split}"]:.2f} recorded: references and translations disagree'
    )
  return hypotheses


def intervals(rows, emb_dim: int, translations: pathlib.Path) -> list[dict]:
  """Paired bootstrap of BLEU(kind) - BLEU(concat) per split, at each key width and budget
  where both have kept translations of the same seeds (seeds averaged on each resample); the
  controls against concat at D~k = D. Each corpus BLEU recomputed from the kept translations
  must equal the recorded one (else the references are not in the translations' order)."""
  references = read_references()
  groups = translated_groups(rows, translations)
  out = []
  for (kind, width, steps), ours in sorted(groups.items(), key=lambda kv: _order(*kv[0])):
    theirs = groups.get(('concat', width if kind in KINDS else emb_dim, steps), [])
    seeds = sorted({r['seed'] for r in ours} & {r['seed'] for r in theirs})
    if kind == 'concat' or not seeds:
      continue
    entry = {'kind': kind, 'key_width': width, 'steps': steps, 'seeds': len(seeds)}
    for split, refs in references.items():
      systems = [seed_systems(g, seeds, split, refs, translations) for g in (theirs, ours)]
      entry[split] = stats.bleu_difference(refs, *systems).as_dict()
    out.append(entry)
  return out


def translated_groups(rows, translations: pathlib.Path) -> dict[tuple, list[dict]]:
  """{(kind, key width, steps): its rows} of the runs whose translations are kept."""
  groups = {}
  for r in rows:
    if (translations / r['name']).is_dir():
      groups.setdefault((r['kind'], r['key_width'], steps_of(r)), []).append(r)
  return groups


def seed_systems(group, seeds, split: str, refs, translations: pathlib.Path) -> list:
  """The checked translations of `split` of the group's runs of `seeds`, in seed order."""
  runs = sorted((r for r in group if r['seed'] in seeds), key=lambda r: r['seed'])
  return [checked_translations(r, split, refs, translations) for r in runs]


def narrowing(rows, emb_dim: int, translations: pathlib.Path) -> list[dict]:
  """The paper's claim as one contrast per budget and key width D~k < D: (collaborative -
  concat at D~k) - (collaborative - concat at D), paired bootstrap over sentences with all four
  systems scored on each resample (seeds common to the four, averaged). Positive: narrowing the
  keys from D to D~k widens collaborative's lead."""
  references = read_references()
  groups = {key: g for key, g in translated_groups(rows, translations).items() if key[0] in KINDS}
  out = []
  for steps in sorted({key[2] for key in groups}):
    widths = sorted({w for (_, w, s) in groups if s == steps and w < emb_dim}, reverse=True)
    for width in widths:
      cells = [groups.get((kind, w, steps), []) for w in (emb_dim, width) for kind in KINDS]
      seeds = sorted(set.intersection(*({r['seed'] for r in cell} for cell in cells)))
      if not seeds:
        continue
      entry = {'key_width': width, 'steps': steps, 'seeds': len(seeds)}
      for split, refs in references.items():
        systems = [seed_systems(cell, seeds, split, refs, translations) for cell in cells]
        # cells: concat at D, collaborative at D, concat at D~k, collaborative at D~k.
        entry[split] = stats.bleu_contrast(refs, systems, [1, -1, -1, 1]).as_dict()
      out.append(entry)
  return out


def _order(kind: str, width: int, steps: int):
  return (steps, (KINDS + CONTROLS).index(kind), -width)


def report(results, base, args) -> None:
  emb_dim = base.model.emb_dim
  sizes = {}  # (kind, key width) -> parameters

  def size(kind, width):
    if (kind, width) not in sizes:
      fields = training_fields(kind, width, emb_dim, DEFAULT_STEPS)
      sizes[kind, width] = parameters(with_overrides(base, fields))
    return sizes[kind, width]

  rows = []
  for test, validation in zip(runner.final(results, 'test'), runner.final(results, 'validation')):
    row = {**test, 'bleu_test': runner.bleu_of(test), 'bleu_validation': runner.bleu_of(validation)}
    if row['bleu_test'] is not None:
      row['steps'] = steps_of(row)
      rows.append({**row, **size(row['kind'], row['key_width'])})
  if not rows:
    print('no finished run has a final test evaluation yet')
    return
  label = lambda r: r['kind'] + ('' if r['steps'] == DEFAULT_STEPS else f' ({r["steps"]} steps)')
  runner.plot_lines(
      [{**r, 'line': label(r)} for r in rows if r['kind'] in KINDS],
      x='key_width',
      y='bleu_test',
      group='line',
      logx=True,
      out=args.out / 'bleu.png',
      xlabel='total query/key width D~k',
      ylabel='BLEU, test_2016_flickr',
      title='Multi30k en-de, trained from scratch',
  )
  summary = runner.aggregate(
      rows,
      by=['steps', 'kind', 'key_width'],
      values=['bleu_test', 'bleu_validation', 'attention_params', 'params'],
  )
  summary.sort(key=lambda r: _order(r['kind'], r['key_width'], r['steps']))
  spread = lambda key: lambda r: (
      f"{r[key]:.2f} ({r[key + '_min']:.2f}-{r[key + '_max']:.2f})"
      if r['n'] > 1
      else f'{r[key]:.2f}'
  )
  table = runner.markdown_table(
      summary,
      [
          ('steps', lambda r: f"{r['steps']:,}"),
          ('kind', 'kind'),
          ('D~k', 'key_width'),
          ('seeds', 'n'),
          ('BLEU test (min-max)', spread('bleu_test')),
          ('BLEU validation (min-max)', spread('bleu_validation')),
          ('attention params', lambda r: f"{r['attention_params']:,.0f}"),
          ('params', lambda r: f"{r['params']:,.0f}"),
      ],
  )
  differences = intervals(rows, emb_dim, args.out / 'translations')
  interval_table = runner.markdown_table(
      differences,
      [
          ('steps', lambda r: f"{r['steps']:,}"),
          ('kind', 'kind'),
          ('D~k', 'key_width'),
          ('seeds', 'seeds'),
          ('test BLEU - concat [95%]', lambda r: str(stats.Interval(**r['test']))),
          ('validation BLEU - concat [95%]', lambda r: str(stats.Interval(**r['validation']))),
      ],
  )
  widening = narrowing(rows, emb_dim, args.out / 'translations')
  widening_table = runner.markdown_table(
      widening,
      [
          ('steps', lambda r: f"{r['steps']:,}"),
          ('D~k', 'key_width'),
          ('seeds', 'seeds'),
          ('test: lead at D~k - lead at D [95%]', lambda r: str(stats.Interval(**r['test']))),
          (
              'validation: lead at D~k - lead at D [95%]',
              lambda r: str(stats.Interval(**r['validation'])),
          ),
      ],
  )
  runner.files.write_json(args.out / 'intervals.json', differences)
  runner.files.write_json(args.out / 'narrowing.json', widening)
  (args.out / 'results.md').write_text(table + '\n' + interval_table + '\n' + widening_table)
  if not args.smoke:
    runner.write_section(
        HERE / 'README.md',
        'from_scratch',
        '\n'.join(
            [
                runner.runs_summary(results),
                '',
                table,
                '',
                'Differences to concat at the same key width and budget (the controls: to concat '
                'at D~k = D), paired bootstrap over sentences, seeds averaged '
                '(`from_scratch/intervals.json`); runs whose translations were not kept '
                '(run directories lost before this table existed) are not in it:',
                '',
                interval_table if differences else '(none yet)\n',
                '',
                'Does narrowing the keys widen the lead? Collaborative minus concat at D~k, '
                'minus the same at D~k = D, the four systems on the same resampled sentences '
                '(`from_scratch/narrowing.json`; positive: the lead grows as the keys narrow, '
                "the paper's claim):",
                '',
                widening_table if widening else '(none yet)\n',
                '',
                '![BLEU vs key width](from_scratch/bleu.png)',
            ]
        ),
    )


if __name__ == '__main__':
  main()
