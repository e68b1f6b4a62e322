"""Remote workdirs (`--workdir=gs://BUCKET/run`) without a network: a fake bucket.

`fake_gcs` maps every gs:// path of etils.epath onto a local directory (`mock_epath`, with
each of its file functions translating the path): what the code writes through
`lowrank_attn.files`, the tokenizer (epath) and Orbax's own file calls lands there. Orbax
writes the arrays with TensorStore's own GCS driver, which epath's mock cannot reach, so the
end-to-end run also maps the checkpoint directory at the Orbax boundary
(`orbax.checkpoint.CheckpointManager` gets the same local directory) and gives Orbax GCS's
way of committing a step (`CommitFileTemporaryPath`: written in place, then a
`commit_success.txt`; no rename). What is not covered: gcsfs and TensorStore talking to GCS
(latency, errors, credentials, consistency), and several machines (threads stand in for them
in the data test).
"""

import contextlib
import dataclasses
import io
import json
import os
import pathlib
import shutil
import threading
import time

from etils.epath import testing as epath_testing
import jax
import orbax.checkpoint as ocp
import pytest
from tensorboard.backend.event_processing import event_accumulator

from lowrank_attn import data, files, runs, tasks
from lowrank_attn.data import datasets, tokenizers
from lowrank_attn.train import checkpoints, metrics, preflight, train

BUCKET = 'gs://bucket'
WORKDIR = f'{BUCKET}/run'
ONE_DEVICE = jax.devices()[:1]  # the run is not about meshes


@contextlib.contextmanager
def fake_gcs(root: pathlib.Path):
  """gs://X/... is root/X/... for every epath call; local paths are left alone. As on GCS (no
  directories, only names), writing an object needs no parent directory."""

  def local(path):
    path = os.fspath(path)
    return os.path.join(root, path.removeprefix('gs://')) if path.startswith('gs://') else path

  def one(fn, path, *args, **kwargs):
    return fn(local(path), *args, **kwargs)

  def two(fn, path, dst, *args, **kwargs):
    return fn(local(path), local(dst), *args, **kwargs)

  def open_(fn, path, mode, *args, **kwargs):
    if os.fspath(path).startswith('gs://') and set(mode) & set('wa'):
      os.makedirs(os.path.dirname(local(path)), exist_ok=True)
    return fn(local(path), mode, *args, **kwargs)

  single = ('exists', 'glob', 'isdir', 'listdir', 'makedirs', 'mkdir', 'remove')
  with epath_testing.mock_epath(
      **{name: one for name in single},
      open=open_,
      rmtree=one,
      stat=one,
      walk=one,
      rename=two,
      replace=two,
      copy=two,
  ):
    yield local


def in_bucket(root, path) -> pathlib.Path:
  return pathlib.Path(root) / path.removeprefix('gs://')


@pytest.fixture
def gcs(tmp_path):
  root = tmp_path / 'gcs'
  root.mkdir()
  with fake_gcs(root):
    yield root


# ---------------------------------------------------------------------------- files


def test_remote_paths_are_kept_and_local_ones_made_absolute(monkeypatch, tmp_path):
  assert files.is_remote('gs://b/x') and files.is_remote('s3://b') and not files.is_remote('/x')
  assert not files.is_remote('runs/gs://x')
  assert files.resolve('gs://b/run/') == 'gs://b/run'  # not os.path.abspath: no 'gs:' dir
  monkeypatch.chdir(tmp_path)
  assert files.resolve('run') == str(tmp_path / 'run')
  monkeypatch.setenv(files.CACHE_ENV, str(tmp_path / 'cache'))
  local = files.local_dir('gs://my-bucket/runs/nmt1')
  assert local.startswith(str(tmp_path / 'cache' / 'runs' / 'my-bucket_runs_nmt1-'))
  assert files.local_dir('gs://my-bucket/runs/nmt1/') == local  # one run, one directory
  assert files.local_dir('gs://my-bucket/runs/nmt2') != local
  assert files.local_dir(str(tmp_path / 'run')) == str(tmp_path / 'run')  # local: itself


def test_files_read_write_and_move_remote_paths(gcs, tmp_path):
  files.makedirs(f'{WORKDIR}/a/b')
  files.write_atomic(f'{WORKDIR}/a/b/x.txt', 'x')
  files.write_atomic(f'{WORKDIR}/a/y.bin', b'y')
  assert (gcs / 'bucket/run/a/b/x.txt').read_text() == 'x'
  assert not list((gcs / 'bucket/run/a/b').glob('.*'))  # one write, no temporary object
  assert files.read_text(f'{WORKDIR}/a/b/x.txt') == 'x' and files.isfile(f'{WORKDIR}/a/y.bin')
  assert files.isdir(f'{WORKDIR}/a') and not files.isfile(f'{WORKDIR}/a')
  assert sorted(files.listdir(f'{WORKDIR}/a')) == ['b', 'y.bin']
  # A directory moved: copied, then deleted.
  files.move(f'{WORKDIR}/a', f'{WORKDIR}/moved/a')
  assert not files.exists(f'{WORKDIR}/a')
  assert files.read_text(f'{WORKDIR}/moved/a/b/x.txt') == 'x'
  assert files.read_bytes(f'{WORKDIR}/moved/a/y.bin') == b'y'
  # Up and down.
  assert not files.download(f'{WORKDIR}/none', tmp_path / 'none')
  assert not (tmp_path / 'none').exists()
  assert files.download(f'{WORKDIR}/moved/a/y.bin', tmp_path / 'down' / 'y.bin')
  files.upload(tmp_path / 'down' / 'y.bin', f'{WORKDIR}/up.bin')
  assert (gcs / 'bucket/run/up.bin').read_bytes() == b'y'
  files.remove(f'{WORKDIR}/up.bin')
  files.remove(f'{WORKDIR}/up.bin', missing_ok=True)
  assert not files.exists(f'{WORKDIR}/up.bin')


# ----------------------------------------------------------------------------- preflight


def test_preflight_writes_a_probe_into_a_remote_workdir(gcs):
  preflight.check_workdir(WORKDIR)
  assert (gcs / 'bucket').is_dir() and not any((gcs / 'bucket').rglob('.write_test_*'))
  (gcs / 'bucket/file').write_text('')
  with pytest.raises(preflight.PreflightError, match='is an object'):
    preflight.check_workdir(f'{BUCKET}/file')


def test_preflight_reads_the_checkpoint_steps_of_a_remote_workdir(gcs, helpers):
  config = helpers.load_config('lm', 'tiny')
  config.num_train_steps = 8
  preflight.check_checkpoint_steps(config, WORKDIR)  # no checkpoints yet
  for step in (4, 12):
    (in_bucket(gcs, f'{WORKDIR}/{runs.CHECKPOINT_DIR}') / str(step)).mkdir(parents=True)
  with pytest.raises(preflight.PreflightError, match='below the checkpoint at step 12'):
    preflight.check_checkpoint_steps(config, WORKDIR)
  config.num_train_steps = 12
  preflight.check_checkpoint_steps(config, WORKDIR)


def test_preflight_of_a_remote_workdir_that_cannot_be_written_is_one_line(tmp_path):
  def refuse(fn, path, mode, *args, **kwargs):
    if os.fspath(path).startswith('gs://') and 'w' in mode:
      raise PermissionError(13, 'Permission denied (403)')
    return fn(path, mode, *args, **kwargs)

  with epath_testing.mock_epath(open=refuse, exists=lambda fn, path: False):
    with pytest.raises(preflight.PreflightError) as e:
      preflight.check_workdir(WORKDIR)
  assert str(e.value).startswith(f'--workdir={WORKDIR} is not writable: PermissionError')
  assert '\n' not in str(e.value)
  assert not os.path.exists('gs:')


# ------------------------------------------------------------------------------ metrics


def test_remote_metrics_are_uploaded_at_every_flush_and_appended_to(
    gcs, tmp_path, monkeypatch, capsys
):
  monkeypatch.setenv(files.CACHE_ENV, str(tmp_path / 'cache'))
  (gcs / 'bucket/run').mkdir(parents=True)
  (gcs / 'bucket/run/metrics.jsonl').write_text('{"step": 1, "split": "train", "loss": 3.0}\n')
  writer = metrics.MetricWriter(WORKDIR)
  writer.write_scalars(2, 'train', {'loss': 2.0})
  writer.flush()  # uploaded now, not only at the end: a kill loses what came after
  lines = jsonl(gcs)
  assert [(l['step'], l['loss']) for l in lines] == [(1, 3.0), (2, 2.0)]
  (events,) = (gcs / 'bucket/run/tensorboard').iterdir()
  acc = event_accumulator.EventAccumulator(str(events))
  acc.Reload()
  assert [e.step for e in acc.Scalars('train/loss')] == [2]
  # A failed upload: one line, retried at the next flush.
  upload = files.upload
  monkeypatch.setattr(files, 'upload', lambda *a: (_ for _ in ()).throw(OSError('503 busy')))
  writer.write_scalars(3, 'train', {'loss': 1.0})
  writer.flush()
  assert 'uploading metrics.jsonl to gs://bucket/run failed (OSError: 503 busy); retried' in (
      capsys.readouterr().out
  )
  assert len(jsonl(gcs)) == 2
  monkeypatch.setattr(files, 'upload', upload)
  writer.close()
  assert [l['step'] for l in jsonl(gcs)] == [1, 2, 3]
  assert not any(p.name == 'gs:' for p in tmp_path.rglob('*'))


# -------------------------------------------------------------------------------- lock


@pytest.fixture
def quick_lock(monkeypatch):
  monkeypatch.setattr(checkpoints.WorkdirLock, 'SETTLE_SECS', 0.0)


def lock_record(root) -> dict:
  for _ in range(100):  # (the fake bucket's writes are not atomic, GCS's are: retried)
    try:
      return json.loads((root / 'bucket/run/lock').read_text())
    except json.JSONDecodeError:
      time.sleep(0.01)
  raise AssertionError('the lock object stays unreadable')


def write_lock(root, holder: str, age: float) -> None:
  path = root / 'bucket/run/lock'
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps({'holder': holder, 'token': 'theirs', 'heartbeat': time.time() - age}))


def test_a_remote_lock_is_an_object_deleted_on_release(gcs, quick_lock):
  lock = checkpoints.WorkdirLock(WORKDIR)
  record = lock_record(gcs)
  assert record['holder'].startswith(f'pid {os.getpid()} on host ')
  assert time.time() - record['heartbeat'] < 60
  lock.release()
  assert not (gcs / 'bucket/run/lock').exists()
  checkpoints.WorkdirLock(WORKDIR).release()  # free again


def test_a_remote_lock_with_a_recent_heartbeat_refuses_a_second_run(gcs, quick_lock):
  write_lock(gcs, 'pid 7 on host worker-0, started 2026-01-01T00:00:00+00:00', age=30)
  with pytest.raises(checkpoints.WorkdirBusyError) as e:
    checkpoints.WorkdirLock(WORKDIR)
  message = str(e.value)
  assert message.startswith(
      f'{WORKDIR} is in use by another run (pid 7 on host worker-0, started '
      '2026-01-01T00:00:00+00:00; last heartbeat 30 s ago, taken over after 300 s, lock '
      f'{WORKDIR}/lock); wait for it to end, stop it, or pass another --workdir.'
  ), message
  assert lock_record(gcs)['token'] == 'theirs'  # untouched


def test_a_stale_remote_lock_is_taken_over(gcs, quick_lock, capsys):
  write_lock(gcs, 'pid 7 on host worker-0, started 2026-01-01T00:00:00+00:00', age=3600)
  lock = checkpoints.WorkdirLock(WORKDIR)
  assert 'taking over the stale lock gs://bucket/run/lock (pid 7 on host worker-0' in (
      capsys.readouterr().out
  )
  assert lock_record(gcs)['token'] != 'theirs'
  lock.release()
  assert not (gcs / 'bucket/run/lock').exists()


def test_the_remote_lock_heartbeat_keeps_it_fresh(gcs, quick_lock, monkeypatch):
  monkeypatch.setattr(checkpoints.WorkdirLock, 'HEARTBEAT_SECS', 0.05)
  lock = checkpoints.WorkdirLock(WORKDIR)
  try:
    first = lock_record(gcs)['heartbeat']
    deadline = time.time() + 30
    while lock_record(gcs)['heartbeat'] == first and time.time() < deadline:
      time.sleep(0.05)
    assert lock_record(gcs)['heartbeat'] > first
  finally:
    lock.release()


def test_of_two_starts_at_once_the_earlier_lock_writer_refuses(gcs, quick_lock, monkeypatch):
  """Another start writes its lock between ours and our read-back: the last writer holds it."""
  monkeypatch.setattr(
      checkpoints.WorkdirLock,
      '_after_write',
      lambda self: write_lock(gcs, 'pid 8 on host worker-1, started now', age=0),
  )
  with pytest.raises(checkpoints.WorkdirBusyError, match=r'\(pid 8 on host worker-1, started'):
    checkpoints.WorkdirLock(WORKDIR)
  assert lock_record(gcs)['token'] == 'theirs'  # the other start's: not deleted by ours


# ------------------------------------------------------------------ data of a remote run


def test_each_machine_prepares_its_data_and_all_read_process_zeros_tokenizer(
    gcs, tmp_path, monkeypatch
):
  """Three processes on two machines (threads; each machine's local disk is a directory):
  process 0 on machine A, processes 1 and 2 on machine B. Process 0 trains the tokenizer into
  the bucket; each machine prepares the data set once, in its own local directory."""
  machine = {'process 0': 'A', 'process 1': 'B', 'process 2': 'B'}
  real_local_dir = files.local_dir

  def per_machine(workdir):
    local = real_local_dir(workdir)
    if not files.is_remote(workdir):
      return local
    return os.path.join(tmp_path, 'machine', machine[threading.current_thread().name], 'run')

  monkeypatch.setattr(files, 'local_dir', per_machine)
  prepared_by, trained_by = [], []
  prepare, train_char = datasets._prepare, tokenizers.CharTokenizer.train.__func__

  def counting_prepare(*args):
    prepared_by.append(threading.current_thread().name)
    time.sleep(0.5)  # widen the window in which two processes of machine B could both prepare
    return prepare(*args)

  def counting_train(cls, texts):
    trained_by.append(threading.current_thread().name)
    return train_char(cls, texts)

  monkeypatch.setattr(datasets, '_prepare', counting_prepare)
  monkeypatch.setattr(tokenizers.CharTokenizer, 'train', classmethod(counting_train))
  config = data.default_data_config(
      name='tiny_shakespeare', task='lm', tokenizer='char', max_length=64
  )
  barrier = threading.Barrier(3, timeout=120)
  pipelines, errors = {}, []

  def run(process_index):
    try:
      pipelines[process_index] = tasks.make_pipeline(
          config,
          split='train',
          seed=0,
          global_batch_size=12,
          train=True,
          workdir=WORKDIR,
          process_index=process_index,
          process_count=3,
          barrier=lambda name: barrier.wait(),
      )
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  threads = [threading.Thread(target=run, args=(i,), name=f'process {i}') for i in (2, 1, 0)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  assert not errors, errors
  assert trained_by == ['process 0']  # one vocabulary, in the bucket
  assert (gcs / 'bucket/run/tokenizers').is_dir()
  assert [p.name for p in (gcs / 'bucket/run/tokenizers').iterdir()] == [
      'tiny_shakespeare_text_char.json'
  ]
  assert (
      pipelines[1].tokenizer.chars == pipelines[2].tokenizer.chars == pipelines[0].tokenizer.chars
  )
  # Machine A prepared once (process 0), machine B once (1 or 2; the other waited and read).
  assert sorted(machine[p] for p in prepared_by) == ['A', 'B'], prepared_by
  for name in 'AB':
    assert (tmp_path / 'machine' / name / 'run' / 'tfds' / 'shakespeare' / 'tiny').is_dir()
  assert not (gcs / 'bucket/run/tfds').exists()
  # A reader of the finished run (translate, RunDir) finds the same vocabulary.
  assert tasks.load_tokenizer(config, WORKDIR).chars == pipelines[0].tokenizer.chars


# ------------------------------------------------------------------------- end to end


def small_config(helpers, **extra):
  """configs/lm.py:tiny, small; no data.tfds_data_dir: a remote run's default local cache."""
  config = helpers.load_config('lm', 'tiny')
  return helpers.override(
      config,
      {
          **helpers.small_model,
          'model.num_decoder_layers': 1,
          'per_device_batch_size': 1,
          'num_train_steps': 6,
          'checkpoint_every_steps': 2,
          'keep_checkpoints': 3,
          'eval_every_steps': 2,
          'num_eval_steps': 1,
          'log_every_steps': 1,
          'peak_flops_per_device': 1e11,
          **extra,
      },
  )


@contextlib.contextmanager
def orbax_on_local_disk(monkeypatch, local):
  """Orbax's checkpoint directory of the fake bucket on its local directory, committed as on
  GCS (a commit file, no rename): TensorStore's GCS driver cannot be faked by mock_epath."""
  real = ocp.CheckpointManager

  def manager(directory, *args, options=None, **kwargs):
    if options is not None:
      options = dataclasses.replace(
          options, temporary_path_class=ocp.path.atomicity.CommitFileTemporaryPath
      )
    return real(local(directory), *args, options=options, **kwargs)

  monkeypatch.setattr(ocp, 'CheckpointManager', manager)
  yield


def jsonl(root) -> list[dict]:
  return [json.loads(l) for l in (root / 'bucket/run/metrics.jsonl').read_text().splitlines()]


@pytest.fixture(scope='module')
def remote_run(helpers, tmp_path_factory):
  """A run in gs://bucket/run: stopped at step 4 (as by SIGTERM); its newest checkpoint damaged;
  started again on a machine with an empty disk (a recreated slice), finished at step 6;
  started a third time. Run from an empty working directory."""
  tmp = tmp_path_factory.mktemp('remote')
  root, cwd, cache = tmp / 'gcs', tmp / 'cwd', tmp / 'cache'
  for d in (root, cwd, cache):
    d.mkdir()
  held_out = tmp / 'held_out.txt'  # a final evaluation split (lm has none of its own)
  held_out.write_text('To be, or not to be, that is the question.\nAll the world is a stage.\n')
  config = lambda: small_config(helpers, **{'data.extra_test_files': str(held_out)})
  out = {}
  with pytest.MonkeyPatch.context() as mp, fake_gcs(root) as local:
    mp.chdir(cwd)
    mp.setenv(files.CACHE_ENV, str(cache))
    mp.setattr(checkpoints.WorkdirLock, 'SETTLE_SECS', 0.0)
    stack = contextlib.ExitStack()
    stack.enter_context(orbax_on_local_disk(mp, local))
    with stack:
      with pytest.MonkeyPatch.context() as stop_at_4:
        stop_at_4.setattr(checkpoints.PreemptionWatcher, 'reached', lambda self, step: step == 4)
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer), pytest.raises(train.Preempted) as stopped:
          train.train_and_evaluate(config(), WORKDIR, devices=ONE_DEVICE)
      out['stopped'] = stopped.value
      out['first'] = buffer.getvalue()
      out['jsonl_after_stop'] = jsonl(root)
      out['local_after_stop'] = sorted(os.listdir(files.local_dir(WORKDIR)))
      # A recreated slice: nothing on the local disk. Step 4's input positions garbled.
      shutil.rmtree(cache)
      cache.mkdir()
      (root / 'bucket/run/checkpoints/4/data/metadata').write_text('{"0": {"position": 4')
      buffer = io.StringIO()
      with contextlib.redirect_stdout(buffer):
        out['result'] = train.train_and_evaluate(config(), WORKDIR, devices=ONE_DEVICE)
      out['second'] = buffer.getvalue()
      buffer = io.StringIO()
      with contextlib.redirect_stdout(buffer):
        out['again'] = train.train_and_evaluate(config(), WORKDIR, devices=ONE_DEVICE)
      out['third'] = buffer.getvalue()
      run = runs.RunDir(WORKDIR)
      out['steps'] = run.steps()
      out['run_config'] = run.config
      out['tokenizer'] = run.tokenizer
      out['data_overrides'] = run.data_overrides()
      out['local_dir'] = files.local_dir(WORKDIR)
      out['state'] = checkpoints.load_state(WORKDIR)
  out.update(root=root, cwd=cwd, cache=cache)
  return out


@pytest.mark.integration
def test_a_remote_run_writes_its_files_to_the_bucket(remote_run, helpers):
  root = remote_run['root']
  run = root / 'bucket' / 'run'
  assert json.loads((run / 'config.json').read_text())['num_train_steps'] == 6
  final = json.loads((run / 'final_eval' / '6' / 'metrics.json').read_text())
  assert list(final) == ['held_out'] and final['held_out']['loss'] > 0
  assert (run / 'tokenizers' / 'shakespeare_text_char.json').is_file()
  committed = sorted(p.name for p in (run / 'checkpoints').iterdir())
  assert committed == ['2', '4', '6']
  assert all((run / 'checkpoints' / s / 'commit_success.txt').is_file() for s in committed)
  # The damaged step 4 of the first run was moved aside in the bucket (copied, then deleted).
  assert (run / 'damaged_checkpoints' / '4' / 'data' / 'metadata').read_text() == (
      '{"0": {"position": 4'
  )
  assert f'moved it to {WORKDIR}/damaged_checkpoints/4' in remote_run['second']
  assert 'resumed from step 2 ' in remote_run['second']
  # TensorBoard: one events file per start that wrote metrics, readable from the bucket.
  events = sorted((run / 'tensorboard').iterdir())
  assert len(events) == 2, events
  steps = set()
  for path in events:
    acc = event_accumulator.EventAccumulator(str(path))
    acc.Reload()
    steps |= {e.step for e in acc.Scalars('train/loss')}
  assert steps == {1, 2, 3, 4, 5, 6}
  assert not (run / 'lock').exists()  # released
  assert not (run / 'tfds').exists() and not (run / 'encoded').exists()
  # The prepared data was on the local disk, not in the workdir nor the working directory.
  assert 'tfds' in remote_run['local_after_stop']
  assert 'metrics_mirror' in remote_run['local_after_stop']
  assert os.listdir(remote_run['cwd']) == []
  assert not os.path.exists(helpers.root / 'gs:')
  assert remote_run['result']['step'] == 6 and remote_run['result']['final'] == final


@pytest.mark.integration
def test_a_remote_run_resumed_on_an_empty_disk_keeps_its_metric_history(remote_run):
  stopped = remote_run['stopped']
  assert stopped.step == 4 and f'saved step 4 to {WORKDIR}/checkpoints' in str(stopped)
  before = remote_run['jsonl_after_stop']
  assert sorted(l['step'] for l in before if l['split'] == 'train') == [1, 2, 3, 4]
  assert sorted(l['step'] for l in before if l['split'] == 'eval') == [2, 4]
  after = jsonl(remote_run['root'])
  assert after[: len(before)] == before  # appended to, not replaced
  # Resumed from step 2 (step 4 was damaged): steps 3 and 4 ran again and were logged again.
  trained = [l['step'] for l in after if l['split'] == 'train']
  assert trained == [1, 2, 3, 4, 3, 4, 5, 6]
  assert [l['step'] for l in after if l['split'] == 'eval'] == [2, 4, 4, 6]
  assert [l['step'] for l in after if l['split'] == 'held_out'] == [6]


@pytest.mark.integration
def test_a_finished_remote_run_says_so(remote_run):
  assert remote_run['again']['already_finished']
  assert remote_run['again']['final'] == remote_run['result']['final']
  assert (
      f'already finished at step 6: nothing to do (its final evaluation: '
      f'{WORKDIR}/final_eval/6/metrics.json).'
  ) in remote_run['third']
  assert f'run directory {WORKDIR};' in remote_run['third']


@pytest.mark.integration
def test_a_remote_run_directory_reads_as_a_local_one(remote_run):
  assert remote_run['steps'] == [2, 4, 6]
  assert remote_run['run_config'].num_train_steps == 6
  assert remote_run['tokenizer'].vocab_size > 10
  overrides = remote_run['data_overrides']
  assert overrides['data.tokenizer_path'] == f'{WORKDIR}/tokenizers/shakespeare_text_char.json'
  assert overrides['data.tfds_data_dir'] == os.path.join(remote_run['local_dir'], 'tfds')
  assert remote_run['local_dir'].startswith(str(remote_run['cache']))
  step, state = remote_run['state']
  assert step == 6 and int(state['step']) == 6


def test_a_remote_step_directory_without_its_commit_file_is_not_a_step(gcs):
  for step, commit in ((2, True), (4, False)):
    directory = gcs / 'bucket/run/checkpoints' / str(step)
    directory.mkdir(parents=True)
    if commit:
      (directory / runs.COMMIT_FILE).write_text('')
  (gcs / 'bucket/run/config.json').write_text('{}')
  run = runs.RunDir(WORKDIR + '/')
  assert run.path == WORKDIR and run.is_run()
  assert run.steps() == [2]  # 4: a save written in place and not (yet) committed
