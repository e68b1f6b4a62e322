"""The pre-flight of a training command: bad input is one line, found before any data is read."""

import os

import jax
import pytest

from lowrank_attn.train import preflight

# Read-only to every user, root included (a chmod-ed directory is not: root writes anyway).
READ_ONLY_DIR = '/sys/kernel'


@pytest.fixture
def config(helpers, tmp_path):
  c = helpers.load_config('lm', 'tiny')
  c.data.tfds_data_dir = str(tmp_path / 'tfds')
  return c


def refused(config, workdir, match, **kwargs):
  with pytest.raises(preflight.PreflightError, match=match) as raised:
    preflight.check(config, str(workdir), **kwargs)
  assert '\n' not in str(raised.value)
  return str(raised.value)


def test_a_valid_command_passes_and_writes_nothing(config, tmp_path):
  workdir = tmp_path / 'runs' / 'new'  # not there yet: the run makes it
  preflight.check(config, str(workdir))
  assert os.listdir(tmp_path) == []


def test_an_unknown_data_set_names_ours_not_tfds_catalogue(config, tmp_path):
  config.data.name = 'shakespear'
  message = refused(config, tmp_path, r"config\.data\.name='shakespear' is not a data set")
  for ours in ('shakespeare', 'tiny_shakespeare', 'multi30k', 'ud_english_ewt', 'glue/sst2'):
    assert ours in message
  assert 'abstract_reasoning' not in message  # the first of TFDS's 250 names
  assert str(tmp_path / 'tfds') in message


@pytest.mark.parametrize('name', ['lm1b', 'wmt14_translate/de-en', 'mnist', 'prepared_here'])
def test_official_and_prepared_data_sets_pass(config, tmp_path, name):
  os.makedirs(tmp_path / 'tfds' / 'prepared_here' / '1.0.0')
  config.data.name = name
  preflight.check_data_name(config, str(tmp_path))


def test_the_mesh_must_fit_the_devices(config, tmp_path):
  assert jax.device_count() == 8  # tests/conftest.py
  config.mesh.tensor = 3
  refused(config, tmp_path, r"config\.mesh=.*'tensor': 3.* do not divide the 8 available")
  refused(config, tmp_path, r'do not divide the 16 available', num_devices=16)
  config.mesh.tensor = 4
  preflight.check(config, str(tmp_path))
  refused(config, tmp_path, r'do not divide the 2 available', num_devices=2)


def test_a_multi_process_run_leaves_its_mesh_to_the_cluster(config, tmp_path, monkeypatch):
  # jax.distributed.initialize() must precede every other JAX call: no device_count() here.
  config.jax_distributed = True
  config.mesh.tensor = 3
  monkeypatch.setattr(jax, 'device_count', lambda: pytest.fail('touched the devices'))
  preflight.check(config, str(tmp_path))


def test_a_missing_extra_test_file_is_named(config, tmp_path):
  present = tmp_path / 'present.txt'
  present.write_text('a line\n')
  config.data.extra_test_files = f'{present},{tmp_path}/gone.txt'
  refused(
      config,
      tmp_path / 'run',
      r"extra_test_files: '.*/gone\.txt' \(test set 'gone'\) " 'does not exist',
  )
  config.data.extra_test_files = f'{present},{tmp_path}'
  refused(config, tmp_path / 'run', r'is a directory, not a file')
  config.data.extra_test_files = str(present)
  preflight.check(config, str(tmp_path / 'run'))


def test_extra_test_files_relative_to_a_checkout(config, tmp_path):
  (tmp_path / 'a.txt').write_text('x\n')
  config.data.extra_test_files = 'a.txt,/only/on/the/workers.txt'
  preflight.check_extra_test_files(config, base_dir=str(tmp_path), relative_only=True)
  with pytest.raises(preflight.PreflightError, match='workers.txt'):
    preflight.check_extra_test_files(config, base_dir=str(tmp_path))
  config.data.extra_test_files = 'b.txt'
  with pytest.raises(preflight.PreflightError, match="'b.txt'"):
    preflight.check_extra_test_files(config, base_dir=str(tmp_path), relative_only=True)


def test_a_workdir_that_is_a_file(config, tmp_path):
  a_file = tmp_path / 'notes.txt'
  a_file.write_text('')
  refused(config, a_file, r'--workdir=.*notes\.txt is a file, not a directory')
  refused(
      config,
      a_file / 'run',
      r'--workdir=.*notes\.txt/run cannot be made: .*notes\.txt is ' 'a file',
  )


def test_num_train_steps_below_the_newest_checkpoint(config, tmp_path):
  """Step directories as Orbax commits them (a temporary one, still being written, is not a
  step); below the newest the run would train nothing and exit 0."""
  for name in ('3', '6', '9.orbax-checkpoint-tmp-1234'):
    (tmp_path / 'checkpoints' / name).mkdir(parents=True)
  config.num_train_steps = 6
  preflight.check(config, str(tmp_path))
  config.num_train_steps = 5
  refused(config, tmp_path, r'num_train_steps=5 is below the checkpoint at step 6 in .*checkpoints')


@pytest.mark.parametrize('under', ['', 'new/run'])
def test_a_read_only_workdir(config, under):
  workdir = os.path.join(READ_ONLY_DIR, under) if under else READ_ONLY_DIR
  refused(config, workdir, rf'--workdir={workdir} is not writable.*: Permission denied')


def test_remote_workdirs_get_the_remote_check_not_the_local_ones(config, monkeypatch, tmp_path):
  """A gs:// workdir is probed through epath (`check_remote_workdir` and its checkpoint steps:
  tested against a fake bucket in test_remote_workdir.py), never looked at as a local path."""
  probed, steps = [], []
  monkeypatch.setattr(preflight, 'check_remote_workdir', probed.append)
  monkeypatch.setattr(preflight, 'check_checkpoint_steps', lambda _, w: steps.append(w))
  monkeypatch.chdir(tmp_path)
  preflight.check(config, 'gs://bucket/runs/lm')
  assert probed == steps == ['gs://bucket/runs/lm']
  assert not os.listdir(tmp_path)  # no local directory 'gs:'
