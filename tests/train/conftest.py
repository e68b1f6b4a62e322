"""Helpers for the training tests: load config files, shrink them, share prepared data."""

import json
import math
import os
import pathlib

import pytest

from lowrank_attn.train import config as config_lib, metrics

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load_config(name: str, variant: str = 'base'):
  """`configs/<name>.py:<variant>` as the command line would load it."""
  return config_lib.load(f'{ROOT / "configs" / name}.py:{variant}')


# A model small enough that a step costs milliseconds: tests exercise the machinery.
SMALL_MODEL = {
    'model.emb_dim': 32,
    'model.mlp_dim': 64,
    'model.attention.num_heads': 4,
    'per_device_batch_size': 4,
    'data.max_length': 32,
    'model.max_length': 64,
}


def override(config, values):
  for key, value in values.items():
    node = config
    *parents, leaf = key.split('.')
    for p in parents:
      node = node[p]
    node[leaf] = value
  return config


def cli_overrides(values) -> list[str]:
  return [f'--config.{k}={v}' for k, v in values.items()]


def assert_learned(config, result, workdir):
  """A finished run's last evaluation: clearly lower than its first step's loss, and far from
  guessing uniformly."""
  with open(os.path.join(workdir, metrics.METRICS_FILE)) as f:
    first = next(l for l in map(json.loads, f) if l['split'] == 'train')
  assert first['step'] == 1 and result['step'] == config.num_train_steps
  final = result['eval']['loss']
  assert final < first['loss'] - 1.0, (first['loss'], final)
  assert final < 0.75 * math.log(result['vocab_size']), final


class Helpers:
  root = ROOT
  load_config = staticmethod(load_config)
  override = staticmethod(override)
  cli_overrides = staticmethod(cli_overrides)
  assert_learned = staticmethod(assert_learned)
  small_model = SMALL_MODEL


@pytest.fixture(scope='session')
def helpers():
  """The functions above (test modules cannot import a conftest by name)."""
  return Helpers


@pytest.fixture(scope='session', autouse=True)
def no_restore_retry_waits():
  """A damaged checkpoint is tried RESTORE_RETRY_SECS more times before it counts as damaged:
  the tries stay, the waits go (seconds each in every test that damages one)."""
  from lowrank_attn.train import checkpoints  # pylint: disable=import-outside-toplevel

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(checkpoints, 'RESTORE_RETRY_SECS', (0.0, 0.0))
    yield


@pytest.fixture(scope='session')
def tfds_dir(tmp_path_factory):
  """One prepared-data directory for all tests (datasets are built once)."""
  return str(tmp_path_factory.mktemp('tfds'))
