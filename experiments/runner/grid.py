"""The grid scheduler: runs as subprocesses, one LOCK per run directory, attempts, signals.

`run_grid` starts what is not finished, `parallel` at a time; the state lives in the run
directories (`files`), so a killed grid is resumed by running it again. `status` reads that
state back.
"""

import argparse
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
import ctypes
import dataclasses
import datetime
import fcntl
import fnmatch
import json
import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from experiments.runner import files
from experiments.runner.files import (
    ATTEMPTS_FILE,
    DONE_FILE,
    LOCK_FILE,
    LOG_FILE,
    METRICS_FILE,
    RESULTS_FILE,
)
from experiments.runner.provenance import REPO_ROOT, code_version, default_runs_dir, machine
from experiments.runner.results import another_run, read_run, thin_entry

_NAME = re.compile(r'[A-Za-z0-9][A-Za-z0-9._=,+-]{0,199}')
_ENTRY_KEYS = (
    'name',
    'seed',
    'config',
    'command',
    'wall_time_s',
    'wall_time_total_s',
    'attempts',
    'finished',
    'machine',
    'code',
)


@dataclasses.dataclass(frozen=True)
class Run:
  """One run of a grid: a name (its directory), a command and how to read its results.

  `command` is an argv list; `{rundir}` in any argument becomes the run's directory (also in
  the environment as RUN_DIR). `config` and `seed` are recorded in results.json as given.
  `collect(rundir) -> dict` reads the results of a run that exited 0 (default: `read_run`);
  its keys join the run's entry in results.json. `then`: argv lists run after `command` exits
  0, in the same attempt (an evaluation that would otherwise hold up the grid's `collect`
  while other runs wait to start); they are not part of the command that says whether a
  finished run is the same run.
  """

  name: str
  command: Sequence[str]
  config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  seed: int | None = None
  collect: Callable[[pathlib.Path], dict[str, Any]] | None = None
  env: Mapping[str, str] | None = None
  then: Sequence[Sequence[str]] = ()

  def __post_init__(self):
    if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
      raise ValueError(
          f'Run name {self.name!r}: it names a directory, so use letters, digits '
          'and ._=,+- only (at most 200 characters, not starting with . or -)'
      )
    if isinstance(self.command, str) or not self.command:
      raise ValueError(
          f'Run {self.name!r}: command must be a non-empty argv list, ' f'got {self.command!r}'
      )
    object.__setattr__(self, 'command', tuple(str(arg) for arg in self.command))
    if any(isinstance(c, str) or not c for c in self.then):
      raise ValueError(f'Run {self.name!r}: then must hold non-empty argv lists, got {self.then!r}')
    object.__setattr__(self, 'then', tuple(tuple(str(a) for a in c) for c in self.then))
    try:
      json.dumps({'config': dict(self.config), 'seed': self.seed})
    except TypeError as e:
      raise ValueError(f'Run {self.name!r}: config and seed must be JSON values ({e})') from None


def train_run(
    name: str, config: str, *, seed: int = 0, overrides: Mapping[str, Any] | None = None, **kwargs
) -> Run:
  """A `python -m lowrank_attn.main` run whose workdir is the run directory.

  `config` is the `--config` argument ('configs/nmt.py:multi30k'); `overrides` maps config
  fields to values ({'model.encoder_attention.key_dim': 32}) and, with `config`, is recorded
  as the run's config. Other arguments go to `Run`.
  """
  overrides = dict(overrides or {})
  if 'seed' in overrides:
    raise ValueError(f'Run {name!r}: pass the seed as seed=, not in overrides')
  command = [
      sys.executable,
      '-m',
      'lowrank_attn.main',
      f'--config={config}',
      '--workdir={rundir}',
      f'--config.seed={seed}',
  ]
  command += [f'--config.{key}={value}' for key, value in overrides.items()]
  return Run(name, command, config={'config': config, **overrides}, seed=seed, **kwargs)


def arg_parser(description: str | None, experiment: str) -> argparse.ArgumentParser:
  """The flags every experiment script shares; add the script's own to the parser."""
  parser = argparse.ArgumentParser(
      description=description, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument(
      '--runs_dir',
      default=str(default_runs_dir(experiment)),
      help='where the run directories go (default: %(default)s); put it '
      'outside the work tree to keep runs across sessions',
  )
  parser.add_argument('--parallel', type=int, default=1, help='runs at a time')
  parser.add_argument(
      '--pin_cpus',
      action='store_true',
      help='give each of the --parallel runs its own share of the CPUs (and with one CPU each, '
      'single-threaded XLA): more runs per hour on a CPU-only machine than runs sharing them',
  )
  parser.add_argument(
      '--refresh', action='store_true', help='collect the metrics of finished runs again'
  )
  parser.add_argument(
      '--take_runs',
      type=_comma_list,
      default=[],
      metavar='NAME,...',
      help='runs whose directories hold another run of the command results.json records (run '
      "again elsewhere under the same name): the directories' runs replace the records",
  )
  parser.add_argument(
      '--only',
      type=_comma_list,
      default=[],
      metavar='PATTERN,...',
      help='start only the runs whose names match one of these shell patterns (fnmatch: '
      "'concat-h32-*-24000st-s0'); the others wait for another invocation, their records kept",
  )
  parser.add_argument(
      '--plot_only',
      action='store_true',
      help='skip the runs; tables and plots from the existing results.json',
  )
  return parser


def _comma_list(text: str) -> list[str]:
  """'a,,b,' -> ['a', 'b']: a flag's comma-separated names or patterns."""
  return [item for item in text.split(',') if item]


def grid_options(args: argparse.Namespace) -> dict[str, Any]:
  """`run_grid`'s keyword arguments from the flags of `arg_parser`."""
  return {
      'parallel': args.parallel,
      'refresh': args.refresh,
      'pin_cpus': args.pin_cpus,
      'take_runs': args.take_runs,
      'only': args.only,
  }


def run_grid(
    runs: Iterable[Run],
    out_dir: str | os.PathLike,
    *,
    runs_dir: str | os.PathLike | None = None,
    parallel: int = 1,
    cwd: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    refresh: bool = False,
    rerun_lost: bool | Collection[str] = False,
    take_runs: Collection[str] = (),
    only: Collection[str] = (),
    pin_cpus: bool = False,
    tail_lines: int = 20,
    stop_timeout_s: float = 120.0,
    exit_on_failure: bool = True,
) -> dict[str, Any]:
  """Runs what is not finished yet, `parallel` at a time; returns results.json's content.

  out_dir: the experiment folder; `<out_dir>/results.json` gets every finished run, in grid
    order, after each run that finishes (atomically), plus the failed and unfinished names.
    Entries it already holds for runs not in `runs` are kept (after them); a run whose
    directory is gone (a fresh machine) but whose entry it holds, with the same command up to
    the interpreter's path and the runs directory named in its arguments, counts as finished:
    commit results.json and a grid resumes anywhere. Each write merges the file as it is then
    (under a lock on `out_dir`), so grids of one experiment may run side by side.
  runs_dir: the run directories' root (default `default_runs_dir(<out_dir's name>)`). A run
    directory whose DONE records another command (up to the interpreter's path and the runs
    directory) is another run under the same name: ValueError before anything runs. So is
    one whose DONE records another finish time than the entry results.json holds for it (the
    same command run twice: lost here and made again elsewhere, or the other way round),
    unless `take_runs` or `rerun_lost` names it: a record is never replaced without a word.
  cwd: the commands' working directory (default: the repository root); env: extra variables.
  refresh: collect finished runs again (after changing a collector), rewriting their DONE.
  rerun_lost: a run recorded in results.json whose directory is gone runs again instead of
    counting as finished; its old entry stays in results.json until the new run finishes.
    True for every such run, or the names of those to run again: the runs whose directories
    later runs still to do start from (a checkpoint to fine-tune), which a record cannot
    stand in for.
  take_runs: the names of runs whose directories hold another run of the recorded command
    (e.g. another experiment sharing the runs directory ran it again): the directory's run
    replaces the record, and is what runs that start from it start from. Unlike `rerun_lost`,
    a named run whose directory is gone counts as finished. Names not in `runs` are ignored,
    so that one `--take_runs` serves an experiment's successive grids (a name mistyped leaves
    the record, and the error, as they were).
  only: shell patterns (`fnmatch`); when given, only the unfinished runs whose names match one
    are started, the others are left for another invocation (a subset of a grid on a slow
    machine). Finished runs are collected and recorded as always. A pattern matching no run
    of the grid gets a line saying so (one `--only` may serve an experiment's several grids).
  pin_cpus: split the CPUs this process may use into `parallel` equal slots, each running
    command bound to one (`sched_setaffinity`); with one CPU per slot, XLA runs single-threaded
    (XLA_FLAGS). On a 2-core CPU two pinned Multi30k trainings make 0.64 steps/s together
    against 0.55 for one using both cores, and 0.60 pinned without the XLA flags.
  A failed run (non-zero exit, or its collector raised) is reported with the end of its log
  and the others go on; at the end, `exit_on_failure` exits with status 1 if any failed.
  SIGINT or SIGTERM sends SIGTERM to the running commands (our training CLI saves a
  checkpoint), SIGKILL after `stop_timeout_s`, and exits with 130 or 143; if this process is
  killed outright, its commands get SIGTERM from the kernel (Linux). Rerun to resume.
  """
  runs = list(runs)
  names = [run.name for run in runs]
  duplicates = sorted({name for name in names if names.count(name) > 1})
  if duplicates:
    raise ValueError(f'Run names must be unique; repeated: {duplicates}')
  if parallel < 1:
    raise ValueError(f'parallel must be >= 1, got {parallel}')
  slots = cpu_slots(parallel) if pin_cpus else None
  out_dir = pathlib.Path(out_dir).resolve()
  runs_dir = pathlib.Path(runs_dir or default_runs_dir(out_dir.name)).resolve()
  out_dir.mkdir(parents=True, exist_ok=True)
  runs_dir.mkdir(parents=True, exist_ok=True)
  grid = _Grid(
      runs,
      out_dir / RESULTS_FILE,
      runs_dir,
      parallel=parallel,
      cpu_slots=slots,
      cwd=pathlib.Path(cwd or REPO_ROOT),
      env=dict(env or {}),
      tail_lines=tail_lines,
      stop_timeout_s=stop_timeout_s,
  )
  grid.run(refresh=refresh, rerun_lost=rerun_lost, take_runs=take_runs, only=only)
  if grid.failed and exit_on_failure:
    raise SystemExit(
        f'grid: {len(grid.failed)} of {len(runs)} runs failed: '
        f'{grid.failed_summary()} (reports above; rerun to retry them)'
    )
  return grid.results()


class _Interrupted(Exception):

  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum


@dataclasses.dataclass
class _Attempt:
  run: Run
  rundir: pathlib.Path
  number: int
  proc: subprocess.Popen
  lock_fd: int
  log_offset: int
  start: float
  cpus: tuple[int, ...] | None = None


class _Grid:
  """The scheduler behind `run_grid`: state in the run directories, one results file."""

  def __init__(
      self,
      runs,
      results_path,
      runs_dir,
      *,
      parallel,
      cwd,
      env,
      tail_lines,
      stop_timeout_s,
      cpu_slots=None,
  ):
    self.runs, self.results_path, self.runs_dir = runs, results_path, runs_dir
    self.parallel, self.cwd, self.env = parallel, cwd, env
    self.free_slots = list(cpu_slots or [])  # --pin_cpus: the CPU sets not in use
    self.tail_lines, self.stop_timeout_s = tail_lines, stop_timeout_s
    self.done: dict[str, dict] = {}
    self.failed: dict[str, str] = {}  # name -> why
    self.machine = machine()
    # results.json as found: runs of other invocations (e.g. --tasks=a then --tasks=b) are
    # kept, and a run whose directory is gone (a new machine) counts as finished if the
    # committed file has it with the same command.
    found = (files.read_json(results_path) or {}).get('runs', [])
    names = {run.name for run in runs}
    self.recorded = {entry['name']: entry for entry in found if entry['name'] in names}
    self.kept = [entry for entry in found if entry['name'] not in names]
    self.previous: dict[str, dict] = {}  # --rerun_lost: old entries until their reruns finish

  def rundir(self, run: Run) -> pathlib.Path:
    return self.runs_dir / run.name

  def run(
      self,
      refresh: bool,
      rerun_lost: bool | Collection[str] = False,
      take_runs: Collection[str] = (),
      only: Collection[str] = (),
  ) -> None:
    again = set() if isinstance(rerun_lost, bool) else set(rerun_lost)
    unknown = sorted(again - {run.name for run in self.runs})
    if unknown:
      raise ValueError(f'grid: rerun_lost names runs that are not in the grid: {unknown}')
    take = set(take_runs)
    conflicts, replaced = [], {}
    for run in self.runs:
      entry = files.read_json(self.rundir(run) / DONE_FILE)
      if entry is None:
        entry = self.recorded.get(run.name)
        if entry is None or not _same_command(entry['command'], run.command, self.runs_dir):
          continue
        if rerun_lost is True or run.name in again:
          _say(
              f'grid: {run.name} is recorded as finished, but its run directory holds no DONE '
              '(it was lost)'
              + (', and runs still to do start from it' if again else '')
              + ': running it again'
          )
          self.previous[run.name] = entry
          continue
        _say(
            f'grid: {run.name} finished earlier (in {self.results_path.name}; its run '
            'directory is gone)'
        )
        self.done[run.name] = entry
        continue
      if refresh:
        entry = self._refresh(run, entry)
      if not _same_command(entry.get('command', run.command), run.command, self.runs_dir):
        conflicts.append(
            f'{run.name}: its directory holds a run of\n  {_quote(entry["command"])}\n'
            f'  this grid runs\n  {_quote(run.command)}'
        )
      record = self.recorded.get(run.name)
      if record is not None and another_run(record, entry):
        if rerun_lost is True or run.name in again or run.name in take:
          _say(
              f'grid: {run.name} ran again since the record in {self.results_path.name}, '
              f'finished {record["finished"]}{_on(record)}: the run in its directory, finished '
              f'{entry["finished"]}{_on(entry)}, replaces it'
              + (' (take_runs)' if run.name in take else ' (rerun_lost)')
          )
          # Another experiment sharing the runs directory may have made it: this grid's
          # description of the run (its config) goes with the command both ran.
          entry = {**entry, 'config': dict(run.config)}
        else:
          replaced[run.name] = (
              f'{run.name}: {self.results_path.name} records the run that finished '
              f'{record["finished"]}{_on(record)}, its directory holds one that finished '
              f'{entry["finished"]}{_on(entry)}'
          )
      self.done[run.name] = entry
    if replaced:  # same command, another run: its record would be lost without a word
      raise ValueError(
          f'grid: {len(replaced)} run directories in {self.runs_dir} hold other runs of the '
          'command than the ones results.json records (e.g. the run was lost and made again '
          'elsewhere):\n' + '\n'.join(replaced.values()) + '\nTo keep the records, move those '
          'directories away (or delete their DONE files to run them again); to take the '
          "directories' runs, name them in take_runs (an experiment script's --take_runs="
          f"{','.join(replaced)}; or delete their "
          f'entries from {self.results_path}).'
      )
    if conflicts:  # another run under this name: its results are not this grid's
      raise ValueError(
          f'grid: {len(conflicts)} run directories in {self.runs_dir} hold finished runs of '
          'other commands:\n' + '\n'.join(conflicts) + '\nGive the grid another runs '
          'directory (or its runs other names), or delete their DONE files to run them again.'
      )
    todo = [run for run in self.runs if run.name not in self.done]
    left = []
    if only:
      for pattern in only:
        if not any(fnmatch.fnmatchcase(run.name, pattern) for run in self.runs):
          _say(f'grid: --only {pattern!r} matches no run of this grid')
      picked = [any(fnmatch.fnmatchcase(run.name, p) for p in only) for run in todo]
      left = [run for run, pick in zip(todo, picked) if not pick]
      todo = [run for run, pick in zip(todo, picked) if pick]
    _say(
        f'grid: {len(self.runs)} runs in {self.runs_dir}: {len(self.done)} finished, '
        f'{len(todo)} to run'
        + (f', {len(left)} left for another invocation (--only)' if left else '')
        + f'; results in {self.results_path}'
    )
    self.write_results()
    previous = self._install_signal_handlers()
    running: list[_Attempt] = []
    try:
      self._schedule(todo, running)
    except (_Interrupted, KeyboardInterrupt) as e:
      signum = e.signum if isinstance(e, _Interrupted) else signal.SIGINT
      self._stop(running)
      self.write_results()
      _say(
          f'grid: interrupted by {signal.Signals(signum).name}; {len(self.done)}/'
          f'{len(self.runs)} runs finished; rerun the same command to resume the others',
          err=True,
      )
      raise SystemExit(128 + signum) from None
    finally:
      for signum, handler in previous.items():
        signal.signal(signum, handler)
    _say(
        f'grid: {len(self.done)}/{len(self.runs)} runs finished'
        + (f'; failed: {self.failed_summary()}' if self.failed else '')
    )

  def _schedule(self, queue: list[Run], running: list[_Attempt]) -> None:
    said_waiting = set()
    while queue or running:
      changed = False
      for run in list(queue):
        if len(running) >= self.parallel:
          break
        rundir = self.rundir(run)
        rundir.mkdir(parents=True, exist_ok=True)
        lock_fd = _try_lock(rundir / LOCK_FILE)
        if lock_fd is None:  # a command of an earlier, killed grid is still finishing
          if run.name not in said_waiting:
            said_waiting.add(run.name)
            _say(
                f'grid: waiting for {run.name}: {rundir / LOCK_FILE} is held by another '
                f'process ({_lock_owner(rundir)})'
            )
          continue
        queue.remove(run)
        changed = True
        entry = files.read_json(rundir / DONE_FILE)
        if entry is not None:  # finished by another grid meanwhile
          os.close(lock_fd)
          self.done[run.name] = entry
          self.write_results()
          continue
        attempt = self._start(run, rundir, lock_fd)
        if attempt is not None:
          running.append(attempt)
      for attempt in list(running):
        if attempt.proc.poll() is not None:
          running.remove(attempt)
          self._finish(attempt)
          changed = True
      if not changed:
        time.sleep(0.05)

  def _start(self, run: Run, rundir: pathlib.Path, lock_fd: int) -> _Attempt | None:
    number = sum('start' in line for line in files.read_jsonl(rundir / ATTEMPTS_FILE)) + 1
    argv = [arg.replace('{rundir}', str(rundir)) for arg in run.command]
    if run.then:
      chain = [argv] + [[arg.replace('{rundir}', str(rundir)) for arg in c] for c in run.then]
      argv = [sys.executable, '-m', 'experiments.runner.chain', json.dumps(chain)]
    env = {
        **os.environ,
        **self.env,
        **(run.env or {}),
        'RUN_DIR': str(rundir),
        'PYTHONUNBUFFERED': '1',
    }
    cpus = self.free_slots.pop(0) if self.free_slots else None
    if cpus is not None and len(cpus) == 1:
      env['XLA_FLAGS'] = f"{env.get('XLA_FLAGS', '')} {SINGLE_THREADED_XLA}".strip()
    with open(rundir / LOG_FILE, 'ab') as log:
      log.write(f'=== attempt {number} at {_now()}: {_quote(argv)}\n'.encode())
      log.flush()
      offset = log.tell()
      code = code_version(self.cwd)
      files.append_jsonl(rundir / ATTEMPTS_FILE, {'attempt': number, 'start': _now(), 'code': code})
      start = time.monotonic()
      try:
        # Own session: a terminal's Ctrl-C reaches only the grid, which stops commands with
        # SIGTERM (our training CLI checkpoints on it). The LOCK descriptor is inherited, so
        # the lock lives as long as the command, even if the grid dies first.
        proc = subprocess.Popen(
            argv,
            cwd=self.cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            pass_fds=(lock_fd,),
            preexec_fn=_child_setup(cpus),
        )
      except OSError as e:
        if cpus is not None:
          self.free_slots.append(cpus)
        files.append_jsonl(
            rundir / ATTEMPTS_FILE,
            {'attempt': number, 'end': _now(), 'returncode': None, 'wall_time_s': 0.0},
        )
        os.close(lock_fd)
        self._fail(run, rundir, f'could not start: {e}', tail='')
        return None
    os.write(lock_fd, f'command pid {proc.pid}\n'.encode())
    on = f' on CPUs {",".join(map(str, cpus))}' if cpus is not None else ''
    _say(
        f'grid: start {run.name} (attempt {number}{", resuming" if number > 1 else ""}){on}, '
        f'log {rundir / LOG_FILE}'
    )
    if code['modified']:
      _say(
          f'grid: warning: {run.name} runs the uncommitted changes to '
          f'{", ".join(code["modified"])} in {self.cwd}: edits made while it runs reach it '
          'at its next (re)start.'
      )
    return _Attempt(run, rundir, number, proc, lock_fd, offset, start, cpus)

  def _finish(self, attempt: _Attempt) -> None:
    if attempt.cpus is not None:
      self.free_slots.append(attempt.cpus)
    run, rundir, code = attempt.run, attempt.rundir, attempt.proc.returncode
    wall = round(time.monotonic() - attempt.start, 3)
    try:
      files.append_jsonl(
          rundir / ATTEMPTS_FILE,
          {'attempt': attempt.number, 'end': _now(), 'returncode': code, 'wall_time_s': wall},
      )
      attempts = files.read_jsonl(rundir / ATTEMPTS_FILE)
      total = attempts_wall_time(rundir)
      if code != 0:
        self._fail(
            run,
            rundir,
            f'{_describe_exit(code)} after {wall:.1f} s',
            tail=_tail(rundir / LOG_FILE, attempt.log_offset, self.tail_lines),
        )
        return
      try:
        collected = _collect(run, rundir)
      except Exception as e:  # pylint: disable=broad-except
        self._fail(
            run,
            rundir,
            f'exited 0 but collecting its results failed: ' f'{type(e).__name__}: {e}',
            tail='',
        )
        return
      entry = {
          'name': run.name,
          'seed': run.seed,
          'config': dict(run.config),
          'command': list(run.command),
          'wall_time_s': wall,
          'wall_time_total_s': round(total, 3),
          'attempts': attempt.number,
          'finished': _now(),
          'machine': self.machine,
          'code': [a['code'] for a in attempts if 'code' in a],
          **collected,
      }
      files.write_json(rundir / DONE_FILE, entry)  # the run counts as finished from here on
      self.done[run.name] = entry
      self.failed.pop(run.name, None)
      self.write_results()
      _say(f'grid: done {run.name} in {wall:.1f} s ({len(self.done)}/{len(self.runs)} finished)')
    finally:
      os.close(attempt.lock_fd)  # after DONE: a waiting grid then sees the run as finished

  def _fail(self, run: Run, rundir: pathlib.Path, why: str, tail: str) -> None:
    self.failed[run.name] = why
    self.write_results()
    report = f'grid: FAILED {run.name}: {why}; log {rundir / LOG_FILE}'
    if tail:
      report += ', ending:\n' + '\n'.join('  | ' + line for line in tail.splitlines())
    _say(report, err=True)

  def _refresh(self, run: Run, entry: dict) -> dict:
    collected = _collect(run, self.rundir(run))
    entry = {key: entry[key] for key in _ENTRY_KEYS if key in entry} | collected
    if (self.rundir(run) / ATTEMPTS_FILE).exists():  # runs of an old runner may have none
      entry['wall_time_total_s'] = round(attempts_wall_time(self.rundir(run)), 3)
    files.write_json(self.rundir(run) / DONE_FILE, entry)
    return entry

  def _stop(self, running: list[_Attempt]) -> None:
    if not running:
      return
    _say(
        f'grid: stopping {", ".join(a.run.name for a in running)} (SIGTERM, SIGKILL after '
        f'{self.stop_timeout_s:g} s)',
        err=True,
    )
    for attempt in running:
      _signal_group(attempt.proc, signal.SIGTERM)
    deadline = time.monotonic() + self.stop_timeout_s
    try:
      for attempt in running:
        try:
          attempt.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
          _signal_group(attempt.proc, signal.SIGKILL)
    except (KeyboardInterrupt, _Interrupted):  # asked twice: do not wait for checkpoints
      for attempt in running:
        _signal_group(attempt.proc, signal.SIGKILL)
    for attempt in running:
      attempt.proc.wait()
      files.append_jsonl(
          attempt.rundir / ATTEMPTS_FILE,
          {
              'attempt': attempt.number,
              'end': _now(),
              'returncode': attempt.proc.returncode,
              'wall_time_s': round(time.monotonic() - attempt.start, 3),
              'interrupted': True,
          },
      )
      os.close(attempt.lock_fd)

  def _install_signal_handlers(self) -> dict:
    if threading.current_thread() is not threading.main_thread():
      return {}  # signal handlers can only be set there; Ctrl-C still raises KeyboardInterrupt

    def handler(signum, frame):
      del frame
      raise _Interrupted(signum)

    return {signum: signal.signal(signum, handler) for signum in (signal.SIGINT, signal.SIGTERM)}

  def failed_summary(self) -> str:
    return ', '.join(f'{name} ({why.split(";")[0]})' for name, why in self.failed.items())

  def results(self) -> dict[str, Any]:
    """results.json's content; each run's train lines thinned (`results.thin_train`)."""
    entries = [
        self.done.get(run.name) or self.previous[run.name]
        for run in self.runs
        if run.name in self.done or run.name in self.previous
    ] + self.kept
    return {
        'runs_dir': str(self.runs_dir),
        'runs': [thin_entry(entry) for entry in entries],
        'failed': [{'name': name, 'why': why} for name, why in self.failed.items()],
        'unfinished': [
            run.name
            for run in self.runs
            if run.name not in self.done and run.name not in self.failed
        ],
    }

  def write_results(self) -> None:
    """results.json as it is now, merged: another grid writing the same file meanwhile (two
    stages of one experiment side by side) keeps its entries; this grid's runs are its own."""
    with files.results_lock(self.results_path):
      names = {run.name for run in self.runs}
      found = (files.read_json(self.results_path) or {}).get('runs', [])
      self.kept = [entry for entry in found if entry['name'] not in names]
      files.write_json(self.results_path, self.results())


def _on(entry: Mapping[str, Any]) -> str:
  gpus = entry.get('machine', {}).get('gpus')
  return f' on {", ".join(gpus)}' if gpus else ''


def status(runs_dir: str | os.PathLike) -> list[dict[str, Any]]:
  """The state of each run directory: done, running, failed, interrupted or new."""
  out = []
  for rundir in sorted(p for p in pathlib.Path(runs_dir).iterdir() if p.is_dir()):
    attempts = files.read_jsonl(rundir / ATTEMPTS_FILE)
    info = {'name': rundir.name, 'attempts': sum('start' in a for a in attempts)}
    done = files.read_json(rundir / DONE_FILE)
    lock_fd = _try_lock(rundir / LOCK_FILE) if (rundir / LOCK_FILE).exists() else None
    if lock_fd is not None:
      os.close(lock_fd)
    if done is not None:
      info.update(state='done', wall_time_s=done.get('wall_time_s'))
    elif (rundir / LOCK_FILE).exists() and lock_fd is None:
      info['state'] = 'running'
    elif not attempts:
      info['state'] = 'new'
    elif 'end' in attempts[-1] and not attempts[-1].get('interrupted'):
      info.update(state='failed', returncode=attempts[-1].get('returncode'))
    else:
      info['state'] = 'interrupted'
    out.append(info)
  return out


def _same_command(
    recorded: Sequence[str], command: Sequence[str], runs_dir: pathlib.Path | None = None
) -> bool:
  """The same command up to the interpreter's path (another checkout's virtualenv) and, where
  an argument holds this grid's `runs_dir` (a data set prepared beside the runs, say), up to
  the runs directory it held when recorded (another machine's)."""
  recorded, command = list(recorded)[1:], list(command)[1:]
  if len(recorded) != len(command):
    return False
  here = str(runs_dir) if runs_dir is not None else None
  for old, new in zip(recorded, command):
    if old == new:
      continue
    if not here or here not in new:
      return False
    before, _, after = new.partition(here)
    if not re.fullmatch(re.escape(before) + '/.+' + re.escape(after), old):
      return False
  return True


def attempts_wall_time(rundir: pathlib.Path) -> float:
  """Seconds that all of a run's attempts ran. An attempt killed together with its grid (the
  machine taken away, SIGKILL) wrote no end to attempts.jsonl: its time runs from its start to
  the last timestamped line the run wrote to metrics.jsonl before the next attempt started, short
  by at most one logging interval (0 where it wrote none)."""
  attempts = files.read_jsonl(rundir / ATTEMPTS_FILE)
  starts = {
      a['attempt']: datetime.datetime.fromisoformat(a['start']).timestamp()
      for a in attempts
      if 'start' in a
  }
  ended = {a['attempt']: a.get('wall_time_s', 0.0) for a in attempts if 'end' in a}
  times = [
      line['time']
      for line in files.read_jsonl(rundir / METRICS_FILE)
      if isinstance(line.get('time'), (int, float))
  ]
  total = sum(ended.values())
  order = sorted(starts)
  for number, after in zip(order, order[1:] + [None]):
    if number in ended:
      continue
    # Starts are stamped to the second, rounded down: the next attempt's may read up to a second
    # before this one's last line (a training command writes none in its first second).
    start, stop = starts[number], starts[after] + 1 if after is not None else float('inf')
    last = max((t for t in times if start <= t < stop), default=start)
    total += last - start
  return total


def _collect(run: Run, rundir: pathlib.Path) -> dict[str, Any]:
  collected = dict((run.collect or read_run)(rundir))
  clash = sorted(set(collected) & set(_ENTRY_KEYS))
  if clash:
    raise ValueError(f'collector returned reserved keys {clash}')
  json.dumps(collected)  # fail here, not halfway through writing DONE
  return collected


def _try_lock(path: pathlib.Path) -> int | None:
  """An exclusive flock on `path` (its descriptor), or None if another process holds it."""
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    os.close(fd)
    return None
  os.ftruncate(fd, 0)
  os.write(fd, f'grid pid {os.getpid()}\n'.encode())
  return fd


def _lock_owner(rundir: pathlib.Path) -> str:
  try:
    return (rundir / LOCK_FILE).read_text().strip().replace('\n', ', ')
  except OSError:
    return 'unknown'


SINGLE_THREADED_XLA = '--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1'


def cpu_slots(parallel: int) -> list[tuple[int, ...]]:
  """The CPUs this process may use, split into `parallel` equal sets (the rest unused)."""
  if not hasattr(os, 'sched_getaffinity'):
    raise ValueError('pin_cpus binds runs to CPUs with sched_setaffinity: Linux only.')
  usable = sorted(os.sched_getaffinity(0))
  if not 1 <= parallel <= len(usable):
    raise ValueError(
        f'pin_cpus: {parallel} parallel runs cannot each have a CPU of their own: this process '
        f'may use {len(usable)} ({",".join(map(str, usable))}).'
    )
  size = len(usable) // parallel
  return [tuple(usable[i * size : (i + 1) * size]) for i in range(parallel)]


def _child_setup(cpus: tuple[int, ...] | None = None):
  """A preexec_fn binding the command to `cpus` (if given) and asking Linux to SIGTERM it
  when the grid dies (None off Linux, where neither is done)."""
  if not sys.platform.startswith('linux'):
    return None
  prctl = ctypes.CDLL(None, use_errno=True).prctl
  parent = os.getpid()

  def preexec():
    if cpus is not None:
      os.sched_setaffinity(0, cpus)
    prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the grid died before prctl took effect
      os.kill(os.getpid(), signal.SIGTERM)

  return preexec


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
  try:
    os.killpg(proc.pid, signum)  # the command and whatever it started
  except (ProcessLookupError, PermissionError):
    pass


def _describe_exit(code: int) -> str:
  if code < 0:
    try:
      return f'killed by {signal.Signals(-code).name}'
    except ValueError:
      return f'killed by signal {-code}'
  return f'exit code {code}'


def _tail(path: pathlib.Path, offset: int, lines: int) -> str:
  with open(path, 'rb') as f:
    f.seek(offset)
    text = f.read().decode(errors='replace')
  return '\n'.join(text.rstrip('\n').splitlines()[-lines:]) if text.strip() else '(empty)'


def _quote(argv: Sequence[str]) -> str:
  return shlex.join(argv)


def _now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')


def _say(line: str, err: bool = False) -> None:
  print(line, file=sys.stderr if err else sys.stdout, flush=True)
