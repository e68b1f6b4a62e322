"""The sharded set-up (`train.setup`, `compile_steps`): on 8 CPU devices, data-, FSDP- and
tensor-parallel training matches one device; gradient accumulation; bfloat16 compute."""

import jax
import numpy as np
import pytest

from lowrank_attn import train

MESHES = {
    'data': {'data': 8, 'fsdp': 1, 'tensor': 1},
    'fsdp': {'data': 1, 'fsdp': 8, 'tensor': 1},
    'tensor': {'data': 4, 'fsdp': 1, 'tensor': 2},
    'all': {'data': 2, 'fsdp': 2, 'tensor': 2},
}
VOCAB, LENGTH, BATCH = 64, 16, 16


def batch(task, seed):
  r = np.random.RandomState(seed)
  x = r.randint(3, VOCAB, (BATCH, LENGTH)).astype(np.int32)
  y = r.randint(3, VOCAB, (BATCH, LENGTH)).astype(np.int32)
  weights = np.ones((BATCH, LENGTH), np.float32)
  weights[:, -3:] = 0
  if task == 'nmt':
    x[:, -2:] = 0
    y[:, -3:] = 0
    return {'inputs': x, 'targets': y, 'weights': weights}
  segments = (weights > 0).astype(np.int32)
  positions = np.tile(np.arange(LENGTH, dtype=np.int32), (BATCH, 1))
  rows = {'inputs': x, 'segment_ids': segments, 'positions': positions}
  if task == 'mlm':  # 4 predicted positions per row and an unused slot (tasks/mlm.py)
    masked = np.tile(np.array([1, 4, 6, 11, 0], np.int32), (BATCH, 1))
    slot_weights = np.array([[1, 1, 1, 1, 0]] * BATCH, np.float32)
    return {**rows, 'masked_positions': masked, 'targets': y[:, :5], 'weights': slot_weights}
  return {**rows, 'targets': y, 'weights': weights}


def run(helpers, task, mesh, devices, steps=3, with_eval=False, **extra):
  config = helpers.load_config(task, 'tiny')
  helpers.override(
      config,
      {
          **helpers.small_model,
          'data.max_length': LENGTH,
          'model.dropout_rate': 0.1,
          'lr_schedule': 'constant',
          'warmup_steps': 0,
          'learning_rate': 1e-2,
          'per_device_batch_size': BATCH // len(devices),
          **extra,
      },
  )
  for field in ('num_encoder_layers', 'num_decoder_layers'):
    if field in config.model:
      config.model[field] = 1  # the layout, not the depth, is under test
  for axis, size in mesh.items():
    config.mesh[axis] = size
  s = train.setup(config, vocab_size=VOCAB, bos_id=1, devices=devices)
  state = train.create_state(s)
  step_fn, eval_fn = train.compile_steps(s, batch(task, 0), batch(task, 0))
  losses = []
  for i in range(steps):
    global_batch = s.global_batch(batch(task, i))
    state, metrics = step_fn(state, global_batch, jax.random.key(1))
    losses.append(float(metrics['loss']))
  if with_eval:
    losses.append(float(eval_fn(state['params'], global_batch)['nll']))
  return losses, state


@pytest.mark.parametrize(
    'task,meshes',
    [
        ('lm', tuple(MESHES)),
        # Every parallelism at once; each alone is covered by lm (and by the slow run below).
        ('mlm', ('all',)),
        ('nmt', ('all',)),
        pytest.param('mlm', tuple(MESHES), marks=pytest.mark.slow),
        pytest.param('nmt', tuple(MESHES), marks=pytest.mark.slow),
    ],
)
def test_parallel_losses_match_one_device(task, meshes, helpers):
  one = {'data': 1, 'fsdp': 1, 'tensor': 1}
  reference, _ = run(helpers, task, one, jax.devices()[:1], with_eval=True)
  assert len(jax.devices()) == 8
  for name in meshes:
    mesh = MESHES[name]
    losses, state = run(helpers, task, mesh, jax.devices(), with_eval=name == 'all')
    # Same dropout masks (partitionable threefry) and same math: float32 round-off only.
    np.testing.assert_allclose(
        losses, reference[: len(losses)], rtol=2e-5, err_msg=f'{task} on {name} mesh'
    )
    assert int(state['step']) == 3


def test_gradient_accumulation_equals_one_big_batch(helpers):
  one = {'data': 1, 'fsdp': 1, 'tensor': 1}
  # Without dropout the two micro-batches see exactly the rows of the full batch.
  full, _ = run(helpers, 'lm', one, jax.devices()[:1], **{'model.dropout_rate': 0.0})
  accumulated, _ = run(
      helpers,
      'lm',
      MESHES['all'],
      jax.devices(),
      **{'model.dropout_rate': 0.0, 'grad_accum_steps': 2, 'per_device_batch_size': 1},
  )
  np.testing.assert_allclose(accumulated, full, rtol=2e-5)


def test_bfloat16_compute_with_float32_parameters(helpers):
  losses, state = run(helpers, 'lm', MESHES['fsdp'], jax.devices(), **{'model.dtype': 'bfloat16'})
  assert all(np.isfinite(losses))
  assert losses[2] < losses[0]
  assert {x.dtype for x in jax.tree.leaves(state['params'])} == {np.dtype('float32')}
  # Same initial model as float32 (the first loss only differs by bf16 round-off).
  assert abs(losses[0] - np.log(VOCAB)) < 1.0
