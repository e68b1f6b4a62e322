"""Attention layer speed: every kind next to `flax.nnx.MultiHeadAttention`, timed in one run.

    .venv/bin/python benchmarks/attention.py                 # the table in the README
    .venv/bin/python benchmarks/attention.py --quick         # two small shapes
    .venv/bin/python benchmarks/attention.py --out results.md
    .venv/bin/python benchmarks/attention.py --long --out benchmarks/results/attention_long.md

For each shape (batch, length, D, heads) it times the jitted forward pass and forward+backward
(gradients w.r.t. parameters and inputs) of a causal self-attention layer, as the median of
interleaved repetitions (flax, then each of ours, then flax again ...), so background load
hits all alike. It prints each time, the ratio to flax's time, and the kind's analytic FLOP
ratio to concat: a kind is as efficient as concat when its time ratio to concat is at most its
FLOP ratio. Our layers run their default `implementation='auto'`; the table names what it
resolved to for each shape (on CPU 'xla' below 512 keys, 'blockwise' from there).

`--long` times forward+backward for lengths 512 ... 8192 at a fixed batch and width: flax's
layer and our materialising concat ('xla') against every kind in O(length) memory
(`implementation='blockwise'`), with each program's peak temporary memory as XLA's compiler
reports it (`compiled.memory_analysis().temp_size_in_bytes`, the buffers besides arguments and
outputs). A program whose temporaries exceed --max_temp_gb is compiled and reported but not run.
"""

import argparse
import dataclasses
import os
import platform
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import flax
from flax import nnx

from lowrank_attn import attention
from lowrank_attn.attention import dispatch
from lowrank_attn.attention.spec import DEFAULT_BLOCK_SIZE
from lowrank_attn.nn import MultiHeadAttention

SHAPES = [  # (batch, length, D, heads)
    (8, 128, 256, 4),
    (8, 256, 512, 8),
    (8, 512, 512, 8),
    (8, 1024, 1024, 16),
]
QUICK_SHAPES = [(8, 128, 256, 4), (8, 256, 512, 8)]


def kinds(D: int, h: int) -> dict[str, dict]:
  """Our layer settings to time, by label."""
  return {
      'concat': dict(),
      # Bhojanapalli et al. lift the bottleneck with head size ~ length; we time twice D/h.
      f'fixed_head d={2 * D // h}': dict(kind='fixed_head', head_dim=2 * D // h),
      # Cordonnier et al.: key width can drop 4x without loss.
      f'collaborative Dk={D // 4}': dict(kind='collaborative', key_dim=D // 4),
      f'collaborative Dk={D}': dict(kind='collaborative', key_dim=D),
      'talking_heads': dict(kind='talking_heads'),
      'concat + gates': dict(gated=True, deterministic=False),
  }


LONG_LENGTHS = (512, 1024, 2048, 4096, 8192)
LONG_BATCH, LONG_D, LONG_HEADS = 2, 512, 8  # head_dim 64; flax needs 4.1 GB at L = 4096


def long_kinds(D: int, h: int, cudnn: bool = False, pallas: bool = False) -> dict[str, dict]:
  """Layer settings of the --long table (blockwise unless the label names another
  implementation), by label. `cudnn`: add the kinds cuDNN computes (GPU, 16-bit dtypes);
  `pallas`: those our Pallas kernel computes (GPU)."""
  settings = {
      'concat (xla)': dict(implementation='xla'),
      'concat': dict(),
      f'grouped-query kv={h // 4}': dict(num_kv_heads=h // 4),
      f'fixed_head d={2 * D // h}': dict(kind='fixed_head', head_dim=2 * D // h),
      f'collaborative Dk={D // 4}': dict(kind='collaborative', key_dim=D // 4),
      f'collaborative Dk={D}': dict(kind='collaborative', key_dim=D),
      'talking_heads': dict(kind='talking_heads'),
      'concat + gates': dict(gated=True, deterministic=False),
  }
  if cudnn:
    settings |= {
        'concat (cudnn)': dict(implementation='cudnn'),
        f'grouped-query kv={h // 4} (cudnn)': dict(num_kv_heads=h // 4, implementation='cudnn'),
        f'fixed_head d={2 * D // h} (cudnn)': dict(
            kind='fixed_head', head_dim=2 * D // h, implementation='cudnn'
        ),
        # Shared key broadcast to every head, content bias as h key columns (<= 256 wide).
        f'collaborative Dk={D // 4} (cudnn)': dict(
            kind='collaborative', key_dim=D // 4, implementation='cudnn'
        ),
    }
  if pallas:
    settings |= {
        'concat (pallas)': dict(implementation='pallas'),
        f'collaborative Dk={D // 4} (pallas)': dict(
            kind='collaborative', key_dim=D // 4, implementation='pallas'
        ),
        f'collaborative Dk={D} (pallas)': dict(
            kind='collaborative', key_dim=D, implementation='pallas'
        ),
    }
  return settings


def cudnn_attention_fn(query, key, value, bias=None, mask=None, **unused):
  """flax.nnx.MultiHeadAttention's `attention_fn` as cuDNN's fused attention (no dropout)."""
  del unused
  return jax.nn.dot_product_attention(
      query, key, value, bias=bias, mask=mask, implementation='cudnn'
  )


def uses_cudnn(dtype) -> bool:
  return jax.default_backend() == 'gpu' and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)


@dataclasses.dataclass
class Timed:
  forward: list[float] = dataclasses.field(default_factory=list)
  train: list[float] = dataclasses.field(default_factory=list)


def compile_layer(layer, x):
  """Jitted forward and forward+backward (grads of params and inputs) of a layer."""
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

  def loss(params, x, rng):
    model = nnx.merge(graphdef, params, rest)
    out = model(x, is_causal=True, rngs=nnx.Rngs(dropout=rng))
    return jnp.mean(jnp.square(out.astype(jnp.float32)))

  forward = jax.jit(loss)
  train = jax.jit(jax.grad(loss, argnums=(0, 1)))
  rng = jax.random.key(0)
  jax.block_until_ready(forward(params, x, rng))
  jax.block_until_ready(train(params, x, rng))
  return (lambda: forward(params, x, rng)), (lambda: train(params, x, rng))


def resolved_implementation(layer, batch: int, length: int, dtype) -> str:
  """What our layer runs for this benchmark's call (causal self-attention: no mask, cache or
  dropout), 'auto' resolved as the layer resolves it."""
  if layer.spec.implementation != 'auto':
    return layer.spec.implementation
  return dispatch.choose_implementation(
      layer.spec, q_length=length, kv_length=length, batch=batch, dtype=dtype
  )


CLOCKS = {'wall': time.perf_counter, 'cpu': time.process_time}
clock = CLOCKS['wall']


def time_once(fn) -> float:
  start = clock()
  jax.block_until_ready(fn())
  return clock() - start


def bench_shape(batch, length, D, h, repeats, dtype, only=None):
  x = jax.random.normal(jax.random.key(1), (batch, length, D), dtype)
  layers = {'flax.nnx': nnx.MultiHeadAttention(h, D, decode=False, dtype=dtype, rngs=nnx.Rngs(0))}
  specs = {}
  for label, options in kinds(D, h).items():
    if only and label != 'concat' and not any(o in label for o in only):
      continue
    layers[label] = MultiHeadAttention(h, D, dtype=dtype, rngs=nnx.Rngs(0), **options)
    specs[label] = layers[label].spec
  compiled = {label: compile_layer(layer, x) for label, layer in layers.items()}
  timed = {label: Timed() for label in layers}
  for _ in range(repeats):  # interleaved, so drifting background load hits all labels alike
    for label, (forward, train) in compiled.items():
      timed[label].forward.append(time_once(forward))
      timed[label].train.append(time_once(train))
  median = {
      label: (statistics.median(t.forward), statistics.median(t.train))
      for label, t in timed.items()
  }
  concat_flops = specs['concat'].flops(batch, length)
  rows = []
  for label, (fwd, train) in median.items():
    flop_ratio = specs[label].flops(batch, length) / concat_flops if label in specs else None
    rows.append(
        dict(
            label=label,
            implementation=resolved_implementation(layers[label], batch, length, dtype)
            if label in specs
            else 'xla',  # flax's layer materialises the weights
            forward_ms=1e3 * fwd,
            train_ms=1e3 * train,
            forward_vs_flax=fwd / median['flax.nnx'][0],
            train_vs_flax=train / median['flax.nnx'][1],
            train_vs_concat=train / median['concat'][1],
            flop_ratio=flop_ratio,
            train_gflops=3 * specs[label].flops(batch, length) / train / 1e9
            if label in specs
            else 3 * concat_flops / train / 1e9,
        )
    )
  return rows


def compile_kernel(layer, x, implementation, block_size):
  """Jitted forward+backward of our layer's kernel with the given implementation, and the
  compiled program's temporary bytes."""
  spec, params = layer.spec, layer.kernel_params()
  deterministic = not spec.gated

  def loss(params, x, rng):
    out = attention.multi_head_attention(
        params,
        x,
        spec=spec,
        is_causal=True,
        rng=rng,
        deterministic=deterministic,
        implementation=implementation,
        block_size=block_size,
        dtype=x.dtype,
    ).out
    return jnp.mean(jnp.square(out.astype(jnp.float32)))

  args = (params, x, jax.random.key(0))
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile()
  return (lambda: compiled(*args)), compiled.memory_analysis().temp_size_in_bytes


def compile_flax(layer, x):
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

  def loss(params, x):
    out = nnx.merge(graphdef, params, rest)(x, is_causal=True)
    return jnp.mean(jnp.square(out.astype(jnp.float32)))

  compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile()
  return (lambda: compiled(params, x)), compiled.memory_analysis().temp_size_in_bytes


def causal_flops(spec, batch, length):
  """Forward matmul FLOPs of causal attention: only the L(L+1)/2 visible pairs count."""
  full, no_pairs = spec.flops(batch, length), spec.flops(batch, length, 0)
  return no_pairs + (full - no_pairs) * (length + 1) / (2 * length)


def bench_long(length, args, dtype):
  batch, D, h = args.long_batch, args.long_dim, args.long_heads
  x = jax.random.normal(jax.random.key(1), (batch, length, D), dtype)
  programs, specs, failed = {}, {}, {}
  programs['flax.nnx'] = compile_flax(
      nnx.MultiHeadAttention(h, D, decode=False, dtype=dtype, rngs=nnx.Rngs(0)), x
  )
  if uses_cudnn(dtype):  # the peer at its best on a GPU: flax's layer calling cuDNN
    programs['flax.nnx (cudnn)'] = compile_flax(
        nnx.MultiHeadAttention(
            h, D, decode=False, dtype=dtype, rngs=nnx.Rngs(0), attention_fn=cudnn_attention_fn
        ),
        x,
    )
  for label, options in long_kinds(
      D, h, cudnn=uses_cudnn(dtype), pallas=jax.default_backend() == 'gpu'
  ).items():
    options = dict(options)
    implementation = options.pop('implementation', 'blockwise')
    layer = MultiHeadAttention(h, D, dtype=dtype, rngs=nnx.Rngs(0), **options)
    specs[label] = layer.spec
    try:  # one kernel that fails to compile or run costs its row, not the table
      programs[label] = compile_kernel(layer, x, implementation, args.block_size)
    except Exception as error:  # pylint: disable=broad-except
      failed[label] = report_failure(label, length, error)
  runnable = {
      label: fn for label, (fn, temp) in programs.items() if temp <= args.max_temp_gb * 2**30
  }
  for label, fn in list(runnable.items()):
    try:
      jax.block_until_ready(fn())  # warm up
    except Exception as error:  # pylint: disable=broad-except
      failed[label] = report_failure(label, length, error)
      del runnable[label]
  times = {label: [] for label in runnable}
  for _ in range(args.repeats):  # interleaved, so drifting background load hits all alike
    for label, fn in runnable.items():
      times[label].append(time_once(fn))
  median = {label: statistics.median(t) for label, t in times.items()}
  concat_flops = causal_flops(specs['concat'], batch, length)
  rows = []
  for label, (_, temp) in programs.items():
    flops = causal_flops(specs[label], batch, length) if label in specs else concat_flops
    row = dict(
        label=label,
        temp_mb=temp / 2**20,
        train_ms=None,
        vs_flax=None,
        vs_concat=None,
        flop_ratio=flops / concat_flops if label in specs else None,
        gflops=None,
    )
    if label in median:
      t = median[label]
      row.update(
          train_ms=1e3 * t,
          gflops=3 * flops / t / 1e9,
          vs_flax=t / median['flax.nnx'] if 'flax.nnx' in median else None,
          vs_concat=t / median['concat'] if 'concat' in median else None,
      )
    rows.append(row)
  for label, message in failed.items():
    rows.append(
        dict(
            label=label,
            temp_mb=None,
            train_ms=None,
            vs_flax=None,
            vs_concat=None,
            flop_ratio=None,
            gflops=None,
            failed=message,
        )
    )
  return rows


def report_failure(label, length, error) -> str:
  """Prints the traceback to stderr; returns the row's note ('failed: <error type>')."""
  print(f'{label} at L = {length} failed:', file=sys.stderr)
  traceback.print_exception(error, file=sys.stderr)
  return f'failed: {type(error).__name__}'


def main_long(args, dtype):
  fmt = lambda value, spec: '' if value is None else format(value, spec)
  lines = [
      f'Long sequences: causal self-attention forward+backward (gradients w.r.t. parameters '
      f'and inputs), batch {args.long_batch}, D = {args.long_dim}, {args.long_heads} heads, '
      f'{args.dtype}, {args.clock} time, median of {args.repeats} interleaved repetitions. '
      f"Ours: implementation='blockwise', block_size={args.block_size}, except where the "
      f"label names 'xla' (materialising), 'cudnn' (cuDNN's fused kernel, GPU) or 'pallas' "
      '(our Pallas flash kernel, GPU). Temp MB: '
      "XLA's compile-time temporary memory of the program "
      f'(memory_analysis); programs above {args.max_temp_gb} GB are not run. FLOPs / concat '
      'counts only visible (causal) token pairs; GFLOP/s = 3 x forward matmul FLOPs / time.',
      f'Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, '
      f'devices {jax.devices()} ({jax.devices()[0].device_kind}); jax {jax.__version__}, '
      f'flax {flax.__version__}.',
      'Command: ' + ' '.join([os.path.basename(sys.executable), *sys.argv]),
      '',
      '| length | layer | fwd+bwd ms | / flax | / concat | FLOPs / concat | temp MB | GFLOP/s |',
      '|---|---|---|---|---|---|---|---|',
  ]
  print('\n'.join(lines), flush=True)
  for length in args.lengths:
    for row in bench_long(length, args, dtype):
      line = (
          f"| {length} | {row['label']} | "
          f"{row.get('failed') or fmt(row['train_ms'], '.0f') or 'not run'} | "
          f"{fmt(row['vs_flax'], '.2f')} | {fmt(row['vs_concat'], '.2f')} | "
          f"{fmt(row['flop_ratio'], '.2f')} | {fmt(row['temp_mb'], '.0f')} | "
          f"{fmt(row['gflops'], '.0f')} |"
      )
      lines.append(line)
      print(line, flush=True)
  return lines


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--quick', action='store_true', help='two small shapes only')
  parser.add_argument('--repeats', type=int, default=7)
  parser.add_argument('--dtype', default='float32', choices=['float32', 'bfloat16'])
  parser.add_argument('--out', help='also write the markdown table to this file')
  parser.add_argument(
      '--clock',
      default='wall',
      choices=CLOCKS,
      help="'cpu' sums the CPU time of all threads: steadier on a loaded machine",
  )
  parser.add_argument(
      '--only', help='comma-separated layer labels to time (flax and concat ' 'are always timed)'
  )
  parser.add_argument(
      '--long',
      action='store_true',
      help='forward+backward and memory at lengths 512 ... 8192 (see above)',
  )
  parser.add_argument(
      '--lengths',
      type=lambda s: [int(v) for v in s.split(',')],
      default=list(LONG_LENGTHS),
      help='--long: comma-separated lengths',
  )
  parser.add_argument('--long_batch', type=int, default=LONG_BATCH)
  parser.add_argument('--long_dim', type=int, default=LONG_D)
  parser.add_argument('--long_heads', type=int, default=LONG_HEADS)
  parser.add_argument('--block_size', type=int, default=DEFAULT_BLOCK_SIZE)
  parser.add_argument(
      '--max_temp_gb',
      type=float,
      default=6.0,
      help='--long: do not run programs needing more temporary memory',
  )
  args = parser.parse_args(argv)
  global clock
  clock = CLOCKS[args.clock]
  dtype = jnp.dtype(args.dtype)
  if args.long:
    lines = main_long(args, dtype)
    if args.out:
      with open(args.out, 'w') as f:
        f.write('\n'.join(lines) + '\n')
    return
  lines = [
      f'Attention layers, causal self-attention, {args.dtype}, {args.clock} time, median of '
      f'{args.repeats} interleaved repetitions.',
      f'Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, '
      f'devices {jax.devices()} ({jax.devices()[0].device_kind}); jax {jax.__version__}, '
      f'flax {flax.__version__}.',
      'Command: ' + ' '.join([os.path.basename(sys.executable), *sys.argv]),
      '',
      '| batch, length, D, heads | layer | implementation | forward ms | fwd / flax | fwd+bwd ms '
      '| fwd+bwd / flax | fwd+bwd / concat | FLOPs / concat | GFLOP/s (fwd+bwd) |',
      '|---|---|---|---|---|---|---|---|---|---|',
  ]
  print('\n'.join(lines), flush=True)
  for batch, length, D, h in (QUICK_SHAPES if args.quick else SHAPES):
    only = args.only.split(',') if args.only else None
    for row in bench_shape(batch, length, D, h, args.repeats, dtype, only):
      flop_ratio = '' if row['flop_ratio'] is None else f"{row['flop_ratio']:.2f}"
      line = (
          f"| {batch}, {length}, {D}, {h} | {row['label']} | {row['implementation']} | "
          f"{row['forward_ms']:.1f} | "
          f"{row['forward_vs_flax']:.2f} | {row['train_ms']:.1f} | {row['train_vs_flax']:.2f} | "
          f"{row['train_vs_concat']:.2f} | {flop_ratio} | {row['train_gflops']:.0f} |"
      )
      lines.append(line)
      print(line, flush=True)
  if args.out:
    with open(args.out, 'w') as f:
      f.write('\n'.join(lines) + '\n')


if __name__ == '__main__':
  main()
