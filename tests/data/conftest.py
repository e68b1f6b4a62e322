"""Fixtures for the data tests: the real files of ../shared/data, prepared once per session."""

import os
import pathlib

import pytest

from lowrank_attn import data


@pytest.fixture(scope='session')
def shared_data_dir() -> pathlib.Path:
  """The shared data directory; a wrong one is an error, never a reason to skip."""
  path = pathlib.Path(os.environ.get(data.DATA_DIR_ENV, ''))
  if not (path / 'multi30k').is_dir():
    pytest.fail(
        f'${data.DATA_DIR_ENV}={str(path)!r} does not hold the shared data sets '
        '(multi30k/, ud_english_ewt/, tinyshakespeare/): point it at them.',
        pytrace=False,
    )
  return path


@pytest.fixture(scope='session')
def tfds_dir(tmp_path_factory, shared_data_dir) -> str:
  """Prepared ArrayRecord datasets, shared by all tests (preparing takes ~1 s per dataset)."""
  del shared_data_dir  # only its check: builders read $LOWRANK_ATTN_DATA themselves
  return str(tmp_path_factory.mktemp('tfds'))


@pytest.fixture(scope='session')
def workdir(tmp_path_factory) -> str:
  """A run directory whose cached tokenizers are shared by the tests that use the same one."""
  return str(tmp_path_factory.mktemp('workdir'))


@pytest.fixture
def make_config(tfds_dir):
  def make(**overrides):
    return data.default_data_config(tfds_data_dir=tfds_dir, **overrides)

  return make
