"""The low-rank bottleneck, measured: how well one head of size d can fit an n x n attention map.

    python -m experiments.bottleneck.expressivity --runs_dir=/work/runs/bottleneck_expressivity

Bhojanapalli et al. (2020): a head's logits (X W_Q)(X W_K)^T have rank <= d, so a head with
d < n cannot produce every row-stochastic n x n matrix (their Theorem 2), while d >= n can
when X has rank n (Theorem 1). For n in {16, 32, 64, 128} and d from 1 to 2n, W_Q and W_K
`[D, d]` are fitted by Adam on the row-wise KL (`lowrank_attn.analysis.rank.fit_head`, all
problems of one (n, d) in one vmapped, jitted loop), for three kinds of problem:
  random X, sharp target   X ~ N(0, 1) `[n, 256]`; P = softmax(s * permutation + N(0, 1)),
                           s such that the permuted entry holds ~80% of a row's mass;
  real X, sharp target     X = the input of an attention layer (after its LayerNorm) of a
                           trained character LM on a window of n characters of the validation
                           split (Julius Caesar, Twelfth Night); the same kind of target;
  real X, real target      P = the attention map of one head of that model on that window
                           (causal, so the fit uses the causal mask too).
The trained model has the sweep's configuration with 8 heads of d = 32 (`configs/lm.py:
bottleneck`, D = 256, 2 layers), trained for 150 steps here unless runs_dir holds it. The script
also measures the numerical rank of that model's head logits (they must sit at <= 32).
Results: results.json, expressivity_*.png and the README's table.
"""

import json
import math
import pathlib
import sys
import time

import jax.numpy as jnp
import numpy as np

from experiments import runner
from experiments.bottleneck import sweep
from lowrank_attn import data
from lowrank_attn.analysis import rank
from lowrank_attn.attention import causal_mask
from lowrank_attn.runs import RunDir, write_atomic

HERE = pathlib.Path(__file__).parent
LENGTHS = (16, 32, 64, 128)
RANDOM_DIM = 256  # D of the random inputs: >= every n, so X has rank n
SOURCE_HEADS = 8
SOURCE_STEPS = 150  # half the sweep's budget: 307k characters, eval loss 2.39 nats
SOURCE_RUN = f'source-h{SOURCE_HEADS}-{SOURCE_STEPS}steps'
TARGET_MASS = 0.8  # share of a row's mass on its permuted entry in sharp targets
KL_FLOOR = 1e-6  # the plots' log axis shows smaller errors (and exact zeros) here
PROBLEMS = ('random X, sharp target', 'real X, sharp target', 'real X, real target')
RANK_WINDOWS = 64  # validation windows whose head logits are ranked


def head_dims(n: int) -> list[int]:
  """1, 2, 4 and n/8 ... 2n: dense near d = n, where the error must vanish."""
  return sorted({1, 2, 4, n // 8, n // 4, n // 2, 3 * n // 4, n, 2 * n} - {0})


def sharp_targets(rng, n: int, count: int):
  """`[count, n, n]` random sharp attention maps: a random permutation plus N(0, 1) noise
  in the logits, the permuted entry holding about TARGET_MASS of each row."""
  perms = np.stack([np.eye(n)[rng.permutation(n)] for _ in range(count)])
  # E[exp(noise)] = e^(1/2) for the n - 1 other entries of a row.
  sharpness = math.log(TARGET_MASS / (1 - TARGET_MASS) * (n - 1)) + 0.5
  logits = sharpness * perms + rng.standard_normal((count, n, n))
  logits -= logits.max(-1, keepdims=True)
  p = np.exp(logits)
  return (p / p.sum(-1, keepdims=True)).astype(np.float32)


# ------------------------------------------------------------------------ the trained model


def train_source(runs_dir: pathlib.Path) -> pathlib.Path:
  """The source model's run under runs_dir, trained unless it is finished there."""
  run = runner.train_run(
      SOURCE_RUN,
      sweep.CONFIG,
      seed=0,
      overrides={
          sweep.NUM_HEADS: SOURCE_HEADS,
          'num_train_steps': SOURCE_STEPS,
          'num_eval_steps': 8,
          'data.tfds_data_dir': str(runs_dir / 'tfds'),
      },
      collect=sweep.collect,
  )
  runner.run_grid([run], runs_dir, runs_dir=runs_dir)
  return runs_dir / SOURCE_RUN


def load_model(rundir: pathlib.Path):
  """(model, tokenizer, config) of a finished training run: its latest checkpoint's model."""
  run = RunDir(rundir)
  return run.model(), run.tokenizer, run.config


def validation_windows(rundir: pathlib.Path, tokenizer, n: int, count: int, rng):
  """`[count, n]` token ids: BOS and the first n - 1 characters of random validation
  paragraphs at least that long (what the model saw: paragraphs are its documents)."""
  source = data.load_data_source('shakespeare', 'validation', tfds_data_dir=rundir.parent / 'tfds')
  texts = [t for t in (source[i]['text'].decode() for i in range(len(source))) if len(t) >= n - 1]
  chosen = rng.choice(len(texts), size=count, replace=len(texts) < count)
  return np.array(
      [[tokenizer.bos_id, *tokenizer.encode(texts[i][: n - 1])] for i in chosen], np.int32
  )


def attention_inputs(model, tokens):
  """Per layer: the attention's input X `[batch, n, D]` (after its LayerNorm), the heads'
  logits `[batch, heads, n, n]` (before masking) and weights, for unpacked windows."""
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  _, aux = model(tokens, return_logits=True, return_weights=True)
  x = model.decoder.embedding(tokens, positions, deterministic=True, rngs=None)
  mask = causal_mask(tokens.shape[1])[None, None]
  inputs = []
  for layer in model.decoder.layers:
    inputs.append(layer.self_attention_norm(x))
    x, _ = layer(x, mask=mask, deterministic=True, rngs=None)
  return (inputs, aux['attention_logits']['decoder'], aux['attention_weights']['decoder'])


def recomputed_logits(model, layer: int, x):
  """Head logits from X and the layer's kernels: checks that X is the head's real input."""
  attention = model.decoder.layers[layer].self_attention
  q = (
      jnp.einsum('bnd,dhk->bhnk', x, attention.query_kernel[...])
      + attention.query_bias[...][:, None]
  )
  k = jnp.einsum('bnd,dhk->bhnk', x, attention.key_kernel[...]) + attention.key_bias[...][:, None]
  return jnp.einsum('bhqk,bhnk->bhqn', q, k) * attention.spec.logit_scale


# ------------------------------------------------------------------------------- the fits


def problems(n: int, seeds: int, model, windows, rng):
  """Inputs `[3 * seeds, n, D]`, targets, masks and a description of each problem.

  Real inputs with sharp targets come from the last layer (contextual embeddings of full
  rank; the first layer's inputs, token plus position embeddings, are rank-deficient: see
  `trained_ranks`); real targets from a random layer and head, with that layer's inputs.
  """
  x_random = rng.standard_normal((seeds, n, RANDOM_DIM)).astype(np.float32)
  inputs, _, weights = attention_inputs(model, windows[:seeds, :n])
  inputs, weights = np.stack(inputs), np.stack(weights)  # [layers, seeds, ...]
  last = len(inputs) - 1
  layers = rng.integers(len(inputs), size=seeds)
  heads = rng.integers(weights.shape[2], size=seeds)
  seed_ids = np.arange(seeds)
  if inputs.shape[-1] != RANDOM_DIM:
    raise ValueError(
        f'the trained model has D={inputs.shape[-1]}; the fits stack its inputs '
        f'with random ones of D={RANDOM_DIM}.'
    )
  full, causal = np.ones((n, n), bool), np.tril(np.ones((n, n), bool))
  x = np.concatenate([x_random, inputs[last], inputs[layers, seed_ids]])
  p = np.concatenate(
      [sharp_targets(rng, n, seeds), sharp_targets(rng, n, seeds), weights[layers, seed_ids, heads]]
  )
  masks = np.stack([full] * (2 * seeds) + [causal] * seeds)
  input_ranks = np.asarray(rank.numerical_rank(x))
  described = []
  for k, problem in enumerate(PROBLEMS):
    for seed in range(seeds):
      layer = (None, last, int(layers[seed]))[k]
      described.append(
          {
              'problem': problem,
              'seed': seed,
              'layer': layer,
              'head': int(heads[seed]) if k == 2 else None,
              'input_rank': int(input_ranks[k * seeds + seed]),
          }
      )
  return x, p, masks, described


def run_fits(model, windows, *, seeds: int, steps: int, lengths, rng) -> list[dict]:
  rows = []
  for n in lengths:
    x, p, masks, described = problems(n, seeds, model, windows, rng)
    for d in head_dims(n):
      start = time.time()
      # Two starts, the better fit counts: random, and the rank-d SVD of log P through X^+.
      fits = {
          init: rank.fit_head(x, p, d, mask=masks, steps=steps, seed=np.arange(len(x)), init=init)
          for init in rank.INITS
      }
      kl = {init: np.asarray(fit.kl) for init, fit in fits.items()}
      ranks = {init: np.asarray(rank.numerical_rank(fit.logits)) for init, fit in fits.items()}
      for i, problem in enumerate(described):
        best = min(rank.INITS, key=lambda init: kl[init][i])
        rows.append(
            {
                **problem,
                'length': n,
                'd': d,
                'd_over_n': d / n,
                'kl': float(kl[best][i]),
                'kl_plot': max(float(kl[best][i]), KL_FLOOR),
                'best_init': best,
                'fitted_rank': int(ranks[best][i]),
                **{f'kl_{init}': float(kl[init][i]) for init in rank.INITS},
            }
        )
      print(
          f'n={n} d={d}: best KL '
          + ' '.join(f'{min(kl[i][j] for i in kl):.2g}' for j in range(len(x)))
          + f' ({time.time() - start:.0f} s)',
          flush=True,
      )
  return rows


def trained_ranks(model, windows) -> list[dict]:
  """Numerical and 99%-energy rank of every head's logits, per layer, over the windows."""
  inputs, logits, _ = attention_inputs(model, windows)
  rows = []
  for layer, (x, layer_logits) in enumerate(zip(inputs, logits)):
    error = float(np.max(np.abs(recomputed_logits(model, layer, x) - layer_logits)))
    if error > 1e-3 * float(np.max(np.abs(layer_logits))):
      raise RuntimeError(
          f'layer {layer}: logits recomputed from the captured inputs differ by '
          f'{error}; the inputs are not what the heads saw.'
      )
    numerical = np.asarray(rank.numerical_rank(layer_logits))  # [windows, heads]
    energy = np.asarray(rank.energy_rank(layer_logits, 0.99))
    input_ranks = np.asarray(rank.numerical_rank(x))  # [windows]
    head_dim = model.decoder.layers[layer].self_attention.spec.head_dim
    rows.append(
        {
            'layer': layer,
            'head_dim': head_dim,
            'n': int(windows.shape[1]),
            'windows': int(windows.shape[0]),
            'input_rank_min': int(input_ranks.min()),
            'input_rank_max': int(input_ranks.max()),
            'numerical_rank_max': int(numerical.max()),
            'numerical_rank_min': int(numerical.min()),
            'energy99_rank_mean': float(energy.mean()),
            'energy99_rank_max': int(energy.max()),
        }
    )
  return rows


# ---------------------------------------------------------------------------- the report


def report(results, out_dir: pathlib.Path) -> str:
  fits = results['fits']
  for problem in PROBLEMS:
    slug = problem.replace(', ', '_').replace(' ', '_')
    rows = [
        {**r, 'd_over_n': round(r['d_over_n'], 4)}  # short tick labels
        for r in fits
        if r['problem'] == problem
    ]
    runner.plot_lines(
        rows,
        x='d_over_n',
        y='kl_plot',
        group='length',
        out=out_dir / f'expressivity_{slug}.png',
        logx=True,
        logy=True,
        xlabel='head size / sequence length, d / n',
        ylabel=f'row-wise KL of the best fit (nats; < {KL_FLOOR:g} drawn at it)',
        title=problem,
    )
  # 'length' is n: aggregate's own 'n' counts the seeds.
  by = runner.aggregate(fits, by=['problem', 'length', 'd'], values=['kl', 'fitted_rank'])
  cells = {(r['problem'], r['length'], r['d']): r for r in by}
  lengths = sorted({r['length'] for r in fits})
  lines = []
  for problem in PROBLEMS:
    for label, d_of in (
        ('1', lambda n: 1),
        ('n/8', lambda n: n // 8),
        ('n/4', lambda n: n // 4),
        ('n/2', lambda n: n // 2),
        ('3n/4', lambda n: 3 * n // 4),
        ('n', lambda n: n),
        ('2n', lambda n: 2 * n),
    ):
      row = {'problem': problem, 'd': label}
      for n in lengths:
        cell = cells.get((problem, n, d_of(n)))
        row[f'n = {n}'] = (
            None if cell is None else (f"{cell['kl']:.2g} (rank {cell['fitted_rank_max']:.0f})")
        )
      lines.append(row)
  table = runner.markdown_table(lines, ['problem', 'd', *[f'n = {n}' for n in lengths]])
  # Theorem 1 needs rank(X) = n: the inputs' own numerical rank, per problem and n.
  input_ranks = []
  for problem in PROBLEMS:
    row = {'inputs of': problem}
    for n in lengths:
      values = [r['input_rank'] for r in fits if r['problem'] == problem and r['length'] == n]
      row[f'n = {n}'] = f'{min(values)}-{max(values)}'
    input_ranks.append(row)
  input_table = runner.markdown_table(input_ranks, ['inputs of', *[f'n = {n}' for n in lengths]])
  ranks = runner.markdown_table(
      results['trained_ranks'],
      [
          ('layer', 'layer'),
          ('head size d', 'head_dim'),
          ('n', 'n'),
          ('windows', 'windows'),
          ('rank of its inputs X', lambda r: f"{r['input_rank_min']}-{r['input_rank_max']}"),
          (
              'numerical rank of head logits (min-max over heads, windows)',
              lambda r: f"{r['numerical_rank_min']}-{r['numerical_rank_max']}",
          ),
          (
              '99%-energy rank (mean, max)',
              lambda r: f"{r['energy99_rank_mean']:.1f}, {r['energy99_rank_max']}",
          ),
      ],
  )
  m = results['machine']
  slugs = [p.replace(', ', '_').replace(' ', '_') for p in PROBLEMS]
  return '\n'.join(
      [
          f"Command: `{results['command']}`; {results['seeds']} seeds, {results['steps']} Adam "
          f"steps per fit from each of two starts; {results['wall_time_s'] / 60:.1f} min wall, "
          f"{results['cpu_time_s'] / 60:.1f} CPU-min (training the source model: "
          f"{results['source_train_s'] / 60:.1f} min of training steps, not counted), on {m['cpu']} "
          f"({m.get('cpus_available', '?')} CPUs, shared), jax {m.get('jax', '?')}.",
          '',
          'Mean row-wise KL (nats) over seeds of the better of the two fits (random start, SVD '
          'start), and the largest numerical rank of the fitted logits:',
          '',
          table,
          ' '.join(f'![{p}](expressivity_{s}.png)' for p, s in zip(PROBLEMS, slugs)),
          '',
          'Numerical rank of the inputs X (min-max over seeds; real X with sharp targets come '
          "from the last layer, with real targets from the head's own layer):",
          '',
          input_table,
          f"Numerical rank of the trained model's head logits (source: `{results['source']}`, "
          f"step {results['source_step']}, validation bits/char {results['source_bpc']:.3f}):",
          '',
          ranks,
      ]
  )


def main(argv=None):
  parser = runner.arg_parser(__doc__, 'bottleneck_expressivity')
  parser.add_argument('--seeds', type=int, default=3, help='problems per kind, n and d')
  parser.add_argument('--steps', type=int, default=1500, help='Adam steps per fit')
  parser.add_argument(
      '--lengths', default=','.join(map(str, LENGTHS)), help='sequence lengths n, comma-separated'
  )
  parser.add_argument(
      '--out_dir', default=str(HERE), help='where results.json, the plots and the README section go'
  )
  args = parser.parse_args(argv)
  out_dir = pathlib.Path(args.out_dir)
  if args.plot_only:
    results = json.loads((out_dir / 'expressivity.json').read_text())
  else:
    lengths = [int(n) for n in args.lengths.split(',')]
    runs_dir = pathlib.Path(args.runs_dir)
    rundir = train_source(runs_dir)
    start, cpu_start = time.time(), time.process_time()
    model, tokenizer, _ = load_model(rundir)
    rng = np.random.default_rng(0)
    windows = validation_windows(
        rundir, tokenizer, max(lengths), max(RANK_WINDOWS, args.seeds), rng
    )
    done = json.loads((rundir / runner.DONE_FILE).read_text())
    results = {
        'command': ' '.join(['python -m experiments.bottleneck.expressivity', *(argv or [])]),
        'machine': runner.machine(),
        'seeds': args.seeds,
        'steps': args.steps,
        'source': SOURCE_RUN,
        'source_step': max(m['step'] for m in done['metrics']),
        'source_bpc': done['result']['bits_per_char'],
        'source_train_s': max(m.get('train_secs', 0.0) for m in done['metrics']),
        'fits': run_fits(
            model, windows, seeds=args.seeds, steps=args.steps, lengths=lengths, rng=rng
        ),
        'trained_ranks': trained_ranks(model, windows[:RANK_WINDOWS]),
    }
    results['wall_time_s'] = time.time() - start
    results['cpu_time_s'] = time.process_time() - cpu_start
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(out_dir / 'expressivity.json', json.dumps(results, indent=1))
  runner.write_section(out_dir / 'README.md', 'expressivity', report(results, out_dir))
  return results


if __name__ == '__main__':
  main(sys.argv[1:])
