"""A converted model written as a run: the training config it writes builds the converted
model, and a run warm-started from it (`config.init_from`) starts from its parameters."""

import importlib.util
import json
import pathlib

from flax import nnx
import jax
import numpy as np
import pytest

from lowrank_attn import models
from lowrank_attn.reparam import to_low_rank_concat, write_run
from lowrank_attn.runs import with_overrides
from lowrank_attn.train import config as config_lib, state as state_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
VOCAB = 300


def nmt_tiny_config():
  """`configs/nmt.py:tiny` as the command line loads it, smaller still (D=32, 1+1 layers)."""
  spec = importlib.util.spec_from_file_location('nmt_config', ROOT / 'configs' / 'nmt.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return with_overrides(
      module.get_config('tiny'),
      {
          'model.emb_dim': 32,
          'model.mlp_dim': 64,
          'model.num_encoder_layers': 1,
          'model.num_decoder_layers': 1,
      },
  )


def trained_like_model(config):
  """The model of a training config, with every parameter moved off its initialisation."""
  model = models.EncoderDecoder(config_lib.model_config(config, VOCAB), bos_id=1, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  nnx.update(
      model,
      jax.tree.map(
          lambda x: x + 0.1 * rng.standard_normal(x.shape).astype(x.dtype),
          nnx.state(model, nnx.Param),
      ),
  )
  return model


def flat(tree):
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(path): np.asarray(value) for path, value in leaves}


def test_written_run_round_trips_through_the_training_config(tmp_path):
  config = nmt_tiny_config()
  converted = to_low_rank_concat(trained_like_model(config), key_dim=16)  # 4 heads of 8
  overrides = write_run(converted, tmp_path / 'converted', config)
  assert overrides == pytest.approx(
      {
          f'model.{t}_attention.{field}': value
          for t in ('encoder', 'decoder', 'cross')
          for field, value in (
              ('kind', 'collaborative'),
              ('key_dim', 16),
              ('logit_scale', 1 / np.sqrt(8)),
          )
      }
  )
  written = json.loads((tmp_path / 'converted' / 'config.json').read_text())
  assert written['model']['cross_attention']['key_dim'] == 16
  conversion = json.loads((tmp_path / 'converted' / 'conversion.json').read_text())
  assert conversion['relative_errors'] == pytest.approx(converted.relative_errors)

  # The fine-tuning run: the original config, the overrides, a warm start from the directory.
  fine_tune = with_overrides(config, {**overrides, 'init_from': str(tmp_path / 'converted')})
  config_lib.validate(fine_tune)
  assert config_lib.model_config(fine_tune, VOCAB) == converted.config
  s = state_lib.setup(fine_tune, vocab_size=VOCAB, bos_id=1)
  started = flat(state_lib.create_state(s)['params'])
  expected = flat(nnx.to_pure_dict(nnx.state(converted.model, nnx.Param)))
  assert started.keys() == expected.keys()
  for name, value in expected.items():
    np.testing.assert_array_equal(started[name], value, err_msg=name)


def test_refuses_an_existing_run_and_a_config_that_is_not_the_original(tmp_path):
  config = nmt_tiny_config()
  converted = to_low_rank_concat(trained_like_model(config), key_dim=16)
  other = with_overrides(config, {'model.mlp_dim': 128})
  with pytest.raises(ValueError, match=r'does not build the model: mlp_dim: 128 vs 64'):
    write_run(converted, tmp_path / 'a', other)
  write_run(converted, tmp_path / 'b', config)
  with pytest.raises(ValueError, match='already holds checkpoint step 0'):
    write_run(converted, tmp_path / 'b', config)
