"""Training-step speed: our decoder LM and the same model built from `flax.nnx` blocks.

    .venv/bin/python benchmarks/train_step.py                # 6 layers, D=512, 8 heads, L=128
    .venv/bin/python benchmarks/train_step.py --quick        # fewer repetitions
    .venv/bin/python benchmarks/train_step.py --batch 32 --vocab 32000

Both models have the same sizes, pre-LayerNorm blocks, untied output layer, AdamW with
gradient clipping, and no dropout. Ours is timed through the real training path
(`lowrank_attn.train.setup` / `compile_steps`: sharded init, jit with in/out shardings
and donation, one-device mesh); the baseline is `nnx.Embed` + `nnx.MultiHeadAttention` +
`nnx.Linear` + `nnx.LayerNorm` with a hand-written step of the same math. Steps alternate
(ours, flax, ours, ...) so background load hits both alike; the median step time is reported.

MFU = (3 x forward matmul FLOPs of the model, from the layers' analytic counts) / step time /
peak, where the peak is the float32 matmul FLOP/s measured at the start of the same run.
"""

import argparse
import platform
import statistics
import time

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowrank_attn import sharding, train
from lowrank_attn.train import config as config_lib, metrics


def our_config(args):
  config = config_lib.base_config('lm')
  config.model.emb_dim = args.dim
  config.model.mlp_dim = 4 * args.dim
  config.model.attention.num_heads = args.heads
  config.model.num_decoder_layers = args.layers
  config.model.max_length = args.length
  config.model.dropout_rate = 0.0
  config.model.tie_embeddings = False
  config.data.max_length = args.length
  config.per_device_batch_size = args.batch
  config.mesh.data = 1
  config.weight_decay = 0.1
  return config


class FlaxBlock(nnx.Module):
  def __init__(self, d, heads, rngs):
    self.norm1 = nnx.LayerNorm(d, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(heads, d, decode=False, rngs=rngs)
    self.norm2 = nnx.LayerNorm(d, rngs=rngs)
    self.wi = nnx.Linear(d, 4 * d, rngs=rngs)
    self.wo = nnx.Linear(4 * d, d, rngs=rngs)

  def __call__(self, x, mask):
    x = x + self.attention(self.norm1(x), mask=mask)
    return x + self.wo(jax.nn.gelu(self.wi(self.norm2(x))))


class FlaxLM(nnx.Module):
  """The same decoder LM from flax.nnx building blocks."""

  def __init__(self, vocab, d, heads, layers, length, rngs):
    self.embed = nnx.Embed(vocab, d, rngs=rngs)
    self.positions = nnx.Param(jax.random.normal(rngs.params(), (length, d)) * 0.02)
    self.blocks = nnx.List([FlaxBlock(d, heads, rngs) for _ in range(layers)])
    self.norm = nnx.LayerNorm(d, rngs=rngs)
    self.out = nnx.Linear(d, vocab, use_bias=False, rngs=rngs)

  def __call__(self, tokens, segments):
    x = self.embed(tokens) * jnp.sqrt(self.embed.features)
    x = x + self.positions[...][None, :tokens.shape[1]]
    mask = nnx.combine_masks(nnx.make_causal_mask(tokens),
                             nnx.make_attention_mask(segments, segments, jnp.equal))
    for block in self.blocks:
      x = block(x, mask)
    return self.out(self.norm(x))


def flax_step_fn(graphdef, tx):
  def step(state, batch):
    def loss_fn(params):
      logits = nnx.merge(graphdef, params)(batch['inputs'], batch['segment_ids'])
      sums = train.cross_entropy(logits, batch['targets'], batch['weights'])
      return sums['nll'] / jnp.maximum(sums['weight'], 1.0)
    loss, grads = jax.value_and_grad(loss_fn)(state['params'])
    updates, opt_state = tx.update(grads, state['opt_state'], state['params'])
    return {'params': optax.apply_updates(state['params'], updates),
            'opt_state': opt_state}, loss
  return jax.jit(step, donate_argnums=0)


def make_batch(args):
  r = np.random.RandomState(0)
  shape = (args.batch, args.length)
  tokens = r.randint(3, args.vocab, shape).astype(np.int32)
  return {'inputs': tokens, 'targets': np.roll(tokens, -1, axis=1),
          'weights': np.ones(shape, np.float32), 'segment_ids': np.ones(shape, np.int32),
          'positions': np.tile(np.arange(args.length, dtype=np.int32), (args.batch, 1))}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--layers', type=int, default=6)
  parser.add_argument('--dim', type=int, default=512)
  parser.add_argument('--heads', type=int, default=8)
  parser.add_argument('--length', type=int, default=128)
  parser.add_argument('--batch', type=int, default=16)
  parser.add_argument('--vocab', type=int, default=8192)
  parser.add_argument('--repeats', type=int, default=20)
  parser.add_argument('--quick', action='store_true', help='5 repetitions')
  args = parser.parse_args()
  repeats = 5 if args.quick else args.repeats

  devices = jax.devices()[:1]
  peak = metrics.measure_peak_flops_per_device(jnp.float32, size=2048) * len(devices)
  batch = make_batch(args)

  # Ours, through the training loop's own setup.
  config = our_config(args)
  s = train.setup(config, vocab_size=args.vocab, bos_id=1, devices=devices)
  ours_state = train.create_state(s)
  ours_step, _ = train.compile_steps(s, batch)
  ours_batch = s.global_batch(batch)
  key = jax.random.key(0)
  run_ours = ours_step
  flops = 3 * s.flops({k: v.shape for k, v in batch.items()})

  # The flax baseline, same optimizer.
  model = FlaxLM(args.vocab, args.dim, args.heads, args.layers, args.length, nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  flax_state = {'params': params, 'opt_state': s.tx.init(params)}
  flax_step = flax_step_fn(graphdef, s.tx)
  flax_batch = jax.device_put(batch, devices[0])
  ours_params = sharding.tree_size(ours_state['params'])
  flax_params = sharding.tree_size(params)

  times = {'ours': [], 'flax': []}
  ours_state, m = run_ours(ours_state, ours_batch, key)  # compile
  jax.block_until_ready(m)
  flax_state, loss = flax_step(flax_state, flax_batch)
  jax.block_until_ready(loss)
  for _ in range(repeats):
    start = time.perf_counter()
    ours_state, m = run_ours(ours_state, ours_batch, key)
    jax.block_until_ready(m)
    times['ours'].append(time.perf_counter() - start)
    start = time.perf_counter()
    flax_state, loss = flax_step(flax_state, flax_batch)
    jax.block_until_ready(loss)
    times['flax'].append(time.perf_counter() - start)

  tokens = args.batch * args.length
  print(f'{platform.processor() or platform.machine()}, {jax.devices()[0].device_kind}, '
        f'jax {jax.__version__}; {args.layers} layers, D={args.dim}, {args.heads} heads, '
        f'L={args.length}, batch {args.batch}, vocab {args.vocab}, float32')
  print(f'measured matmul peak: {peak / 1e9:.0f} GFLOP/s; training step: '
        f'{flops / 1e9:.1f} GFLOP (3x forward matmuls)')
  print(f'parameters: ours {ours_params:,}, flax {flax_params:,}')
  print(f'{"model":8} {"step ms":>8} {"tokens/s":>10} {"MFU":>6}')
  medians = {}
  for name, values in times.items():
    medians[name] = statistics.median(values)
    print(f'{name:8} {1e3 * medians[name]:8.1f} {tokens / medians[name]:10,.0f} '
          f'{100 * flops / medians[name] / peak:5.1f}%')
  print(f'ours / flax throughput: {medians["flax"] / medians["ours"]:.2f}x '
        f'(> 1: ours faster); median of {repeats} interleaved steps each')


if __name__ == '__main__':
  main()
