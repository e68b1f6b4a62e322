"""Run directories: a model written as a run reads back as the same parameters and config,
checkpoint averaging is the element-wise mean, overrides are validated, files are replaced
whole, and the directory checks read no arrays."""

import os
import pathlib
import stat

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_attn import runs, tasks
from lowrank_attn.data import CharTokenizer
from lowrank_attn.runs import RunDir, with_overrides
from lowrank_attn.train import checkpoints, config as config_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def config(tmp_path):
  """configs/lm.py:tiny, smaller still, reading a character vocabulary written here."""
  tokenizer = tmp_path / 'chars.vocab'
  tokenizer.write_bytes(CharTokenizer.train(['the quick brown fox jumps']).to_bytes())
  return with_overrides(
      config_lib.load(f'{ROOT}/configs/lm.py:tiny'),
      {
          'model.emb_dim': 16,
          'model.mlp_dim': 32,
          'model.attention.num_heads': 2,
          'model.num_decoder_layers': 2,
          'data.tokenizer_path': str(tokenizer),
      },
  )


def random_params(config, vocab_size: int, seed: int):
  """A model of `config` and, as host numpy arrays, parameters moved off its initialisation."""
  model_cfg = config_lib.model_config(config, vocab_size)
  model = tasks.get(config.task).create_model(config, model_cfg, 1, nnx.Rngs(seed))
  rng = np.random.default_rng(seed)
  state = nnx.state(model, nnx.Param)
  params = jax.tree.map(
      lambda x: np.asarray(x) + rng.standard_normal(x.shape, np.float32), nnx.to_pure_dict(state)
  )
  nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
  nnx.update(model, state)
  return model, params


def leaves(tree) -> dict[str, np.ndarray]:
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(path): np.asarray(value) for path, value in flat}


def test_a_model_written_as_a_run_reads_back_the_same(config, tmp_path):
  vocab_size = CharTokenizer.train(['the quick brown fox jumps']).vocab_size
  model, params = random_params(config, vocab_size, seed=0)
  run = RunDir(tmp_path / 'run')
  assert not run.is_run() and run.steps() == [] and run.latest_step() is None

  assert run.write_model(model, config) == {}  # the config builds this model as it is
  assert run.is_run() and run.steps() == [0]
  assert config_lib.to_dict(run.config) == config_lib.to_dict(config)
  assert run.tokenizer.vocab_size == vocab_size
  assert run.model_config() == model.cfg
  read = leaves(nnx.to_pure_dict(nnx.state(run.model(), nnx.Param)))
  written = leaves(params)
  assert read.keys() == written.keys()
  for name, value in written.items():
    np.testing.assert_array_equal(read[name], value, err_msg=name)
  for name, value in leaves(run.params(0)).items():
    np.testing.assert_array_equal(value, written[name], err_msg=name)
  with pytest.raises(ValueError, match='already holds checkpoint step 0'):
    run.write_model(model, config)


def test_averaged_parameters_are_the_mean_of_the_checkpoints(config, tmp_path):
  vocab_size = CharTokenizer.train(['the quick brown fox jumps']).vocab_size
  run = RunDir(tmp_path / 'run')
  os.makedirs(run.path)
  run.write_config(config)
  # Two checkpoints written by hand (steps 3 and 7), and a half-written save, not a step.
  by_step = {
      3: random_params(config, vocab_size, seed=3)[1],
      7: random_params(config, vocab_size, seed=7)[1],
  }
  checkpointer = checkpoints.Checkpointer(run.path, keep=3, async_save=False)
  for step, params in by_step.items():
    checkpointer.save(step, {'step': jnp.asarray(step, jnp.int32), 'params': params}, {})
  checkpointer.close()
  os.makedirs(os.path.join(run.checkpoint_dir, '9.orbax-checkpoint-tmp-1'))
  assert run.steps() == [3, 7] and run.last_steps(3) == [3, 7]
  assert run.last_steps(2, up_to=5) == [3] and run.check_step() == 7

  abstract = run.setup().abstract_state['params']
  averaged = leaves(run.averaged_params(run.last_steps(2), abstract))
  first, second = leaves(by_step[3]), leaves(by_step[7])
  assert averaged.keys() == first.keys()
  for name, value in averaged.items():
    assert value.dtype == np.float32
    np.testing.assert_array_equal(value, np.mean([first[name], second[name]], axis=0), err_msg=name)
  only = leaves(run.averaged_params([7], abstract))  # one checkpoint: itself
  for name, value in only.items():
    np.testing.assert_array_equal(value, second[name], err_msg=name)


def test_a_slim_copy_keeps_one_checkpoints_parameters_and_what_reads_them(config, tmp_path):
  vocab_size = CharTokenizer.train(['the quick brown fox jumps']).vocab_size
  run = RunDir(tmp_path / 'run')
  os.makedirs(os.path.join(run.path, 'final_eval', '7'))
  run.write_config(config)
  (tmp_path / 'run' / 'metrics.jsonl').write_text('{"step": 7, "split": "test", "bleu": 1.0}\n')
  (tmp_path / 'run' / 'final_eval' / '7' / 'test.txt').write_text('a translation\n')
  params = {k: random_params(config, vocab_size, seed=k)[1] for k in (3, 7)}
  checkpointer = checkpoints.Checkpointer(run.path, keep=3, async_save=False)
  for step, p in params.items():  # an optimizer-state stand-in beside the parameters
    state = {'step': jnp.asarray(step, jnp.int32), 'params': p, 'opt_state': {'mu': p}}
    checkpointer.save(step, state, {})
  checkpointer.close()

  slim = run.write_slim_copy(tmp_path / 'slim')
  assert slim.steps() == [7] and slim.is_run()
  assert config_lib.to_dict(slim.config) == config_lib.to_dict(run.config)
  assert (tmp_path / 'slim' / 'final_eval' / '7' / 'test.txt').read_text() == 'a translation\n'
  assert (tmp_path / 'slim' / 'metrics.jsonl').read_text().startswith('{"step": 7')
  _, state = checkpoints.load_state(slim.path)
  assert set(state) == {'step', 'params'} and int(state['step']) == 7
  copied, original = leaves(slim.params()), leaves(params[7])
  assert copied.keys() == original.keys()
  for name, value in original.items():
    np.testing.assert_array_equal(copied[name], value, err_msg=name)
  earlier = leaves(run.write_slim_copy(tmp_path / 'slim3', step=3).params(3))
  for name, value in leaves(params[3]).items():
    np.testing.assert_array_equal(earlier[name], value, err_msg=name)
  with pytest.raises(ValueError, match='not empty'):
    run.write_slim_copy(tmp_path / 'slim')
  with pytest.raises(ValueError, match='has no checkpoint of step 5'):
    run.write_slim_copy(tmp_path / 'slim5', step=5)


def test_check_step_names_the_steps_a_run_has(tmp_path):
  run = RunDir(tmp_path)
  with pytest.raises(FileNotFoundError, match='has no checkpoint in'):
    run.check_step()
  for step in (10, 20):
    os.makedirs(os.path.join(run.checkpoint_dir, str(step)))
  assert run.check_step() == 20 and run.check_step(10) == 10
  with pytest.raises(ValueError, match='has no checkpoint of step 15; it has 10, 20'):
    run.check_step(15)
  with pytest.raises(ValueError, match='is not a run directory'):
    run.config  # pylint: disable=pointless-statement


def test_with_overrides_copies_sets_and_validates(config):
  changed = with_overrides(config, {'model.mlp_dim': 48}, seed=5)
  assert (changed.model.mlp_dim, changed.seed) == (48, 5)
  assert (config.model.mlp_dim, config.seed) != (48, 5)  # a copy: the original is unchanged
  with pytest.raises(
      ValueError, match=r'config\.model\.no_such: config\.model has no field ' r"'no_such'"
  ):
    with_overrides(config, {'model.no_such': 1})
  with pytest.raises(ValueError, match=r"config\.nowhere\.x: config has no field 'nowhere'"):
    with_overrides(config, {'nowhere.x': 1})
  with pytest.raises(ValueError, match=r'config\.model\.emb_dim=.abc.'):
    with_overrides(config, {'model.emb_dim': 'abc'})  # the wrong type
  with pytest.raises(ValueError, match='learning_rate'):
    with_overrides(config, learning_rate=-1.0)  # the right type, an invalid value


def test_data_overrides_point_at_the_run_vocabulary_and_data(config, tmp_path):
  run = RunDir(tmp_path / 'run')
  os.makedirs(run.path)
  run.write_config(config)
  assert run.data_overrides() == {
      'data.tokenizer_path': config.data.tokenizer_path,
      'data.tfds_data_dir': os.path.join(run.path, 'tfds'),
  }


def test_write_atomic_replaces_a_file_whole(tmp_path):
  path = tmp_path / 'result.json'
  runs.write_atomic(path, '{"a": 1}')
  runs.write_atomic(path, '{"a": 2, "é": 3}')
  assert path.read_text(encoding='utf-8') == '{"a": 2, "é": 3}'
  runs.write_atomic(path, b'\x00\x01')
  assert path.read_bytes() == b'\x00\x01'
  with pytest.raises(TypeError):
    runs.write_atomic(path, 12)  # fails while writing: the old file stays, no leftover
  assert path.read_bytes() == b'\x00\x01'
  assert os.listdir(tmp_path) == ['result.json']
  # Permissions as open() gives (the umask's), not a temporary file's 0600.
  (tmp_path / 'plain').write_text('x')
  assert stat.S_IMODE(path.stat().st_mode) == stat.S_IMODE((tmp_path / 'plain').stat().st_mode)


def test_translate_average_last_translates_with_the_mean_of_the_last_checkpoints(
    tmp_path, monkeypatch
):
  """`translate --average_last=N [--step=S]`: the parameters handed to the translator are the
  element-wise mean of the last N checkpoints up to S (the translator itself is stubbed)."""
  from lowrank_attn import translate
  from lowrank_attn.train import decode

  vocabulary = tmp_path / 'chars.vocab'
  vocabulary.write_bytes(CharTokenizer.train(['ein hund a dog']).to_bytes())
  config = with_overrides(
      config_lib.load(f'{ROOT}/configs/nmt.py:tiny'),
      {
          'model.emb_dim': 16,
          'model.mlp_dim': 16,
          'model.attention.num_heads': 2,
          'model.num_encoder_layers': 1,
          'model.num_decoder_layers': 1,
          'data.tokenizer': 'char',
          'data.tokenizer_path': str(vocabulary),
      },
  )
  vocab_size = CharTokenizer.train(['ein hund a dog']).vocab_size
  run = RunDir(tmp_path / 'run')
  os.makedirs(run.path)
  run.write_config(config)
  checkpointer = checkpoints.Checkpointer(run.path, keep=3, async_save=False)
  by_step = {}
  for step in (3, 5, 7):
    params = random_params(config, vocab_size, seed=step)[1]
    checkpointer.save(step, {'step': jnp.asarray(step, jnp.int32), 'params': params}, {})
    by_step[step] = leaves(params)
  checkpointer.close()
  source = tmp_path / 'in.txt'
  source.write_text('a dog\n')
  seen = []

  class Stub:
    batch_size, timing = 1, decode.Timing()

    def translate(self, texts, progress=None):
      return decode.Translations(['ein hund'] * len(texts), [])

  def translator(self, params, **kwargs):
    seen.append(leaves(params))
    return Stub()

  monkeypatch.setattr(translate.TranslationRun, 'translator', translator)
  for kwargs, steps in (
      ({'average_last': 2}, (5, 7)),
      ({'average_last': 2, 'step': 5}, (3, 5)),
      ({}, (7,)),
  ):
    translate.translate_file(
        run.path, input_path=str(source), output_path=str(tmp_path / 'out.txt'), **kwargs
    )
    got = seen.pop()
    assert got.keys() == by_step[7].keys()
    for name, value in got.items():
      # The mean of 2 float32 numbers: within 2 ulp of the float64 mean.
      want = np.mean([by_step[s][name].astype(np.float64) for s in steps], axis=0)
      np.testing.assert_allclose(value, want, rtol=2.5e-7, atol=1e-7, err_msg=f'{kwargs}: {name}')
