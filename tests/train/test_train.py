"""The real loop on the tiny configs: the loss falls, metrics and configs are written."""

import json
import os

import jax
import pytest
from tensorboard.backend.event_processing import event_accumulator

from lowrank_attn.train import checkpoints, metrics, train


def run_tiny(helpers, task, workdir, tfds_dir, **overrides):
  """The tiny config with its global batch on one CPU device (meshes: tests/train/test_state.py),
  a third faster than on the tests' 8."""
  config = helpers.load_config(task, 'tiny')
  helpers.override(config, {'data.tfds_data_dir': tfds_dir, **overrides})
  return config, train.train_and_evaluate(config, str(workdir), devices=jax.devices()[:1])


def read_jsonl(workdir):
  with open(os.path.join(workdir, metrics.METRICS_FILE)) as f:
    return [json.loads(line) for line in f]


@pytest.fixture(scope='module')
def lm_run(helpers, tfds_dir, tmp_path_factory):
  workdir = tmp_path_factory.mktemp('lm_tiny')
  # 40 of the config's 100 steps: the training loss is at 2.5 nats by step 40 (5.1 at step 1),
  # well past both thresholds of assert_learned; the steps were most of the fixture's time.
  config, result = run_tiny(
      helpers, 'lm', workdir, tfds_dir, num_train_steps=40, checkpoint_every_steps=20
  )
  return config, result, workdir


@pytest.mark.slow
def test_mlm_tiny_learns(helpers, tfds_dir, tmp_path):
  """(The translation model learns in tests/train/test_translate.py's run, the LM here.)"""
  config, result = run_tiny(helpers, 'mlm', tmp_path, tfds_dir)
  helpers.assert_learned(config, result, tmp_path)


def test_lm_tiny_learns(lm_run, helpers):
  config, result, workdir = lm_run
  helpers.assert_learned(config, result, workdir)
  # On the one device run_tiny gives it, a step is per_device_batch_size rows.
  first = next(l for l in read_jsonl(workdir) if l['split'] == 'train')
  assert 0.9 * config.per_device_batch_size * config.data.max_length <= first['tokens']
  assert first['tokens'] <= config.per_device_batch_size * config.data.max_length
  # CPU: achieved FLOP/s, and no MFU (no published peak to divide by).
  assert result['throughput']['tokens_per_sec'] > 0 and result['throughput']['flops_per_sec'] > 0
  assert 'mfu' not in result['throughput']


def test_metrics_tensorboard_and_config_are_written(lm_run):
  config, _, workdir = lm_run
  lines = read_jsonl(workdir)
  assert [l['split'] for l in lines].count('hparams') == 1
  train_steps = [l['step'] for l in lines if l['split'] == 'train']
  assert train_steps[0] == 1 and train_steps[-1] == config.num_train_steps
  assert {
      'loss',
      'accuracy',
      'grad_norm',
      'learning_rate',
      'steps_per_sec',
      'tokens_per_sec',
      'flops_per_sec',
  } <= set(lines[-2])
  evals = [l for l in lines if l['split'] == 'eval']
  assert {'loss', 'perplexity', 'accuracy'} <= set(evals[-1])

  # tensorboard's own reader (no TensorFlow installed).
  accumulator = event_accumulator.EventAccumulator(os.path.join(workdir, metrics.TENSORBOARD_DIR))
  accumulator.Reload()
  assert {'train/loss', 'train/flops_per_sec', 'eval/perplexity'} <= set(
      accumulator.Tags()['scalars']
  )
  assert [e.step for e in accumulator.Scalars('train/loss')] == train_steps
  assert '_hparams_/session_start_info' in accumulator.Tags()['tensors']

  saved = json.load(open(os.path.join(workdir, checkpoints.CONFIG_FILE)))
  assert saved['model']['emb_dim'] == config.model.emb_dim
  assert saved['data']['name'] == 'shakespeare'


def test_rerunning_a_finished_run_says_so_at_once(lm_run, monkeypatch, capsys):
  config, result, workdir = lm_run
  assert os.path.exists(
      os.path.join(workdir, train.FINAL_EVAL_DIR, str(result['step']), 'metrics.json')
  )  # {} for lm: the mark of the end

  def must_not_run(*args, **kwargs):
    raise AssertionError('a finished run built a pipeline or a model')

  monkeypatch.setattr(train.tasks_lib, 'make_pipeline', must_not_run)
  monkeypatch.setattr(train.state_lib, 'setup', must_not_run)
  capsys.readouterr()
  again = train.train_and_evaluate(config, str(workdir))
  assert again['step'] == result['step'] == config.num_train_steps
  assert again['already_finished']
  out = capsys.readouterr().out
  assert f'already finished at step {config.num_train_steps}' in out, out
  assert f'tensorboard --logdir {workdir}/tensorboard' in out, out
  assert [l['split'] for l in read_jsonl(workdir)].count('hparams') == 1
