"""The benchmarks run: the training step against flax with our optimizer, and the attention
table names the implementation each row ran."""

import argparse

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import train_step
from lowrank_attn import train

TINY = ['--layers=1', '--dim=32', '--heads=2', '--length=16', '--batch=2', '--vocab=50']


def decay_per_step(tx, params):
  """(elements AdamW's weight decay moves, the fraction of itself each loses in a step). With
  zero gradients Adam's update is 0, so a step at a learning rate lr > 0 takes lr x decay of
  each decayed parameter and leaves the others; the parameters are drawn away from 0 first
  (biases start at 0, where decay cannot move them)."""
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(0), len(leaves))
  params = tree.unflatten(
      [1.0 + jax.random.uniform(k, x.shape, jnp.float32) for k, x in zip(keys, leaves)]
  )
  state = tx.init(params)
  zeros = jax.tree.map(jnp.zeros_like, params)
  updated, update = params, jax.jit(tx.update)
  for _ in range(2):  # the first step is at the warmup's learning rate 0
    updates, state = update(zeros, state, updated)
    updated = optax.apply_updates(updated, updates)
  before = np.concatenate([np.ravel(x) for x in jax.tree.leaves(params)])
  after = np.concatenate([np.ravel(x) for x in jax.tree.leaves(updated)])
  shrink = 1.0 - after / before
  moved = shrink != 0
  return int(moved.sum()), float(np.median(shrink[moved])), before.size


def test_the_flax_baseline_decays_the_same_parameters_as_ours_at_the_same_rate():
  args = argparse.Namespace(layers=1, dim=32, heads=2, length=16, batch=2, vocab=50)
  config = train_step.our_config(args)
  config.learning_rate, config.weight_decay, config.warmup_steps = 0.1, 0.5, 1
  s = train.setup(config, vocab_size=args.vocab, bos_id=1, devices=jax.devices()[:1])
  ours = train.create_state(s)['params']
  model = train_step.FlaxLM(args.vocab, args.dim, args.heads, args.layers, args.length, nnx.Rngs(0))
  _, flax_params = nnx.split(model, nnx.Param)

  ours_moved, ours_rate, ours_total = decay_per_step(s.tx, ours)
  flax_tx = train_step.flax_optimizer(config, s.schedule)
  flax_moved, flax_rate, flax_total = decay_per_step(flax_tx, flax_params)
  assert ours_total == flax_total
  assert 0 < ours_moved < ours_total  # biases and norms do not decay
  assert flax_moved == ours_moved
  # lr x decay = 0.05 of each decayed value; float32 rounds 1 - after / before to ~1e-6.
  np.testing.assert_allclose(ours_rate, 0.1 * 0.5, rtol=1e-4)
  np.testing.assert_allclose(flax_rate, ours_rate, rtol=1e-4)


def test_the_training_step_benchmark_times_ours_against_flax(capsys, tmp_path):
  out_file = tmp_path / 'train_step.md'
  train_step.main([*TINY, '--repeats=2', f'--out={out_file}'])
  printed = capsys.readouterr().out
  assert 'parameters: ours 1' in printed and 'ours / flax throughput:' in printed, printed
  written = out_file.read_text()
  assert written.startswith(f'Command: python benchmarks/train_step.py {" ".join(TINY)}')
  assert printed in written


def test_the_attention_benchmark_names_the_implementation_each_row_ran(monkeypatch):
  """The 'implementation' column against what the layer called: spies record each traced call
  of the materialising path (`kernels.logits`) and of every other (`dispatch.attend`, with its
  implementation). On CPU 'auto' materialises short rows and goes blockwise from 512 keys, so
  the two shapes must differ."""
  from benchmarks import attention as bench
  from lowrank_attn.attention import dispatch
  from lowrank_attn.attention import kernels

  ran = []
  attend, logits = dispatch.attend, kernels.logits

  def attend_spy(*args, implementation, **kwargs):
    ran.append(implementation)
    return attend(*args, implementation=implementation, **kwargs)

  def logits_spy(*args, **kwargs):
    ran.append('xla')
    return logits(*args, **kwargs)

  monkeypatch.setattr(dispatch, 'attend', attend_spy)
  monkeypatch.setattr(kernels, 'logits', logits_spy)
  named = {}
  for length in (16, 512):
    ran.clear()
    rows = bench.bench_shape(1, length, 16, 2, 1, jnp.float32, only=['fixed_head'])
    named[length] = {row['label']: row['implementation'] for row in rows}
    assert set(named[length]) == {'flax.nnx', 'concat', 'fixed_head d=16'}
    assert named[length]['flax.nnx'] == 'xla'
    assert ran and set(ran) == {named[length]['concat']} == {named[length]['fixed_head d=16']}
  assert named[16]['concat'] == 'xla' and named[512]['concat'] == 'blockwise'
