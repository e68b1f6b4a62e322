"""Warm start (`config.init_from`) and freezing (`config.trainable`)."""

import shutil

import jax
import numpy as np
import pytest

from lowrank_attn import train
from lowrank_attn.train import checkpoints, state as state_lib

ONE_DEVICE = jax.devices()[:1]  # the runs are not about meshes
FLAT = lambda params: {
    state_lib.parameter_path(p): np.asarray(v)
    for p, v in jax.tree_util.tree_flatten_with_path(params)[0]
}


def VOCAB(params) -> int:
  return next(v.shape[0] for name, v in params.items() if name.endswith('embed/embedding'))


def small_config(helpers, tfds_dir, **extra):
  config = helpers.load_config('lm', 'tiny')
  return helpers.override(
      config,
      {
          **helpers.small_model,
          'model.num_decoder_layers': 2,
          'num_train_steps': 4,
          'checkpoint_every_steps': 4,
          'eval_every_steps': 0,
          'num_eval_steps': 1,
          'per_device_batch_size': 1,
          'data.tfds_data_dir': tfds_dir,
          'peak_flops_per_device': 1e11,
          'model.dropout_rate': 0.1,
          'data.name': 'tiny_shakespeare',
          **extra,
      },
  )


@pytest.fixture(scope='module')
def source_run(helpers, tfds_dir, tmp_path_factory):
  workdir = tmp_path_factory.mktemp('source')
  train.train_and_evaluate(small_config(helpers, tfds_dir), str(workdir), devices=ONE_DEVICE)
  return str(workdir), FLAT(checkpoints.load_state(str(workdir))[1]['params'])


def test_warm_start_copies_parameters_and_keeps_new_ones(source_run, helpers, tfds_dir):
  workdir, source = source_run
  config = small_config(
      helpers, tfds_dir, **{'init_from': f'{workdir}:4', 'model.attention.gated': True}
  )
  s = state_lib.setup(config, vocab_size=VOCAB(source), bos_id=1, devices=jax.devices()[:1])
  params = FLAT(state_lib.create_state(s)['params'])
  gates = [name for name in params if name.endswith('gate_log_alpha')]
  assert len(gates) == 2  # new parameters: not in the source, kept at their initial value
  for name in gates:
    np.testing.assert_array_equal(params[name], 3.0)
  for name, value in source.items():
    np.testing.assert_array_equal(params[name], value, err_msg=name)
  assert not np.array_equal(
      params['decoder/layers/0/mlp/wi/kernel'],
      FLAT(
          state_lib.create_state(
              state_lib.setup(
                  small_config(helpers, tfds_dir),
                  vocab_size=VOCAB(source),
                  bos_id=1,
                  devices=jax.devices()[:1],
              )
          )['params']
      )['decoder/layers/0/mlp/wi/kernel'],
  )


def test_shape_mismatch_names_the_parameter(source_run, helpers, tfds_dir):
  workdir, source = source_run
  config = small_config(helpers, tfds_dir, **{'init_from': workdir, 'model.mlp_dim': 32})
  s = state_lib.setup(config, vocab_size=VOCAB(source), bos_id=1, devices=jax.devices()[:1])
  with pytest.raises(
      ValueError,
      match=r'decoder/layers/0/mlp/wi/kernel has shape \(32, 64\) '
      r'in the source run and \(32, 32\) in this model',
  ):
    state_lib.create_state(s)


def test_frozen_parameters_stay_bitwise_unchanged(source_run, helpers, tfds_dir, tmp_path):
  workdir, source = source_run
  config = small_config(
      helpers,
      tfds_dir,
      **{
          'init_from': workdir,
          'trainable': r'^decoder/layers/1/',
          'num_train_steps': 3,
          'checkpoint_every_steps': 3,
      },
  )
  train.train_and_evaluate(config, str(tmp_path), devices=ONE_DEVICE)
  trained = FLAT(checkpoints.load_state(str(tmp_path))[1]['params'])
  changed = {name for name in source if not np.array_equal(trained[name], source[name])}
  assert changed and all(name.startswith('decoder/layers/1/') for name in changed), changed


def test_trainable_matching_nothing_is_an_error(helpers, tfds_dir):
  config = small_config(helpers, tfds_dir, trainable='^no_such_parameter')
  with pytest.raises(ValueError, match='matches no parameter'):
    state_lib.setup(config, vocab_size=64, bos_id=1, devices=jax.devices()[:1])


def test_resuming_a_warm_started_run_is_exact(source_run, helpers, tfds_dir, tmp_path):
  """A warm-started run killed after its step-2 checkpoint resumes from that checkpoint (not
  from the source run again) and ends bitwise where an uninterrupted run ends."""
  workdir, _ = source_run
  config = lambda: small_config(
      helpers,
      tfds_dir,
      **{
          'init_from': workdir,
          'trainable': r'^decoder/',
          'checkpoint_every_steps': 2,
          'async_checkpointing': False,
      },
  )
  train.train_and_evaluate(config(), str(tmp_path / 'straight'), devices=ONE_DEVICE)
  train.train_and_evaluate(config(), str(tmp_path / 'resumed'), devices=ONE_DEVICE)
  # As if killed after step 2's save: no step-4 checkpoint, no final evaluation.
  shutil.rmtree(tmp_path / 'resumed' / 'checkpoints' / '4')
  shutil.rmtree(tmp_path / 'resumed' / 'final_eval')
  train.train_and_evaluate(config(), str(tmp_path / 'resumed'), devices=ONE_DEVICE)
  straight, resumed = (
      FLAT(checkpoints.load_state(str(tmp_path / run), 4)[1]['params'])
      for run in ('straight', 'resumed')
  )
  for name, value in straight.items():
    np.testing.assert_array_equal(resumed[name], value, err_msg=name)
