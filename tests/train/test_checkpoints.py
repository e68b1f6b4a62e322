"""Checkpoints: exact resume after SIGKILL, save on SIGTERM, restore onto another mesh, NaN stop.

The kill tests run the real command line in a subprocess on one CPU device.
"""

import fcntl
import os
import pathlib
import random
import re
import select
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from lowrank_attn import train
from lowrank_attn.train import checkpoints

STEPS = 90


def command(helpers, workdir, tfds_dir, steps=STEPS, **extra):
  values = {
      **extra,
      **helpers.small_model,
      'model.num_decoder_layers': 1,
      'model.dropout_rate': 0.1,
      'num_train_steps': steps,
      'checkpoint_every_steps': 3,
      'keep_checkpoints': 2,
      'log_every_steps': 5,
      'eval_every_steps': 0,
      'num_eval_steps': 1,
      'data.tfds_data_dir': tfds_dir,
      'peak_flops_per_device': 1e11,
  }
  return [
      sys.executable,
      '-m',
      'lowrank_attn.main',
      '--config=configs/lm.py:tiny',
      f'--workdir={workdir}',
      *helpers.cli_overrides(values),
  ]


def start(helpers, cmd, stdout=subprocess.PIPE):
  # One device: the command must not inherit the tests' 8 virtual devices.
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  return subprocess.Popen(
      cmd, cwd=helpers.root, env=env, stdout=stdout, stderr=subprocess.STDOUT, text=True
  )


def finish(process, timeout=300):
  out, _ = process.communicate(timeout=timeout)
  return process.returncode, out


def committed_steps(workdir) -> list[int]:
  directory = pathlib.Path(workdir) / checkpoints.CHECKPOINT_DIR
  if not directory.exists():
    return []
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def wait_for_checkpoint(workdir, process, timeout=180):
  deadline = time.time() + timeout
  while not committed_steps(workdir):
    assert process.poll() is None, 'the run ended before committing a checkpoint'
    assert time.time() < deadline, 'no checkpoint appeared'
    time.sleep(0.05)


@pytest.fixture(scope='module')
def reference(helpers, tfds_dir, tmp_path_factory):
  """Parameters after an uninterrupted run."""
  workdir = tmp_path_factory.mktemp('uninterrupted')
  rc, out = finish(start(helpers, command(helpers, workdir, tfds_dir)))
  assert rc == 0, out
  step, state = checkpoints.load_state(str(workdir))
  assert step == STEPS
  return state


def assert_bitwise_equal(a, b):
  flat_a, flat_b = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
  assert [p for p, _ in flat_a] == [p for p, _ in flat_b]
  for (path, x), (_, y) in zip(flat_a, flat_b):
    assert x.dtype == y.dtype and np.array_equal(x, y), jax.tree_util.keystr(path)


def read_from(fd, deadline, until: str | None = None) -> str:
  """What the pipe `fd` gives until EOF, or just up to the end of the line holding `until`.

  Byte by byte when looking for `until`, so nothing beyond that line leaves the pipe.
  """
  data = b''
  while True:
    ready, _, _ = select.select([fd], [], [], max(deadline - time.time(), 0))
    assert ready, f'no output for too long; so far:\n{data.decode(errors="replace")}'
    chunk = os.read(fd, 1 if until else 65536)
    if not chunk:
      return data.decode(errors='replace')
    data += chunk
    if until and chunk == b'\n' and until.encode() in data.rsplit(b'\n', 2)[-2]:
      return data.decode(errors='replace')


# The smallest pipe Linux makes: one page.
PIPE_BYTES = 4096


def kill_after_step(helpers, cmd, workdir, step) -> str:
  """Runs `cmd` until it reports `step`, then SIGKILLs it; returns its output.

  The kill moment is chosen, never left to the clock: the run prints a progress line every
  step (~70 bytes) into a one-page pipe that the test stops reading at `step`, so the run
  blocks on its own output within ~60 steps of it, while its background saves go on. It dies
  wherever it is by then: mid-step or mid-save.
  """
  read_end, write_end = os.pipe()
  try:
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    process = start(helpers, cmd, stdout=write_end)
  finally:
    os.close(write_end)
  deadline = time.time() + 300
  with os.fdopen(read_end, 'rb', buffering=0) as pipe:
    try:
      out = read_from(pipe.fileno(), deadline, until=f'step {step}/{STEPS} ')
      wait_for_checkpoint(workdir, process)  # committed in the background (async saves)
    finally:
      process.send_signal(signal.SIGKILL)
      process.wait()
    out += read_from(pipe.fileno(), deadline)
  assert f'step {step}/{STEPS} ' in out, out  # (not an EOF first)
  return out


# How many steps after its start each run is killed: seeded, and small enough that the run
# blocks on the pipe (~60 progress lines fill a page) before the last step.
KILL_STEPS = random.Random(22).sample(range(4, 10), 4)


def resumed_step(out: str) -> int:
  """The step a run says it resumed from; its first progress line must be the next one."""
  match = re.search(r'^resumed from step (\d+) ', out, re.MULTILINE)
  assert match, f'the run did not resume:\n{out}'
  step = int(match.group(1))
  first = re.search(r'^step (\d+)/', out, re.MULTILINE)
  assert first and int(first.group(1)) == step + 1, out
  return step


def kill_and_resume(helpers, workdir, tfds_dir, kills: int) -> tuple[list[int], list[int]]:
  """Kills the run `kills` times, each time a few (seeded) steps after it started or resumed,
  then lets it finish. Returns the last committed step after each kill and the step each
  following run resumed from."""
  cmd = command(helpers, workdir, tfds_dir, progress_every_secs=0.0)
  committed, resumed = [], []
  for i in range(kills):
    first_step = committed[-1] if committed else 0
    out = kill_after_step(helpers, cmd, workdir, first_step + KILL_STEPS[i])
    if i:
      resumed.append(resumed_step(out))
    committed.append(max(committed_steps(workdir)))
    assert 0 < committed[-1] < STEPS, (committed, out)
  rc, out = finish(start(helpers, cmd))
  assert rc == 0, out
  resumed.append(resumed_step(out))
  return committed, resumed


@pytest.mark.integration
def test_sigkill_mid_run_then_resume_is_bitwise_exact(helpers, tfds_dir, tmp_path, reference):
  (committed,), (resumed,) = kill_and_resume(helpers, tmp_path, tfds_dir, kills=1)
  # The second run resumed from the kill's last committed step, strictly inside the run.
  assert resumed == committed and 0 < resumed < STEPS
  step, state = checkpoints.load_state(str(tmp_path))
  assert step == STEPS
  assert_bitwise_equal(state['params'], reference['params'])
  assert_bitwise_equal(state['opt_state'], reference['opt_state'])
  # Only committed step directories remain; interrupted saves were cleaned up.
  names = os.listdir(tmp_path / checkpoints.CHECKPOINT_DIR)
  assert not [n for n in names if 'tmp' in n], names
  assert (tmp_path / checkpoints.CONFIG_FILE).exists()


@pytest.mark.slow
@pytest.mark.integration
def test_repeated_sigkills_then_resume_is_bitwise_exact(helpers, tfds_dir, tmp_path, reference):
  committed, resumed = kill_and_resume(helpers, tmp_path, tfds_dir, kills=4)
  assert resumed == committed  # every run went on from the last one's checkpoint
  _, state = checkpoints.load_state(str(tmp_path))
  assert_bitwise_equal(state['params'], reference['params'])


@pytest.mark.integration
def test_sigterm_saves_then_resume_is_exact(helpers, tfds_dir, tmp_path, reference):
  """SIGTERM mid-run saves a checkpoint and exits 143; rerunning resumes exactly.

  Never a race: the run prints a progress line every step (~60 bytes, ~6 kB for the steps
  after step 1) into a one-page pipe, and the test stops reading when step 1 is reported.
  The run then blocks on its own output well before step 90, so the signal always arrives
  while steps remain.
  """
  cmd = command(helpers, tmp_path, tfds_dir, progress_every_secs=0.0)
  read_end, write_end = os.pipe()
  try:
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    process = start(helpers, cmd, stdout=write_end)
  finally:
    os.close(write_end)
  deadline = time.time() + 300
  with os.fdopen(read_end, 'rb', buffering=0) as pipe:
    out = read_from(pipe.fileno(), deadline, until=f'step 1/{STEPS} ')
    process.send_signal(signal.SIGTERM)
    out += read_from(pipe.fileno(), deadline)
  rc = process.wait(timeout=max(deadline - time.time(), 1))
  assert rc == 143, f'exit status {rc}, expected 143 (preempted):\n{out}'
  assert 'preempted: saved step' in out, out
  saved = int(out.split('preempted: saved step ')[1].split()[0])
  assert 1 <= saved < STEPS and saved in committed_steps(tmp_path), (saved, out)
  rc, out = finish(start(helpers, cmd))
  assert rc == 0 and f'resumed from step {saved}' in out, out
  _, state = checkpoints.load_state(str(tmp_path))
  assert_bitwise_equal(state['params'], reference['params'])


def test_unfinished_saves_are_never_restored_and_are_cleaned_up(helpers, tmp_path):
  config = helpers.override(helpers.load_config('lm', 'tiny'), helpers.small_model)
  config.mesh.data = 1
  s = train.setup(config, vocab_size=64, bos_id=1, devices=jax.devices()[:1])
  state = train.create_state(s)
  checkpointer = checkpoints.Checkpointer(str(tmp_path), keep=3)
  checkpointer.save(4, state, {'position': 4})
  checkpointer.close()
  # What a save killed half-way leaves behind: a temporary directory with partial files.
  partial = tmp_path / checkpoints.CHECKPOINT_DIR / '8.orbax-checkpoint-tmp-1700000000'
  (partial / 'state').mkdir(parents=True)
  (partial / 'state' / 'junk').write_bytes(b'half a tensor')
  checkpointer = checkpoints.Checkpointer(str(tmp_path), keep=3)
  assert checkpointer.latest_step() == 4
  restored, data_state = checkpointer.restore(4, s.abstract_state)
  assert data_state == {'position': 4} and int(restored['step']) == 0
  checkpointer.save(8, restored, {'position': 8})  # the retried save of step 8 commits
  checkpointer.close()
  assert not partial.exists()  # (deleted in the background when the manager started)
  assert committed_steps(tmp_path) == [4, 8]


def test_restore_onto_a_different_mesh(helpers, tmp_path):
  config = helpers.override(helpers.load_config('lm', 'tiny'), helpers.small_model)
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 8, 1, 1
  saved = train.setup(config, vocab_size=64, bos_id=1)
  state = train.create_state(saved)
  checkpointer = checkpoints.Checkpointer(str(tmp_path), keep=1)
  checkpointer.save(7, state, {'position': 42})
  checkpointer.close()

  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 2, 2, 2
  target = train.setup(config, vocab_size=64, bos_id=1)
  restored, data_state = checkpoints.Checkpointer(str(tmp_path)).restore(7, target.abstract_state)
  assert data_state == {'position': 42}
  kernel = restored['params']['decoder']['layers'][0]['mlp']['wi']['kernel']
  assert (
      kernel.sharding
      == target.state_shardings['params']['decoder']['layers'][0]['mlp']['wi']['kernel']
  )
  assert kernel.addressable_shards[0].data.shape == (16, 32)  # fsdp x tensor
  assert_bitwise_equal(jax.tree.map(np.asarray, restored), jax.tree.map(np.asarray, state))


@pytest.mark.integration
def test_nan_stops_the_run_naming_the_step_and_keeps_the_last_good_checkpoint(
    helpers, tfds_dir, tmp_path
):
  config = helpers.override(
      helpers.load_config('lm', 'tiny'),
      {
          **helpers.small_model,
          'model.num_decoder_layers': 1,
          'data.tfds_data_dir': tfds_dir,
          'num_train_steps': 20,
          'checkpoint_every_steps': 1,
          'log_every_steps': 10,
          'peak_flops_per_device': 1e11,
          # The first update makes parameters ~1e37; the next forward pass overflows.
          'learning_rate': 1e37,
          'warmup_steps': 0,
          'lr_schedule': 'constant',
          'grad_clip_norm': 0.0,
          'async_checkpointing': True,
      },
  )
  with pytest.raises(train.NonFiniteError, match=r'step 2: non-finite loss=nan') as error:
    train.train_and_evaluate(config, str(tmp_path))
  assert 'the last good checkpoint is step 1' in str(error.value)
  assert committed_steps(tmp_path) == [1]
  _, state = checkpoints.load_state(str(tmp_path))
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state['params']))
