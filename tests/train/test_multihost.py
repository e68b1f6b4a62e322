"""Two processes (simulated hosts, 2 CPU devices each) on one machine: per-process input,
global batches, Orbax checkpoints with every process's data position, exact resume; SIGTERM
(to one host or both) in a training step and in an evaluation, through JAX's preemption sync
point (`checkpoints.PreemptionWatcher`)."""

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from lowrank_attn import tasks
from lowrank_attn import data
from lowrank_attn.train import checkpoints

WORKER = pathlib.Path(__file__).with_name('multihost_worker.py')


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def run_two_processes(workdir, tfds_dir, steps):
  port = str(free_port())
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  processes = [
      subprocess.Popen(
          [sys.executable, str(WORKER), str(i), port, str(workdir), tfds_dir, str(steps)],
          env=env,
          stdout=subprocess.PIPE,
          stderr=subprocess.STDOUT,
          text=True,
      )
      for i in range(2)
  ]
  outputs = [p.communicate(timeout=300)[0] for p in processes]
  for p, out in zip(processes, outputs):
    assert p.returncode == 0, out
  return outputs


def prepare(helpers, workdir, tfds_dir):
  """Builds the data set and tokenizer once, so the two processes only read them."""
  config = helpers.load_config('lm', 'tiny')
  config.data.tfds_data_dir = tfds_dir
  tasks.make_pipeline(
      config.data, split='train', seed=0, global_batch_size=4, train=True, workdir=str(workdir)
  )


@pytest.mark.slow
def test_two_process_run_resumes_exactly(helpers, tfds_dir, tmp_path):
  straight, resumed = tmp_path / 'straight', tmp_path / 'resumed'
  for workdir in (straight, resumed):
    prepare(helpers, workdir, tfds_dir)
  outputs = run_two_processes(straight, tfds_dir, 18)
  assert 'RESULT 0 18' in outputs[0] and 'RESULT 1 18' in outputs[1]
  run_two_processes(resumed, tfds_dir, 12)
  outputs = run_two_processes(resumed, tfds_dir, 18)
  assert 'resumed from step 12' in outputs[0]
  _, a = checkpoints.load_state(str(straight))
  _, b = checkpoints.load_state(str(resumed))
  for x, y in zip(jax.tree.leaves(a['params']), jax.tree.leaves(b['params'])):
    assert np.array_equal(x, y)


# --------------------------------------- preemption on two hosts (multihost_phase_worker.py)

PHASE_WORKER = pathlib.Path(__file__).with_name('multihost_phase_worker.py')
STEPS, EVAL_EVERY = 12, 6
# Eval batches per evaluation: stopping after the held batch (a second or so) and finishing
# the evaluation (seconds, on this CPU) are far apart.
NUM_EVAL_STEPS = 150
NOTICE_SECS = 2.0  # held after the signal: JAX polls for it each second, then the hosts agree


def phase_command(helpers, workdir, tfds_dir, port, process_id, phase, step, release):
  """The command line of process `process_id`, held in `phase` at `step` until `release`."""
  values = {
      **helpers.small_model,
      'model.num_decoder_layers': 1,
      'num_train_steps': STEPS,
      'checkpoint_every_steps': 3,
      'keep_checkpoints': 3,
      'eval_every_steps': EVAL_EVERY,
      'num_eval_steps': NUM_EVAL_STEPS,
      'log_every_steps': 3,
      'per_device_batch_size': 2,
      'mesh.data': 2,
      'mesh.fsdp': 2,
      'data.tfds_data_dir': tfds_dir,
      'peak_flops_per_device': 1e11,
      'jax_distributed': True,
      'coordinator_address': f'localhost:{port}',
      'num_processes': 2,
      'process_id': process_id,
  }
  return [
      sys.executable,
      str(PHASE_WORKER),
      phase,
      str(step),
      str(release),
      '--config=configs/lm.py:tiny',
      f'--workdir={workdir}',
      *helpers.cli_overrides(values),
  ]


class TwoHosts:
  """The two processes of a held run (`multihost_phase_worker.py`), their output read by threads."""

  def __init__(self, helpers, workdir, tfds_dir, phase='none', step=0):
    self.release = pathlib.Path(workdir).with_name(pathlib.Path(workdir).name + '.release')
    self.release.unlink(missing_ok=True)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
    self.processes = [
        subprocess.Popen(
            phase_command(helpers, workdir, tfds_dir, port, i, phase, step, self.release),
            cwd=helpers.root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    self.lines = [[] for _ in self.processes]
    self.held = [threading.Event() for _ in self.processes]
    self.exited = [None for _ in self.processes]  # monotonic time of each exit
    self.readers = [threading.Thread(target=self._read, args=(i,), daemon=True) for i in range(2)]
    for reader in self.readers:
      reader.start()

  def _read(self, i):
    for line in self.processes[i].stdout:
      self.lines[i].append(line)
      if line.startswith('HELD '):
        self.held[i].set()
    self.processes[i].wait()
    self.exited[i] = time.monotonic()

  def outputs(self) -> list[str]:
    return [''.join(lines) for lines in self.lines]

  def wait_held(self, timeout=600):
    deadline = time.monotonic() + timeout
    for i, held in enumerate(self.held):
      while not held.wait(timeout=1):
        assert self.processes[i].poll() is None, 'ended before the phase:\n' + self.outputs()[i]
        assert time.monotonic() < deadline, 'never held:\n' + self.outputs()[i]

  def finish(self, timeout=600) -> list[int]:
    """Lets the processes go on (if held); their exit statuses."""
    self.release.touch()
    try:
      for p in self.processes:
        p.wait(timeout=timeout)
    finally:
      self.kill()
    for reader in self.readers:
      reader.join(timeout=30)
    return [p.returncode for p in self.processes]

  def kill(self):
    for p in self.processes:
      p.kill()
      p.wait()

  def sigterm_when_held(self, targets, signum=signal.SIGTERM) -> tuple[list[int], list[float]]:
    """SIGTERM (or `signum`) to the processes `targets` once both are held; NOTICE_SECS later,
    lets them go on. (exit statuses, seconds from the signal to each exit)."""
    try:
      self.wait_held()
    except BaseException:
      self.kill()  # a held process would wait forever
      raise
    signalled = time.monotonic()
    for i in targets:
      self.processes[i].send_signal(signum)
    time.sleep(NOTICE_SECS)
    statuses = self.finish()
    return statuses, [exited - signalled for exited in self.exited]


def saved_step(out: str) -> int:
  match = re.search(r'^preempted: saved step (\d+) to ', out, re.MULTILINE)
  assert match, out
  return int(match.group(1))


def eval_steps(workdir) -> list[int]:
  """The steps of the periodic evaluations recorded in metrics.jsonl (one per evaluation)."""
  path = pathlib.Path(workdir) / 'metrics.jsonl'
  records = [json.loads(line) for line in path.read_text().splitlines()]
  return [r['step'] for r in records if r['split'] == 'eval']


def committed(workdir) -> list[int]:
  directory = pathlib.Path(workdir) / checkpoints.CHECKPOINT_DIR
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def eval_batches(out: str, step: int) -> list[int]:
  """The batches computed by each periodic evaluation of `step` ('EVAL <step> batches <n>')."""
  return [int(n) for n in re.findall(rf'^EVAL {step} batches (\d+) in ', out, re.MULTILINE)]


@pytest.mark.slow
def test_two_hosts_sigterm_in_an_evaluation_stops_it_and_the_next_start_reruns_it(
    helpers, tfds_dir, tmp_path
):
  """Two processes held in the first batch of the periodic evaluation at step 6 (of 150
  batches) get SIGTERM (both, as in a maintenance event of the slice): both stop that
  evaluation at the same batch, commit step 6 and exit 143, nothing of the evaluation
  recorded. Started again, they rerun that evaluation, held in it again, and this time only
  process 1 gets SIGTERM: both stop it (143). A plain start then reruns it to the end (recorded
  once) and finishes the run (exit 0).

  The hold: JAX's preemption service catches SIGTERM in C++, and no Python hook tells when it
  has; the processes stay held NOTICE_SECS after the signal (JAX polls for it every second,
  then the hosts agree on the sync point through the coordination service) and then go on.
  With the hold, both stop at the batch after the held one; a wait that fell short would stop
  them some batches later (still the behaviour tested), while an evaluation that is not
  stopped runs its 150 batches (seconds here) and is recorded: the two are far apart."""
  workdir = tmp_path / 'run'
  prepare(helpers, workdir, tfds_dir)
  timings = {}

  run = TwoHosts(helpers, workdir, tfds_dir, 'eval', EVAL_EVERY)
  statuses, timings['evaluation, SIGTERM to both'] = run.sigterm_when_held((0, 1))
  outputs = run.outputs()
  assert statuses == [143, 143], outputs
  for out in outputs:
    assert saved_step(out) == EVAL_EVERY and 'during the evaluation at step 6' in out, out
    assert 'Traceback' not in out, out
  stopped = [eval_batches(out, EVAL_EVERY) for out in outputs]
  assert stopped[0] == stopped[1] and len(stopped[0]) == 1, outputs  # the same batch
  assert stopped[0][0] < NUM_EVAL_STEPS, outputs  # stopped, not finished
  assert EVAL_EVERY in committed(workdir)
  assert EVAL_EVERY not in eval_steps(workdir), outputs
  first_stop = stopped[0][0]

  run = TwoHosts(helpers, workdir, tfds_dir, 'eval', EVAL_EVERY)
  statuses, timings['evaluation rerun, SIGTERM to process 1'] = run.sigterm_when_held((1,))
  outputs = run.outputs()
  assert statuses == [143, 143], outputs
  assert 'resumed from step 6' in outputs[0] and 'evaluating step 6' in outputs[0], outputs
  for out in outputs:
    assert saved_step(out) == EVAL_EVERY and 'during the evaluation at step 6' in out, out
  stopped = [eval_batches(out, EVAL_EVERY) for out in outputs]
  assert stopped[0] == stopped[1] and stopped[0][0] < NUM_EVAL_STEPS, outputs
  assert EVAL_EVERY not in eval_steps(workdir), outputs

  run = TwoHosts(helpers, workdir, tfds_dir)
  statuses = run.finish()
  outputs = run.outputs()
  assert statuses == [0, 0], outputs
  assert 'resumed from step 6' in outputs[0] and 'evaluating step 6' in outputs[0], outputs
  assert eval_batches(outputs[0], EVAL_EVERY) == [NUM_EVAL_STEPS], outputs  # the whole of it
  assert eval_steps(workdir) == [EVAL_EVERY, STEPS]  # step 6 once, then step 12
  whole = re.search(rf'^EVAL {EVAL_EVERY} batches .*$', outputs[0], re.MULTILINE).group(0)
  print(
      'seconds from SIGTERM to each exit (the NOTICE_SECS hold included):',
      timings,
      f'; batches computed by the stopped evaluations: {first_stop}, {stopped[0][0]}',
      f'; the whole evaluation: {whole}',
  )


@pytest.mark.slow
@pytest.mark.parametrize(
    'signum, target', [(signal.SIGTERM, 0), (signal.SIGINT, 1)], ids=['sigterm', 'ctrl-c']
)
def test_two_hosts_sigterm_in_a_training_step_saves_the_next_step(
    helpers, tfds_dir, tmp_path, signum, target
):
  """Two processes held in the training step that makes step 4; SIGTERM to process 0 only (the
  coordinator's host), or Ctrl-C (SIGINT) to process 1 only (passed on as SIGTERM): both stop
  before the next step, commit step 4 and exit 143. A plain start resumes from step 4 and
  finishes the run (exit 0). (The hold: see the test above.)"""
  workdir = tmp_path / 'run'
  prepare(helpers, workdir, tfds_dir)
  run = TwoHosts(helpers, workdir, tfds_dir, 'train', 4)
  statuses, elapsed = run.sigterm_when_held((target,), signum)
  outputs = run.outputs()
  assert statuses == [143, 143], outputs
  for out in outputs:
    assert saved_step(out) == 4 and 'Traceback' not in out, out
  assert 4 in committed(workdir)

  run = TwoHosts(helpers, workdir, tfds_dir)
  statuses = run.finish()
  outputs = run.outputs()
  assert statuses == [0, 0], outputs
  assert 'resumed from step 4' in outputs[0], outputs
  assert eval_steps(workdir) == [EVAL_EVERY, STEPS]
  print('seconds from SIGTERM to each exit (the NOTICE_SECS hold included):', elapsed)
