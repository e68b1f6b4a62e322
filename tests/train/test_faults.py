"""Faults that must never end a run badly: a damaged checkpoint, a second run on the same
workdir, a disk that fills up during an asynchronous save."""

import errno
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from orbax.checkpoint._src.handlers import json_checkpoint_handler

from lowrank_attn import train as train_lib
from lowrank_attn.train import checkpoints, train

pytestmark = pytest.mark.integration  # trains end to end, or starts the command line


def small_config(helpers, tfds_dir, **extra):
  config = helpers.load_config('lm', 'tiny')
  return helpers.override(
      config,
      {
          **helpers.small_model,
          'model.num_decoder_layers': 1,
          'data.tfds_data_dir': tfds_dir,
          'per_device_batch_size': 1,
          'checkpoint_every_steps': 3,
          'keep_checkpoints': 3,
          'eval_every_steps': 0,
          'num_eval_steps': 1,
          'log_every_steps': 3,
          'peak_flops_per_device': 1e11,
          **extra,
      },
  )


def committed(workdir) -> list[int]:
  directory = pathlib.Path(workdir) / checkpoints.CHECKPOINT_DIR
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


# ------------------------------------------------------------------------ damaged checkpoints


@pytest.fixture(scope='module')
def six_steps(helpers, tfds_dir, tmp_path_factory):
  """A finished run of 6 steps with checkpoints 3 and 6."""
  workdir = tmp_path_factory.mktemp('six_steps')
  train.train_and_evaluate(small_config(helpers, tfds_dir, num_train_steps=6), str(workdir))
  assert committed(workdir) == [3, 6]
  return workdir


def truncate_the_array_files(step_dir: pathlib.Path) -> str:
  """The second half of every TensorStore data file (`state/**/d/<hash>`) is cut off."""
  files = [p for p in (step_dir / 'state').rglob('*') if p.is_file() and p.parent.name == 'd']
  for path in files:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
  return str(max(files, key=lambda p: p.stat().st_size).relative_to(step_dir))


def empty_the_directory(step_dir: pathlib.Path) -> str:
  shutil.rmtree(step_dir)
  step_dir.mkdir()
  return ''


def garble_the_input_positions(step_dir: pathlib.Path) -> str:
  (step_dir / 'data' / 'metadata').write_text('{"0": {"position": 4')
  return 'data/metadata'


@pytest.mark.parametrize(
    'damage,reason',
    [
        (truncate_the_array_files, 'ValueError: OUT_OF_RANGE'),  # TensorStore's
        (empty_the_directory, 'KeyError'),
        (garble_the_input_positions, 'JSONDecodeError'),
    ],
)
def test_a_damaged_latest_checkpoint_falls_back_to_the_newest_intact_one(
    damage, reason, helpers, tfds_dir, six_steps, tmp_path, capsys
):
  workdir = tmp_path / 'run'
  shutil.copytree(six_steps, workdir)
  damaged_file = damage(workdir / checkpoints.CHECKPOINT_DIR / '6')
  damaged_bytes = (
      (workdir / checkpoints.CHECKPOINT_DIR / '6' / damaged_file).read_bytes()
      if (damaged_file)
      else None
  )
  capsys.readouterr()

  result = train.train_and_evaluate(
      small_config(helpers, tfds_dir, num_train_steps=9), str(workdir)
  )
  out = capsys.readouterr().out
  assert result['step'] == 9
  moved = workdir / checkpoints.DAMAGED_DIR / '6'
  skipped = [line for line in out.splitlines() if 'is damaged' in line]
  assert len(skipped) == 1, out
  assert re.fullmatch(
      rf'checkpoint step 6 is damaged \({reason}.*\); skipped it and moved it '
      rf'to {re.escape(str(moved))}',
      skipped[0],
  ), skipped[0]
  assert 'resumed from step 3 ' in out, out
  # Kept as it was, out of the way: steps 6 and 9 were saved anew.
  assert moved.is_dir() and committed(workdir) == [3, 6, 9]
  if damaged_file:
    assert (moved / damaged_file).read_bytes() == damaged_bytes
  else:
    assert not any(moved.iterdir())
  assert checkpoints.load_state(str(workdir))[0] == 9


def test_a_read_error_that_goes_away_is_tried_again_not_taken_for_damage(
    helpers, tfds_dir, six_steps, tmp_path, monkeypatch, caplog
):
  """The newest checkpoint fails to read twice (EIO, as a flaky disk or a GCS 503 would) and
  then reads: the run resumes from it and moves nothing aside."""
  workdir = tmp_path / 'run'
  shutil.copytree(six_steps, workdir)
  restore, tries = checkpoints.Checkpointer.restore, []

  def flaky(self, step, abstract_state):
    tries.append(step)
    if tries.count(step) <= len(checkpoints.RESTORE_RETRY_SECS):
      raise OSError(errno.EIO, 'Input/output error')
    return restore(self, step, abstract_state)

  monkeypatch.setattr(checkpoints.Checkpointer, 'restore', flaky)
  monkeypatch.setattr(checkpoints, 'RESTORE_RETRY_SECS', (0.25, 0.75))
  sleep, waits = checkpoints.time.sleep, []

  def recording(secs):  # the process's time.sleep: other threads' sleeps are recorded too
    waits.append(secs)
    sleep(secs)

  monkeypatch.setattr(checkpoints.time, 'sleep', recording)
  result = train.train_and_evaluate(
      small_config(helpers, tfds_dir, num_train_steps=9), str(workdir)
  )
  assert result['step'] == 9 and tries == [6, 6, 6]
  assert [w for w in waits if w in (0.25, 0.75)] == [0.25, 0.75]
  assert not (workdir / checkpoints.DAMAGED_DIR).exists()
  assert caplog.text.count('restoring checkpoint step 6 failed') == 2


def test_when_no_checkpoint_restores_nothing_is_moved_and_the_run_stops(
    helpers, tfds_dir, six_steps, tmp_path
):
  workdir = tmp_path / 'run'
  shutil.copytree(six_steps, workdir)
  for step in ('3', '6'):
    garble_the_input_positions(workdir / checkpoints.CHECKPOINT_DIR / step)
  with pytest.raises(
      checkpoints.CheckpointError,
      match=r'no checkpoint .* could be restored.*'
      r'step 6: JSONDecodeError.*; step 3: JSONDecodeError',
  ) as error:
    train.train_and_evaluate(small_config(helpers, tfds_dir, num_train_steps=9), str(workdir))
  assert '\n' not in str(error.value)
  assert committed(workdir) == [3, 6] and not (workdir / checkpoints.DAMAGED_DIR).exists()


def test_a_rerun_refused_for_another_config_keeps_the_config_of_the_checkpoints(
    helpers, tfds_dir, six_steps, tmp_path
):
  """config.json describes the checkpoints beside it: a rerun whose model they do not fit is
  refused before it writes its own."""
  workdir = tmp_path / 'run'
  shutil.copytree(six_steps, workdir)
  before = (workdir / checkpoints.CONFIG_FILE).read_text()
  config = small_config(helpers, tfds_dir, num_train_steps=9, **{'model.emb_dim': 48})
  with pytest.raises(checkpoints.CheckpointError, match='could be restored'):
    train.train_and_evaluate(config, str(workdir))
  assert (workdir / checkpoints.CONFIG_FILE).read_text() == before
  assert json.loads(before)['model']['emb_dim'] == 32


def test_num_train_steps_below_the_newest_checkpoint_is_refused(
    helpers, tfds_dir, six_steps, tmp_path
):
  """Before: nothing trained, no final evaluation, exit 0, and config.json said 3 steps."""
  workdir = tmp_path / 'run'
  shutil.copytree(six_steps, workdir)
  before = (workdir / checkpoints.CONFIG_FILE).read_text()
  with pytest.raises(ValueError, match=r'num_train_steps=3 is below the checkpoint at step 6 in '):
    train.train_and_evaluate(small_config(helpers, tfds_dir, num_train_steps=3), str(workdir))
  assert (workdir / checkpoints.CONFIG_FILE).read_text() == before
  assert committed(workdir) == [3, 6]


def test_a_logged_train_mean_covers_the_steps_since_the_previous_log(helpers, tfds_dir, tmp_path):
  """Logged every 3 steps with a checkpoint every 2 (a fetch of the step metrics between two
  logs): each train record is the mean of the losses that a run logging every step records for
  the steps since the previous record. Before: the mean since the last fetch of any kind (a
  save, an evaluation, a progress line), so it depended on the checkpoint period and the clock."""

  def train_losses(name, **extra):
    workdir = tmp_path / name
    config = small_config(helpers, tfds_dir, num_train_steps=6, progress_every_secs=1e6, **extra)
    train.train_and_evaluate(config, str(workdir))
    lines = map(json.loads, (workdir / 'metrics.jsonl').read_text().splitlines())
    return {l['step']: l['loss'] for l in lines if l['split'] == 'train'}

  every_step = train_losses('every_step', log_every_steps=1, checkpoint_every_steps=6)
  logged = train_losses('every_3', log_every_steps=3, checkpoint_every_steps=2)
  assert sorted(logged) == [1, 3, 6]  # the first step, then every 3 (the last is 6)
  for step, previous in ((1, 0), (3, 1), (6, 3)):
    steps = range(previous + 1, step + 1)
    assert logged[step] == pytest.approx(np.mean([every_step[s] for s in steps]), rel=1e-6)


# ------------------------------------------------------------------------ two runs, one workdir

HOLD_THE_LOCK = """
import sys
from lowrank_attn.train import checkpoints
lock = checkpoints.WorkdirLock(sys.argv[1])
print('locked', flush=True)
sys.stdin.read()
"""


def test_a_second_run_on_a_workdir_in_use_is_refused_naming_the_holder(helpers, tfds_dir, tmp_path):
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  holder = subprocess.Popen(
      [sys.executable, '-c', HOLD_THE_LOCK, str(tmp_path)],
      cwd=helpers.root,
      env=env,
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      text=True,
  )
  try:
    assert holder.stdout.readline() == 'locked\n'
    values = {**helpers.small_model, 'data.tfds_data_dir': tfds_dir}
    second = subprocess.run(
        [
            sys.executable,
            '-m',
            'lowrank_attn.main',
            '--config=configs/lm.py:tiny',
            f'--workdir={tmp_path}',
            *helpers.cli_overrides(values),
        ],
        cwd=helpers.root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
  finally:
    holder.kill()  # SIGKILL: the kernel releases its lock
    holder.wait()
  assert second.returncode == 2, second
  assert second.stdout == '', second.stdout
  (line,) = second.stderr.strip().splitlines()
  assert line.startswith(f'Refused: {tmp_path} is in use by another run (pid {holder.pid} '), line
  assert os.listdir(tmp_path) == [checkpoints.LOCK_FILE]  # refused before any data work
  lock = checkpoints.WorkdirLock(str(tmp_path))  # free again after the holder died
  lock.release()


# --------------------------------------------------------------------------------- disk full


def failing_second_json_save(monkeypatch) -> list[str]:
  """Makes the second checkpoint's input-position file fail with ENOSPC in the background
  commit (where a full disk shows up in an asynchronous save); returns the calls' paths."""
  calls = []
  save = json_checkpoint_handler.JsonCheckpointHandler._save_fn

  async def save_fn(self, x, directory):
    calls.append(str(directory))
    if len(calls) == 2:
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return await save(self, x, directory)

  monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler, '_save_fn', save_fn)
  return calls


def test_a_failed_background_save_is_reported_by_check(helpers, tmp_path, monkeypatch):
  """Between steps, `check` notices a failed save without waiting for the next one."""
  config = helpers.override(helpers.load_config('lm', 'tiny'), helpers.small_model)
  config.mesh.data = 1
  s = train_lib.setup(config, vocab_size=64, bos_id=1, devices=jax.devices()[:1])
  state = train_lib.create_state(s)
  failing_second_json_save(monkeypatch)
  checkpointer = checkpoints.Checkpointer(str(tmp_path), keep=1)
  checkpointer.save(1, state, {'position': 1})
  checkpointer.save(2, state, {'position': 2})  # (waits for step 1 first)
  while checkpointer._manager.is_saving_in_progress():
    pass
  with pytest.raises(
      checkpoints.CheckpointError,
      match=r'saving checkpoint step 2 .* failed: '
      r'OSError: \[Errno 28\] No space left on device \(disk full.*the last good '
      r'checkpoint is step 1\.$',
  ):
    checkpointer.check()
  checkpointer.close()
  assert committed(tmp_path) == [1]  # keep=1, yet the last good one stays


def test_the_final_checkpoint_commits_before_the_run_counts_as_finished(
    helpers, tfds_dir, tmp_path, monkeypatch
):
  """The last step's save fails in the background: no final evaluation is recorded (it marks
  the run finished), so the rerun trains the last steps again and saves them."""
  failing_second_json_save(monkeypatch)
  config = small_config(helpers, tfds_dir, num_train_steps=6, async_checkpointing=True)
  with pytest.raises(checkpoints.CheckpointError, match='saving checkpoint step 6'):
    train.train_and_evaluate(config, str(tmp_path))
  assert not (tmp_path / train.FINAL_EVAL_DIR).exists()
  assert committed(tmp_path) == [3]
  monkeypatch.undo()  # the disk has room again
  assert train.train_and_evaluate(config, str(tmp_path))['step'] == 6
  assert (tmp_path / train.FINAL_EVAL_DIR / '6' / 'metrics.json').exists()
  assert committed(tmp_path) == [3, 6]


def test_an_update_that_makes_parameters_non_finite_is_never_saved(helpers, tfds_dir, tmp_path):
  """A learning rate past float32's range: step 1's loss and gradients are finite (they see
  the parameters before the update), the updated parameters are not. Before: saved as the
  newest checkpoint, which every resume then restored."""
  config = small_config(
      helpers,
      tfds_dir,
      num_train_steps=6,
      checkpoint_every_steps=1,
      learning_rate=1e39,
      warmup_steps=0,
      lr_schedule='constant',
      grad_clip_norm=0.0,
  )
  with pytest.raises(
      train.NonFiniteError,
      match=r'step 1: non-finite parameters after the update; .*\(no checkpoint was written\)',
  ):
    train.train_and_evaluate(config, str(tmp_path))
  assert not (tmp_path / checkpoints.CHECKPOINT_DIR).exists() or committed(tmp_path) == []


def test_disk_full_during_an_async_save_stops_the_run_at_that_save(
    helpers, tfds_dir, tmp_path, monkeypatch
):
  calls = failing_second_json_save(monkeypatch)
  config = small_config(
      helpers, tfds_dir, num_train_steps=12, keep_checkpoints=1, async_checkpointing=True
  )
  with pytest.raises(checkpoints.CheckpointError) as error:
    train.train_and_evaluate(config, str(tmp_path))
  message = str(error.value)
  assert '\n' not in message
  assert message.startswith(
      f'saving checkpoint step 6 to {tmp_path}/checkpoints failed: OSError: '
      '[Errno 28] No space left on device'
  ), message
  assert message.endswith('the last good checkpoint is step 3.'), message
  assert len(calls) <= 3, calls  # no save after the next one was attempted
  assert committed(tmp_path) == [3]
  step, state = checkpoints.load_state(str(tmp_path))
  assert step == 3 and int(state['step']) == 3
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state['params']))
