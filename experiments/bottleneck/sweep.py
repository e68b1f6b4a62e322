"""The head-size sweep of Bhojanapalli et al. (2020) on Shakespeare's complete works.

    python -m experiments.bottleneck.sweep --runs_dir=/work/runs/bottleneck_sweep

Character-level LM, context n = 128, D = 256, 2 layers, 250 steps of 16 x 128 characters
(`configs/lm.py:bottleneck`: the same token budget for every run), h in {1, 2, 4, 8, 16, 32}:
  concat        d = D / h: the standard layer, whose head size falls as heads are added;
  fixed_64      kind=fixed_head, d_p = n / 2;
  fixed_128     kind=fixed_head, d_p = n (the paper's choice: no low-rank bottleneck);
  fixed_64_pm   fixed_head, d_p = n / 2, with the MLP narrowed so that the model has concat's
                parameter count (fixed_head adds attention parameters as h grows); defined
                where a layer's attention alone does not outgrow concat's whole layer.
Two seeds each. A fixed_head point whose d_p equals D / h is concat's model, so it is concat's
run (trained once). Each run reports bits per character on the whole validation split (Julius
Caesar, Twelfth Night), its parameters and training FLOPs. Measured cost and results: README.

`--smoke`: the two cheapest runs, 4 steps each, into <runs_dir>/smoke; writes nothing here.
"""

import dataclasses
import json
import math
import pathlib
import sys

from flax import nnx
import jax
import ml_collections

from experiments import runner
from lowrank_attn import models
from lowrank_attn.attention import AttentionSpec
from lowrank_attn.data import CharTokenizer
from lowrank_attn.train import config as config_lib

HERE = pathlib.Path(__file__).parent
CONFIG = 'configs/lm.py:bottleneck'
LENGTH = 128  # n, the context
EMB_DIM = 256  # D
MLP_DIM = 1024
HEADS = (1, 2, 4, 8, 16, 32)
SEEDS = (0, 1)
KIND = 'model.attention.kind'
NUM_HEADS = 'model.attention.num_heads'
HEAD_DIM = 'model.attention.head_dim'
MLP = 'model.mlp_dim'
SMOKE_STEPS = 4


@dataclasses.dataclass(frozen=True)
class Variant:
  """One line of the plot: how the head size follows the head count."""

  name: str
  label: str
  head_dim: int | None = None  # fixed d_p; None: concat's D / h
  parameter_matched: bool = False  # narrow the MLP to concat's parameter count

  def overrides(self, heads: int) -> dict | None:
    """The config overrides of this variant at `heads` heads; None where it is undefined."""
    if self.head_dim is None or self.head_dim * heads == EMB_DIM:
      return {NUM_HEADS: heads}  # concat (fixed_head with d_p = D/h is the same model)
    overrides = {NUM_HEADS: heads, KIND: 'fixed_head', HEAD_DIM: self.head_dim}
    if self.parameter_matched:
      mlp_dim = matched_mlp_dim(heads, self.head_dim)
      if mlp_dim is None:
        return None
      overrides[MLP] = mlp_dim
    return overrides


VARIANTS = (
    Variant('concat', 'concat, d = D/h'),
    Variant('fixed_64', 'fixed_head, d_p = n/2 = 64', head_dim=LENGTH // 2),
    Variant('fixed_128', 'fixed_head, d_p = n = 128', head_dim=LENGTH),
    Variant(
        'fixed_64_pm',
        "fixed_head, d_p = 64, MLP narrowed to concat's parameters",
        head_dim=LENGTH // 2,
        parameter_matched=True,
    ),
)


def attention_params(heads: int, head_dim: int | None) -> int:
  kind = {} if head_dim is None else {'kind': 'fixed_head', 'head_dim': head_dim}
  return AttentionSpec(num_heads=heads, in_features=EMB_DIM, **kind).num_params()


def matched_mlp_dim(heads: int, head_dim: int) -> int | None:
  """The MLP width that gives a fixed_head layer concat's parameters; None below D.

  An MLP of width m holds 2 D m + m + D parameters (two kernels and their biases).
  """
  extra = attention_params(heads, head_dim) - attention_params(heads, None)
  mlp_dim = MLP_DIM - round(extra / (2 * EMB_DIM + 1))
  return mlp_dim if mlp_dim >= EMB_DIM else None


def model_name(variant: Variant, heads: int) -> str:
  overrides = variant.overrides(heads)
  return 'concat' if KIND not in overrides else variant.name


def points(heads=HEADS, seeds=SEEDS, variants=VARIANTS):
  """(variant, heads, seed, run name, overrides) of every defined point of the plot."""
  for variant in variants:
    for h in heads:
      overrides = variant.overrides(h)
      if overrides is not None:
        for seed in seeds:
          yield variant, h, seed, f'{model_name(variant, h)}-h{h}-s{seed}', overrides


def model_size(config, vocab_size: int) -> dict[str, float]:
  """Parameters and training FLOPs per token of a config's model (no arrays allocated)."""
  cfg = config_lib.model_config(config, vocab_size)
  model = nnx.eval_shape(lambda: models.DecoderLM(cfg, rngs=nnx.Rngs(0)))
  params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  attention = sum(layer.self_attention.spec.num_params() for layer in model.decoder.layers)
  length = config.data.max_length
  train_flops_per_token = 3 * model.flops(1, length) / length  # forward + backward ~ 3x
  return {
      'params': params,
      'attention_params': attention,
      'train_flops_per_token': train_flops_per_token,
      'train_flops': train_flops_per_token
      * config.num_train_steps
      * config.per_device_batch_size
      * length,
  }


def collect(rundir: pathlib.Path) -> dict:
  """The runner's default results, bits per character, and the model's size and cost."""
  out = runner.read_run(rundir)
  config = ml_collections.ConfigDict(out['full_config'])  # what the run trained
  (tokenizer_file,) = (rundir / 'tokenizers').glob('*char*')
  vocab_size = CharTokenizer.from_bytes(tokenizer_file.read_bytes()).vocab_size
  evals = [m for m in out['metrics'] if m['split'] == 'eval']
  if not evals:
    raise ValueError(f'{rundir}: no eval line in metrics.jsonl')
  last = max(evals, key=lambda m: m['step'])
  out['result'] = {
      **out['result'],
      **model_size(config, vocab_size),
      'bits_per_char': last['loss'] / math.log(2),
      'vocab_size': vocab_size,
  }
  return out


def grid(runs_dir: pathlib.Path, *, smoke: bool = False) -> list[runner.Run]:
  """The sweep's runs (deduplicated), or the smoke test's two."""
  tfds = {'data.tfds_data_dir': str(runs_dir / 'tfds')}  # the data set, prepared once
  runs, seen = [], set()
  for _, h, seed, name, overrides in points():
    if name in seen:
      continue
    seen.add(name)
    extra = (
        {'num_train_steps': SMOKE_STEPS, 'checkpoint_every_steps': SMOKE_STEPS, 'num_eval_steps': 2}
        if smoke
        else {}
    )
    runs.append(
        runner.train_run(
            name, CONFIG, seed=seed, overrides={**overrides, **tfds, **extra}, collect=collect
        )
    )
  if smoke:
    runs = [run for run in runs if run.name in ('concat-h1-s0', 'fixed_64-h1-s0')]
  return runs


def rows(results) -> list[dict]:
  """One row per (variant, heads, seed): the run's result under the variant's name."""
  by_name = {row['name']: row for row in runner.final(results, split='eval')}
  out = []
  for variant, h, seed, name, _ in points():
    if name in by_name:
      row = by_name[name]
      out.append(
          {
              'variant': variant.label,
              'heads': h,
              'seed': seed,
              'run': name,
              **{
                  k: row.get(k)
                  for k in (
                      'bits_per_char',
                      'params',
                      'attention_params',
                      'train_flops',
                      'wall_time_s',
                      MLP,
                      HEAD_DIM,
                  )
              },
          }
      )
  return out


def report(results) -> str:
  """The README's results section: table, plot, runs summary."""
  table_rows = runner.aggregate(
      rows(results),
      by=['variant', 'heads'],
      values=['bits_per_char', 'params', 'attention_params', 'train_flops', 'wall_time_s'],
  )
  runner.plot_lines(
      rows(results),
      x='heads',
      y='bits_per_char',
      group='variant',
      out=HERE / 'sweep.png',
      logx=True,
      xlabel='heads h (D = 256, n = 128)',
      ylabel='validation bits per character',
      title='Head-size sweep, char LM on Shakespeare (min-max over seeds)',
  )
  table = runner.markdown_table(
      table_rows,
      [
          ('variant', 'variant'),
          ('h', 'heads'),
          ('head size', lambda r: _head_size(r)),
          ('seeds', 'n'),
          ('bits/char', lambda r: f"{r['bits_per_char']:.4f} ± {r['bits_per_char_std']:.4f}"),
          ('params', lambda r: f"{r['params'] / 1e6:.2f}M"),
          ('attention params', lambda r: f"{r['attention_params'] / 1e6:.2f}M"),
          ('train PFLOP', lambda r: f"{r['train_flops'] / 1e15:.2f}"),
          ('run time', lambda r: f"{r['wall_time_s'] / 60:.1f} min"),
      ],
  )
  return '\n'.join(
      [runner.runs_summary(results), '', table, '![sweep](sweep.png)', '', *_trends(table_rows)]
  )


def _trends(table_rows) -> list[str]:
  """Per variant: bits/char at its fewest and most heads, against the spread over seeds."""
  lines = [
      'Fewest to most heads, per variant (mean bits/char; spread = largest max - min '
      'over seeds at any h of that variant):',
      '',
  ]
  for variant in VARIANTS:
    points = sorted(
        (r for r in table_rows if r['variant'] == variant.label), key=lambda r: r['heads']
    )
    if len(points) < 2:
      continue
    first, last = points[0], points[-1]
    spread = max(r['bits_per_char_max'] - r['bits_per_char_min'] for r in points)
    change = last['bits_per_char'] - first['bits_per_char']
    lines.append(
        f"- {variant.label}: {first['bits_per_char']:.3f} at h = {first['heads']}, "
        f"{last['bits_per_char']:.3f} at h = {last['heads']} ({change:+.3f}; "
        f'spread {spread:.3f})'
    )
  return lines


def _head_size(row) -> int:
  variant = next(v for v in VARIANTS if v.label == row['variant'])
  overrides = variant.overrides(row['heads'])
  return overrides.get(HEAD_DIM, EMB_DIM // row['heads'])


def main(argv=None):
  parser = runner.arg_parser(__doc__, 'bottleneck_sweep')
  parser.add_argument(
      '--smoke', action='store_true', help=f'two runs of {SMOKE_STEPS} steps under <runs_dir>/smoke'
  )
  args = parser.parse_args(argv)
  runs_dir = pathlib.Path(args.runs_dir)
  if args.smoke:
    smoke_dir = runs_dir / 'smoke'
    results = runner.run_grid(
        grid(smoke_dir, smoke=True),
        smoke_dir,
        runs_dir=smoke_dir,
        **runner.grid_options(args),
    )
    print(json.dumps(rows(results), indent=1))
    return results
  if args.plot_only:
    results = runner.load_results(HERE)
  else:
    results = runner.run_grid(grid(runs_dir), HERE, runs_dir=runs_dir, **runner.grid_options(args))
  runner.write_section(HERE / 'README.md', 'sweep', report(results))
  return results


if __name__ == '__main__':
  main(sys.argv[1:])
