"""Training-step speed: our models and the same models built from `flax.nnx` blocks.

    .venv/bin/python benchmarks/train_step.py                # LM: 6 layers, D=512, 8 heads, L=128
    .venv/bin/python benchmarks/train_step.py --quick        # fewer repetitions
    .venv/bin/python benchmarks/train_step.py --batch 32 --vocab 32000
    .venv/bin/python benchmarks/train_step.py --nmt_config configs/nmt.py:multi30k
    .venv/bin/python benchmarks/train_step.py --out benchmarks/results/train_step.md  # also a file

`--nmt_config` times the encoder-decoder of a translation config at its own sizes and batch
(packed rows, four pairs per row, both sides full: real tokens = all tokens), against an
encoder-decoder of `nnx.MultiHeadAttention` blocks with the same masks, tied embeddings and
label smoothing.

Both models have the same sizes, pre-LayerNorm blocks, untied output layer, the same optimizer
(`train.setup`'s schedule, clipping and AdamW, decaying the same parameters: `flax_optimizer`),
and no dropout. Ours is timed through the real training path
(`lowrank_attn.train.setup` / `compile_steps`: sharded init, jit with in/out shardings
and donation, one-device mesh); the baseline is `nnx.Embed` + `nnx.MultiHeadAttention` +
`nnx.Linear` + `nnx.LayerNorm` with a hand-written step of the same math. Steps alternate
(ours, flax, ours, ...) so background load hits both alike; the median step time is reported.

MFU = (3 x forward matmul FLOPs of the model, from the layers' analytic counts) / step time /
peak, the peak of `metrics.peak_flops_per_device` (a TPU chip's or NVIDIA GPU's published bf16
peak), printed with its source and the achieved GFLOP/s, so the division can be redone with
another peak; on CPU (no published peak) the achieved GFLOP/s only. Both models compute in
float32 (config.model.dtype pinned: its default 'auto' would be bfloat16 on an accelerator).
"""

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

import flax
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowrank_attn import sharding, train
from lowrank_attn.train import config as config_lib, metrics, optim


def our_config(args):
  config = config_lib.base_config('lm')
  config.model.emb_dim = args.dim
  config.model.mlp_dim = 4 * args.dim
  config.model.attention.num_heads = args.heads
  config.model.num_decoder_layers = args.layers
  config.model.max_length = args.length
  config.model.dropout_rate = 0.0
  config.model.tie_embeddings = False
  config.model.dtype = 'float32'  # as the flax baseline
  config.data.max_length = args.length
  config.per_device_batch_size = args.batch
  config.mesh.data = 1
  config.weight_decay = 0.1
  return config


class FlaxBlock(nnx.Module):
  """Pre-LayerNorm block: self-attention, optionally cross-attention, then the MLP."""

  def __init__(self, d, heads, rngs, mlp=None, cross=False):
    self.norm1 = nnx.LayerNorm(d, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(heads, d, decode=False, rngs=rngs)
    if cross:
      self.cross_norm = nnx.LayerNorm(d, rngs=rngs)
      self.cross = nnx.MultiHeadAttention(heads, d, decode=False, rngs=rngs)
    self.norm2 = nnx.LayerNorm(d, rngs=rngs)
    self.wi = nnx.Linear(d, mlp or 4 * d, rngs=rngs)
    self.wo = nnx.Linear(mlp or 4 * d, d, rngs=rngs)

  def __call__(self, x, mask, encoded=None, cross_mask=None):
    x = x + self.attention(self.norm1(x), mask=mask)
    if encoded is not None:
      x = x + self.cross(self.cross_norm(x), encoded, mask=cross_mask)
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
    x = x + self.positions[...][None, : tokens.shape[1]]
    mask = nnx.combine_masks(
        nnx.make_causal_mask(tokens), nnx.make_attention_mask(segments, segments, jnp.equal)
    )
    for block in self.blocks:
      x = block(x, mask)
    return self.out(self.norm(x))


class FlaxEncoderDecoder(nnx.Module):
  """A pre-LayerNorm encoder-decoder from flax.nnx blocks, tied embeddings, packed rows."""

  def __init__(self, vocab, d, mlp, heads, layers, length, bos_id, rngs):
    self.bos_id = bos_id
    self.embed = nnx.Embed(vocab, d, rngs=rngs)
    self.positions = nnx.Param(jax.random.normal(rngs.params(), (length, d)) * 0.02)
    self.encoder = nnx.List([FlaxBlock(d, heads, rngs, mlp) for _ in range(layers)])
    self.encoder_norm = nnx.LayerNorm(d, rngs=rngs)
    self.decoder = nnx.List([FlaxBlock(d, heads, rngs, mlp, cross=True) for _ in range(layers)])
    self.decoder_norm = nnx.LayerNorm(d, rngs=rngs)

  def _embed(self, tokens, positions):
    x = self.embed(tokens) * jnp.sqrt(self.embed.features)
    return x + jnp.take(self.positions[...], positions, axis=0)

  def __call__(self, batch):
    src_seg, tgt_seg = batch['inputs_segment_ids'], batch['targets_segment_ids']
    x = self._embed(batch['inputs'], batch['inputs_positions'])
    mask = nnx.make_attention_mask(src_seg, src_seg, jnp.equal)
    for block in self.encoder:
      x = block(x, mask)
    encoded = self.encoder_norm(x)
    # Teacher forcing: targets shifted right, each packed segment starting from BOS.
    shifted = jnp.pad(batch['targets'], ((0, 0), (1, 0)))[:, :-1]
    shifted = jnp.where(batch['targets_positions'] == 0, self.bos_id, shifted)
    y = self._embed(shifted, batch['targets_positions'])
    self_mask = nnx.combine_masks(
        nnx.make_causal_mask(shifted), nnx.make_attention_mask(tgt_seg, tgt_seg, jnp.equal)
    )
    cross_mask = nnx.make_attention_mask(tgt_seg, src_seg, jnp.equal)
    for block in self.decoder:
      y = block(y, self_mask, encoded, cross_mask)
    return self.embed.attend(self.decoder_norm(y))


def flax_optimizer(config, schedule):
  """Our optimizer (`train.setup`'s: clipping, AdamW, the schedule) for the flax model's
  parameters, which have other names and no logical axes: its kernels, embedding and position
  table decay, as ours do (`optim.PARAMETER_ROLES`)."""
  decayed = ('kernel', 'embedding', 'positions')

  def decay_mask(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: str(getattr(path[-1], 'key', path[-1])) in decayed,
        params,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )

  return optim.config_optimizer(config, schedule, decay_mask=decay_mask)


def flax_step_fn(graphdef, tx, label_smoothing=0.0):
  def step(state, batch):
    def loss_fn(params):
      model = nnx.merge(graphdef, params)
      if 'inputs_segment_ids' in batch:
        logits = model(batch)
      else:
        logits = model(batch['inputs'], batch['segment_ids'])
      sums = train.cross_entropy(
          logits, batch['targets'], batch['weights'], label_smoothing=label_smoothing
      )
      return sums['nll'] / jnp.maximum(sums['weight'], 1.0)

    loss, grads = jax.value_and_grad(loss_fn)(state['params'])
    updates, opt_state = tx.update(grads, state['opt_state'], state['params'])
    return {'params': optax.apply_updates(state['params'], updates), 'opt_state': opt_state}, loss

  return jax.jit(step, donate_argnums=0)


def nmt_setup(args):
  """(config, flax model, batch) for `--nmt_config`: the config's sizes and batch shape."""
  config = config_lib.load(args.nmt_config)
  config.model.dropout_rate = 0.0  # both models without dropout: the same math
  config.model.dtype = 'float32'  # as the flax baseline
  config.mesh.data = 1
  m, rows, length = config.model, config.per_device_batch_size, config.data.max_length
  heads = m.attention.num_heads
  if m.num_encoder_layers != m.num_decoder_layers or not isinstance(heads, int):
    raise ValueError(
        '--nmt_config: the flax baseline needs equal encoder/decoder depth and ' 'one head count.'
    )
  vocab = config.data.vocab_size
  model = FlaxEncoderDecoder(
      vocab, m.emb_dim, m.mlp_dim, heads, m.num_encoder_layers, m.max_length, 1, nnx.Rngs(0)
  )
  r = np.random.RandomState(0)
  pairs = 4  # packed pairs per row; every token real
  segments = np.repeat(np.arange(1, pairs + 1, dtype=np.int32), length // pairs)
  positions = np.tile(np.arange(length // pairs, dtype=np.int32), pairs)
  batch = {
      'inputs': r.randint(3, vocab, (rows, length)).astype(np.int32),
      'targets': r.randint(3, vocab, (rows, length)).astype(np.int32),
      'weights': np.ones((rows, length), np.float32),
  }
  for side in ('inputs', 'targets'):
    batch[f'{side}_segment_ids'] = np.tile(segments, (rows, 1))
    batch[f'{side}_positions'] = np.tile(positions, (rows, 1))
  return config, model, batch, vocab


def make_batch(args):
  r = np.random.RandomState(0)
  shape = (args.batch, args.length)
  tokens = r.randint(3, args.vocab, shape).astype(np.int32)
  return {
      'inputs': tokens,
      'targets': np.roll(tokens, -1, axis=1),
      'weights': np.ones(shape, np.float32),
      'segment_ids': np.ones(shape, np.int32),
      'positions': np.tile(np.arange(args.length, dtype=np.int32), (args.batch, 1)),
  }


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--layers', type=int, default=6)
  parser.add_argument('--dim', type=int, default=512)
  parser.add_argument('--heads', type=int, default=8)
  parser.add_argument('--length', type=int, default=128)
  parser.add_argument('--batch', type=int, default=16)
  parser.add_argument('--vocab', type=int, default=8192)
  parser.add_argument('--repeats', type=int, default=20)
  parser.add_argument('--quick', action='store_true', help='5 repetitions')
  parser.add_argument('--out', help='also write the lines printed, with the command, to this file')
  parser.add_argument(
      '--nmt_config', default=None, help="a translation config, e.g. 'configs/nmt.py:multi30k'"
  )
  args = parser.parse_args(argv)
  repeats = 5 if args.quick else args.repeats

  devices = jax.devices()[:1]
  per_device_peak = metrics.peak_flops_per_device(jnp.float32, devices[0])
  peak = per_device_peak and per_device_peak * len(devices)  # None: no published peak
  if args.nmt_config:
    config, model, batch, vocab = nmt_setup(args)
  else:
    config, batch, vocab = our_config(args), make_batch(args), args.vocab
    model = FlaxLM(args.vocab, args.dim, args.heads, args.layers, args.length, nnx.Rngs(0))

  # Ours, through the training loop's own setup.
  s = train.setup(config, vocab_size=vocab, bos_id=1, devices=devices)
  ours_state = train.create_state(s)
  ours_step, _ = train.compile_steps(s, batch)
  ours_batch = s.global_batch(batch)
  key = jax.random.key(0)
  run_ours = ours_step
  flops = 3 * s.flops({k: v.shape for k, v in batch.items()})

  # The flax baseline, the same optimizer over its own parameter tree.
  graphdef, params = nnx.split(model, nnx.Param)
  flax_tx = flax_optimizer(config, s.schedule)
  # Committed to the device as the step's outputs will be: uncommitted inputs would make the
  # first timed step compile again.
  flax_state = jax.device_put({'params': params, 'opt_state': flax_tx.init(params)}, devices[0])
  flax_step = flax_step_fn(graphdef, flax_tx, config.label_smoothing)
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

  tokens = sum(
      int(np.sum(batch[k] != 0))
      for k in ('inputs', 'targets')
      if k in batch and (args.nmt_config or k == 'inputs')
  )
  m = config.model
  layers = (
      f'{m.num_encoder_layers}+{m.num_decoder_layers} layers'
      if args.nmt_config
      else f'{m.num_decoder_layers} layers'
  )
  lines = [
      f'{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, '
      f'{jax.devices()[0].device_kind}, jax {jax.__version__}, flax {flax.__version__}; '
      f'{args.nmt_config or "decoder LM"}: {layers}, D={m.emb_dim}, '
      f'{m.attention.num_heads} heads, batch {batch["inputs"].shape}, vocab {vocab}, float32',
      f'{metrics.describe_peak(per_device_peak)}; training step: '
      f'{flops / 1e9:.1f} GFLOP (3x forward matmuls)',
      f'parameters: ours {ours_params:,}, flax {flax_params:,}',
      f'{"model":8} {"step ms":>8} {"tokens/s":>10} {"GFLOP/s":>8} {"MFU":>6}',
  ]
  medians = {}
  for name, values in times.items():
    medians[name] = statistics.median(values)
    lines.append(
        f'{name:8} {1e3 * medians[name]:8.1f} {tokens / medians[name]:10,.0f} '
        f'{flops / medians[name] / 1e9:8.1f} '
        + (f'{100 * flops / medians[name] / peak:5.1f}%' if peak else '     -')
    )
  lines.append(
      f'ours / flax throughput: {medians["flax"] / medians["ours"]:.2f}x '
      f'(> 1: ours faster); median of {repeats} interleaved steps each'
  )
  print('\n'.join(lines))
  if args.out:
    command = ' '.join(
        ['python benchmarks/train_step.py', *(sys.argv[1:] if argv is None else argv)]
    )
    header = [f'Command: {command}', f'Date: {datetime.date.today()}', '', '```']
    with open(args.out, 'w') as f:
      f.write('\n'.join([*header, *lines, '```']) + '\n')


if __name__ == '__main__':
  main()
