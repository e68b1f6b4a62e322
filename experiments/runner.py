"""A grid of runs as subprocesses: resumable, one `results.json`, plots and README tables.

An experiment script builds `Run`s and hands them to `run_grid`:

    runs = [train_run(f'kd{k}-s{s}', 'configs/nmt.py:multi30k', seed=s,
                      overrides={'model.encoder_attention.key_dim': k})
            for k in (16, 32, 64) for s in (0, 1, 2)]
    results = run_grid(runs, 'experiments/key_width', runs_dir=args.runs_dir)
    rows = final(results, split='test')
    plot_lines(rows, x='model.encoder_attention.key_dim', y='bleu', out='.../bleu.png')

Each run owns `<runs_dir>/<name>/` (its command's `{rundir}`): `log.txt` (stdout and stderr of
every attempt), `attempts.jsonl`, `LOCK` and, once the command exited 0, `DONE`: a JSON object
with the run's seed, config, command, wall time, machine and collected metrics. A rerun skips
runs with a DONE file and starts the others again; our training CLI resumes from the
checkpoints in its workdir, so an interrupted training run continues where it stopped.
`results.json` in the experiment folder is rebuilt from the DONE files after every finished run.
Each attempt records the code it ran (`code`: the commit of the commands' checkout and the
tracked Python files modified in it), because a command imports the code anew at every (re)start: a
grid run from a tree someone is editing says so in its log, its attempts and its DONE entry.
Run long grids from a checkout nobody edits (`git worktree add ../exp HEAD`).

`python -m experiments.runner status RUNS_DIR` lists the state of each run directory.
"""

import argparse
from collections.abc import Callable, Iterable, Mapping, Sequence
import ctypes
import dataclasses
import datetime
import fcntl
import importlib.metadata
import json
import math
import os
import pathlib
import platform
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from typing import Any

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS_FILE = 'results.json'
DONE_FILE = 'DONE'
LOG_FILE = 'log.txt'
LOCK_FILE = 'LOCK'
ATTEMPTS_FILE = 'attempts.jsonl'
METRICS_FILE = 'metrics.jsonl'  # written by lowrank_attn.train.metrics.MetricWriter
RESULT_FILE = 'result.json'  # optional: whatever a command wants to report itself
RUNS_ENV = 'LOWRANK_ATTN_RUNS'  # root of run directories that outlive the work tree
_NAME = re.compile(r'[A-Za-z0-9][A-Za-z0-9._=,+-]{0,199}')
_ENTRY_KEYS = ('name', 'seed', 'config', 'command', 'wall_time_s', 'wall_time_total_s',
               'attempts', 'finished', 'machine', 'code')


@dataclasses.dataclass(frozen=True)
class Run:
  """One run of a grid: a name (its directory), a command and how to read its results.

  `command` is an argv list; `{rundir}` in any argument becomes the run's directory (also in
  the environment as RUN_DIR). `config` and `seed` are recorded in results.json as given.
  `collect(rundir) -> dict` reads the results of a run that exited 0 (default: `read_run`);
  its keys join the run's entry in results.json.
  """
  name: str
  command: Sequence[str]
  config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  seed: int | None = None
  collect: Callable[[pathlib.Path], dict[str, Any]] | None = None
  env: Mapping[str, str] | None = None

  def __post_init__(self):
    if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
      raise ValueError(f'Run name {self.name!r}: it names a directory, so use letters, digits '
                       'and ._=,+- only (at most 200 characters, not starting with . or -)')
    if isinstance(self.command, str) or not self.command:
      raise ValueError(f'Run {self.name!r}: command must be a non-empty argv list, '
                       f'got {self.command!r}')
    object.__setattr__(self, 'command', tuple(str(arg) for arg in self.command))
    try:
      json.dumps({'config': dict(self.config), 'seed': self.seed})
    except TypeError as e:
      raise ValueError(f'Run {self.name!r}: config and seed must be JSON values ({e})') from None


def train_run(name: str, config: str, *, seed: int = 0,
              overrides: Mapping[str, Any] | None = None, **kwargs) -> Run:
  """A `python -m lowrank_attn.main` run whose workdir is the run directory.

  `config` is the `--config` argument ('configs/nmt.py:multi30k'); `overrides` maps config
  fields to values ({'model.encoder_attention.key_dim': 32}) and, with `config`, is recorded
  as the run's config. Other arguments go to `Run`.
  """
  overrides = dict(overrides or {})
  if 'seed' in overrides:
    raise ValueError(f'Run {name!r}: pass the seed as seed=, not in overrides')
  command = [sys.executable, '-m', 'lowrank_attn.main', f'--config={config}',
             '--workdir={rundir}', f'--config.seed={seed}']
  command += [f'--config.{key}={value}' for key, value in overrides.items()]
  return Run(name, command, config={'config': config, **overrides}, seed=seed, **kwargs)


def read_metrics(rundir: str | os.PathLike) -> list[dict[str, Any]]:
  """`<rundir>/metrics.jsonl`, keeping the last line per (split, step), sorted by both.

  A resumed run appends the steps after its checkpoint again, so the last line is the one
  that led to the final state. A line cut short by a kill is skipped.
  """
  path = pathlib.Path(rundir) / METRICS_FILE
  if not path.exists():
    return []
  last = {}
  with open(path) as f:
    for line in f:
      try:
        entry = json.loads(line)
        key = (str(entry['split']), int(entry['step']))
      except (ValueError, KeyError, TypeError):
        continue
      last[key] = entry
  return [last[key] for key in sorted(last)]


def read_run(rundir: str | os.PathLike) -> dict[str, Any]:
  """The default collector: metrics.jsonl (without the hparams line), result.json, config.json.

  `metrics`: the lines of `read_metrics`; `result`: the run's own `result.json` ({} if none);
  `full_config`: the resolved config our training CLI writes (omitted if absent).
  """
  rundir = pathlib.Path(rundir)
  out = {'metrics': [m for m in read_metrics(rundir) if m['split'] != 'hparams'],
         'result': _read_json(rundir / RESULT_FILE) or {}}
  full_config = _read_json(rundir / 'config.json')
  if full_config is not None:
    out['full_config'] = full_config
  return out


def machine() -> dict[str, Any]:
  """Where this process runs: platform, CPU model and count, Python and JAX versions."""
  info = {'platform': platform.platform(), 'cpu': _cpu_model(), 'cpu_count': os.cpu_count()}
  if hasattr(os, 'sched_getaffinity'):
    info['cpus_available'] = len(os.sched_getaffinity(0))
  info['python'] = platform.python_version()
  for package in ('jax', 'jaxlib', 'flax'):
    try:
      info[package] = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
      pass
  return info


def code_version(checkout: str | os.PathLike) -> dict[str, Any]:
  """The code a command started in `checkout` runs: `commit` (None outside git) and
  `modified`, the tracked Python files that differ from it (not the results, READMEs and plots
  that grids write, nor untracked files)."""

  def git(*args):
    return subprocess.run(['git', '-C', str(checkout), *args], capture_output=True, text=True)

  head = git('rev-parse', 'HEAD')
  if head.returncode != 0:
    return {'commit': None, 'modified': []}
  status = git('status', '--porcelain', '--untracked-files=no').stdout.splitlines()
  modified = sorted(path for path in (line[3:] for line in status) if path.endswith('.py'))
  return {'commit': head.stdout.strip(), 'modified': modified}


def default_runs_dir(experiment: str) -> pathlib.Path:
  """`$LOWRANK_ATTN_RUNS/<experiment>` if set, else `runs/<experiment>` in the repository."""
  root = os.environ.get(RUNS_ENV)
  return pathlib.Path(root) / experiment if root else REPO_ROOT / 'runs' / experiment


def arg_parser(description: str | None, experiment: str) -> argparse.ArgumentParser:
  """The flags every experiment script shares; add the script's own to the parser."""
  parser = argparse.ArgumentParser(
      description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--runs_dir', default=str(default_runs_dir(experiment)),
                      help='where the run directories go (default: %(default)s); put it '
                           'outside the work tree to keep runs across sessions')
  parser.add_argument('--parallel', type=int, default=1, help='runs at a time')
  parser.add_argument('--refresh', action='store_true',
                      help='collect the metrics of finished runs again')
  parser.add_argument('--plot_only', action='store_true',
                      help='skip the runs; tables and plots from the existing results.json')
  return parser


def run_grid(runs: Iterable[Run], out_dir: str | os.PathLike, *,
             runs_dir: str | os.PathLike | None = None, parallel: int = 1,
             cwd: str | os.PathLike | None = None, env: Mapping[str, str] | None = None,
             refresh: bool = False, tail_lines: int = 20, stop_timeout_s: float = 120.0,
             exit_on_failure: bool = True) -> dict[str, Any]:
  """Runs what is not finished yet, `parallel` at a time; returns results.json's content.

  out_dir: the experiment folder; `<out_dir>/results.json` gets every finished run, in grid
    order, after each run that finishes (atomically), plus the failed and unfinished names.
  runs_dir: the run directories' root (default `default_runs_dir(<out_dir's name>)`).
  cwd: the commands' working directory (default: the repository root); env: extra variables.
  refresh: collect finished runs again (after changing a collector), rewriting their DONE.
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
  out_dir = pathlib.Path(out_dir).resolve()
  runs_dir = pathlib.Path(runs_dir or default_runs_dir(out_dir.name)).resolve()
  out_dir.mkdir(parents=True, exist_ok=True)
  runs_dir.mkdir(parents=True, exist_ok=True)
  grid = _Grid(runs, out_dir / RESULTS_FILE, runs_dir, parallel=parallel,
               cwd=pathlib.Path(cwd or REPO_ROOT), env=dict(env or {}), tail_lines=tail_lines,
               stop_timeout_s=stop_timeout_s)
  grid.run(refresh=refresh)
  if grid.failed and exit_on_failure:
    raise SystemExit(f'grid: {len(grid.failed)} of {len(runs)} runs failed: '
                     f'{grid.failed_summary()} (reports above; rerun to retry them)')
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


class _Grid:
  """The scheduler behind `run_grid`: state in the run directories, one results file."""

  def __init__(self, runs, results_path, runs_dir, *, parallel, cwd, env, tail_lines,
               stop_timeout_s):
    self.runs, self.results_path, self.runs_dir = runs, results_path, runs_dir
    self.parallel, self.cwd, self.env = parallel, cwd, env
    self.tail_lines, self.stop_timeout_s = tail_lines, stop_timeout_s
    self.done: dict[str, dict] = {}
    self.failed: dict[str, str] = {}  # name -> why
    self.machine = machine()

  def rundir(self, run: Run) -> pathlib.Path:
    return self.runs_dir / run.name

  def run(self, refresh: bool) -> None:
    for run in self.runs:
      entry = _read_json(self.rundir(run) / DONE_FILE)
      if entry is None:
        continue
      if refresh:
        entry = self._refresh(run, entry)
      if entry.get('command', list(run.command)) != list(run.command):
        _say(f'grid: note: {run.name} finished with another command '
             f'({_quote(entry["command"])}); delete {self.rundir(run) / DONE_FILE} to run it '
             'again')
      self.done[run.name] = entry
    todo = [run for run in self.runs if run.name not in self.done]
    _say(f'grid: {len(self.runs)} runs in {self.runs_dir}: {len(self.done)} finished, '
         f'{len(todo)} to run; results in {self.results_path}')
    self.write_results()
    previous = self._install_signal_handlers()
    running: list[_Attempt] = []
    try:
      self._schedule(todo, running)
    except (_Interrupted, KeyboardInterrupt) as e:
      signum = e.signum if isinstance(e, _Interrupted) else signal.SIGINT
      self._stop(running)
      self.write_results()
      _say(f'grid: interrupted by {signal.Signals(signum).name}; {len(self.done)}/'
           f'{len(self.runs)} runs finished; rerun the same command to resume the others',
           err=True)
      raise SystemExit(128 + signum) from None
    finally:
      for signum, handler in previous.items():
        signal.signal(signum, handler)
    _say(f'grid: {len(self.done)}/{len(self.runs)} runs finished'
         + (f'; failed: {self.failed_summary()}' if self.failed else ''))

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
            _say(f'grid: waiting for {run.name}: {rundir / LOCK_FILE} is held by another '
                 f'process ({_lock_owner(rundir)})')
          continue
        queue.remove(run)
        changed = True
        entry = _read_json(rundir / DONE_FILE)
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
    number = sum('start' in line for line in _read_jsonl(rundir / ATTEMPTS_FILE)) + 1
    argv = [arg.replace('{rundir}', str(rundir)) for arg in run.command]
    env = {**os.environ, **self.env, **(run.env or {}), 'RUN_DIR': str(rundir),
           'PYTHONUNBUFFERED': '1'}
    with open(rundir / LOG_FILE, 'ab') as log:
      log.write(f'=== attempt {number} at {_now()}: {_quote(argv)}\n'.encode())
      log.flush()
      offset = log.tell()
      code = code_version(self.cwd)
      _append_jsonl(rundir / ATTEMPTS_FILE, {'attempt': number, 'start': _now(), 'code': code})
      start = time.monotonic()
      try:
        # Own session: a terminal's Ctrl-C reaches only the grid, which stops commands with
        # SIGTERM (our training CLI checkpoints on it). The LOCK descriptor is inherited, so
        # the lock lives as long as the command, even if the grid dies first.
        proc = subprocess.Popen(argv, cwd=self.cwd, env=env, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                pass_fds=(lock_fd,), preexec_fn=_die_with_parent())
      except OSError as e:
        _append_jsonl(rundir / ATTEMPTS_FILE, {'attempt': number, 'end': _now(),
                                               'returncode': None, 'wall_time_s': 0.0})
        os.close(lock_fd)
        self._fail(run, rundir, f'could not start: {e}', tail='')
        return None
    os.write(lock_fd, f'command pid {proc.pid}\n'.encode())
    _say(f'grid: start {run.name} (attempt {number}{", resuming" if number > 1 else ""}), '
         f'log {rundir / LOG_FILE}')
    if code['modified']:
      _say(f'grid: warning: {run.name} runs the uncommitted changes to '
           f'{", ".join(code["modified"])} in {self.cwd}: edits made while it runs reach it '
           'at its next (re)start.')
    return _Attempt(run, rundir, number, proc, lock_fd, offset, start)

  def _finish(self, attempt: _Attempt) -> None:
    run, rundir, code = attempt.run, attempt.rundir, attempt.proc.returncode
    wall = round(time.monotonic() - attempt.start, 3)
    try:
      _append_jsonl(rundir / ATTEMPTS_FILE, {'attempt': attempt.number, 'end': _now(),
                                             'returncode': code, 'wall_time_s': wall})
      # Attempts whose grid was killed outright wrote no end: a lower bound then.
      attempts = _read_jsonl(rundir / ATTEMPTS_FILE)
      total = sum(a.get('wall_time_s', 0.0) for a in attempts)
      if code != 0:
        self._fail(run, rundir, f'{_describe_exit(code)} after {wall:.1f} s',
                   tail=_tail(rundir / LOG_FILE, attempt.log_offset, self.tail_lines))
        return
      try:
        collected = _collect(run, rundir)
      except Exception as e:  # pylint: disable=broad-except
        self._fail(run, rundir, f'exited 0 but collecting its results failed: '
                   f'{type(e).__name__}: {e}', tail='')
        return
      entry = {'name': run.name, 'seed': run.seed, 'config': dict(run.config),
               'command': list(run.command), 'wall_time_s': wall,
               'wall_time_total_s': round(total, 3), 'attempts': attempt.number,
               'finished': _now(), 'machine': self.machine,
               'code': [a['code'] for a in attempts if 'code' in a], **collected}
      _write_json(rundir / DONE_FILE, entry)  # the run counts as finished from here on
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
    _write_json(self.rundir(run) / DONE_FILE, entry)
    return entry

  def _stop(self, running: list[_Attempt]) -> None:
    if not running:
      return
    _say(f'grid: stopping {", ".join(a.run.name for a in running)} (SIGTERM, SIGKILL after '
         f'{self.stop_timeout_s:g} s)', err=True)
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
      _append_jsonl(attempt.rundir / ATTEMPTS_FILE, {
          'attempt': attempt.number, 'end': _now(), 'returncode': attempt.proc.returncode,
          'wall_time_s': round(time.monotonic() - attempt.start, 3), 'interrupted': True})
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
    return {
        'runs_dir': str(self.runs_dir),
        'runs': [self.done[run.name] for run in self.runs if run.name in self.done],
        'failed': [{'name': name, 'why': why} for name, why in self.failed.items()],
        'unfinished': [run.name for run in self.runs
                       if run.name not in self.done and run.name not in self.failed],
    }

  def write_results(self) -> None:
    _write_json(self.results_path, self.results())


def load_results(path: str | os.PathLike) -> dict[str, Any]:
  """results.json, given the file or the experiment folder that holds it."""
  path = pathlib.Path(path)
  return json.loads((path / RESULTS_FILE if path.is_dir() else path).read_text())


def final(results: Mapping[str, Any], split: str | None = None) -> list[dict[str, Any]]:
  """One row per finished run: name, seed, its config, wall time, result.json's values and,
  given a split, that split's last metrics line (highest step)."""
  rows = []
  for run in results['runs']:
    row = _run_row(run)
    row.update(run.get('result') or {})
    lines = [m for m in run.get('metrics', ()) if m['split'] == split]
    if lines:
      row.update(max(lines, key=lambda m: m['step']))
    rows.append(row)
  return rows


def bleu_of(metrics: Mapping[str, Any]) -> float | None:
  """A translation evaluation's BLEU: beam search's where it ran, else greedy's, else None."""
  return metrics.get('bleu', metrics.get('bleu_greedy'))


def history(results: Mapping[str, Any], split: str) -> list[dict[str, Any]]:
  """One row per (run, metrics line of `split`): learning curves, with each run's config."""
  return [{**_run_row(run), **line} for run in results['runs']
          for line in run.get('metrics', ()) if line['split'] == split]


def runs_summary(results: Mapping[str, Any]) -> str:
  """A README line: how many runs, their run time, and the machines they ran on.

  A grid that is not through yet says so: 'N of M runs finished (still to run: ...)'.
  """
  runs = results['runs']
  if not runs:
    return 'No finished runs.'
  failed = [f['name'] for f in results.get('failed', [])]
  unfinished = results.get('unfinished', [])
  left = [f'{label}: {", ".join(names)}'
          for label, names in (('failed', failed), ('still to run', unfinished)) if names]
  total = len(runs) + len(failed) + len(unfinished)
  count = f'{len(runs)} of {total} runs finished ({"; ".join(left)})' if left else (
      f'{len(runs)} runs')
  times = [run.get('wall_time_total_s', run['wall_time_s']) for run in runs]
  machines = []
  for run in runs:
    m = run.get('machine', {})
    line = (f"{m.get('cpu', '?')} ({m.get('cpus_available', m.get('cpu_count', '?'))} CPUs "
            f"available), {m.get('platform', '?')}, Python {m.get('python', '?')}, "
            f"jax {m.get('jax', '?')}")
    if line not in machines:
      machines.append(line)
  return (f'{count}, {_duration(sum(times))} of run time in all (longest '
          f'{_duration(max(times))}), on ' + '; '.join(machines) + '.')


def aggregate(rows: Iterable[Mapping[str, Any]], by: Sequence[str],
              values: Sequence[str]) -> list[dict[str, Any]]:
  """Rows grouped by the `by` keys (e.g. everything but the seed), in first-seen order.

  Each output row has the `by` values, `n` (rows in the group) and, for each key in
  `values`, its mean under the same key plus `<key>_std` (sample), `<key>_min`, `<key>_max`
  over the rows that have it (None if none has).
  """
  groups: dict[tuple, list] = {}
  for row in rows:
    groups.setdefault(tuple(_hashable(row.get(key)) for key in by), []).append(row)
  out = []
  for members in groups.values():
    agg = {key: members[0].get(key) for key in by}
    agg['n'] = len(members)
    for key in values:
      xs = [float(m[key]) for m in members if m.get(key) is not None]
      mean = sum(xs) / len(xs) if xs else None
      agg[key] = mean
      agg[f'{key}_std'] = (math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
                           if len(xs) > 1 else 0.0 if xs else None)
      agg[f'{key}_min'] = min(xs) if xs else None
      agg[f'{key}_max'] = max(xs) if xs else None
    out.append(agg)
  return out


def plot_lines(rows: Iterable[Mapping[str, Any]], *, x: str, y: str,
               out: str | os.PathLike, group: str | Sequence[str] | None = None,
               spread: str | None = 'minmax', title: str | None = None,
               xlabel: str | None = None, ylabel: str | None = None, logx: bool = False,
               logy: bool = False) -> dict[str, dict[str, list]]:
  """`y` against `x`, one line per value of `group`, written to `out` (a PNG or PDF).

  Rows that share the group and x (e.g. seeds) become one point: their mean, with a band
  over their min..max (`spread='minmax'`) or mean ± sample std (`'std'`), or no band (None).
  Returns the plotted series, {label: {'x', 'mean', 'lo', 'hi', 'n'}}.
  """
  if spread not in ('minmax', 'std', None):
    raise ValueError(f"spread must be 'minmax', 'std' or None, got {spread!r}")
  by = [group] if isinstance(group, str) else list(group or ())
  rows = [row for row in rows if row.get(x) is not None and row.get(y) is not None]
  series: dict[str, dict[str, list]] = {}
  for label_row in aggregate(rows, by, ()):
    label = ', '.join(f'{key}={label_row[key]}' for key in by) or y
    members = [row for row in rows if all(row.get(k) == label_row[k] for k in by)]
    points = sorted(aggregate(members, [x], [y]), key=lambda p: p[x])
    lo = [p[f'{y}_min'] if spread == 'minmax' else p[y] - p[f'{y}_std'] for p in points]
    hi = [p[f'{y}_max'] if spread == 'minmax' else p[y] + p[f'{y}_std'] for p in points]
    series[label] = {'x': [p[x] for p in points], 'mean': [p[y] for p in points],
                     'lo': lo, 'hi': hi, 'n': [p['n'] for p in points]}

  # The object API with the Agg canvas: no pyplot state, no display needed.
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  from matplotlib.patches import Patch
  fig = Figure(figsize=(6.4, 4.2), layout='constrained')
  FigureCanvasAgg(fig)
  ax = fig.add_subplot()
  handles, has_band = [], False
  band_label = {'minmax': 'min–max over seeds', 'std': '± std over seeds'}.get(spread)
  for label, s in series.items():
    (line,) = ax.plot(s['x'], s['mean'], marker='o' if len(s['x']) < 30 else None,
                      markersize=4, label=label)
    handles.append(line)
    if spread and max(s['n']) > 1:
      ax.fill_between(s['x'], s['lo'], s['hi'], color=line.get_color(), alpha=0.2, lw=0)
      has_band = True
  if has_band:  # one grey legend entry for all bands, last
    handles.append(Patch(color='grey', alpha=0.3, label=band_label))
  ax.set_xlabel(xlabel or x)
  ax.set_ylabel(ylabel or y)
  if logx:
    ax.set_xscale('log')
    xs = sorted({v for s in series.values() for v in s['x']})
    if len(xs) <= 12:  # label the grid's own values (16, 32, ...), not powers of ten
      ax.set_xticks(xs, [format(v, 'g') for v in xs])
      ax.minorticks_off()
  if logy:
    ax.set_yscale('log')
  if title:
    ax.set_title(title)
  ax.grid(alpha=0.3)
  if len(handles) > 1:
    ax.legend(handles=handles, fontsize='small')
  pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, dpi=120)
  return series


def markdown_table(rows: Iterable[Mapping[str, Any]], columns: Sequence[Any], *,
                   floatfmt: str = '.4g') -> str:
  """A Markdown table: one line per row.

  A column is a key (also its header), `(header, key)` or `(header, fn)` with `fn(row)` giving
  the cell. Floats are written with `floatfmt`, None as an empty cell.
  """
  specs = [(c, c) if isinstance(c, str) else tuple(c) for c in columns]

  def cell(row, getter):
    value = getter(row) if callable(getter) else row.get(getter)
    if value is None:
      return ''
    if isinstance(value, float):
      value = format(value, floatfmt)
    return str(value).replace('|', '\\|').replace('\n', ' ')

  lines = ['| ' + ' | '.join(header for header, _ in specs) + ' |',
           '|' + '|'.join('---' for _ in specs) + '|']
  lines += ['| ' + ' | '.join(cell(row, getter) for _, getter in specs) + ' |' for row in rows]
  return '\n'.join(lines) + '\n'


def write_section(path: str | os.PathLike, name: str, text: str) -> None:
  """Replaces what lies between `<!-- name -->` and `<!-- /name -->` in a README."""
  path = pathlib.Path(path)
  begin, end = f'<!-- {name} -->', f'<!-- /{name} -->'
  content = path.read_text()
  if (content.count(begin) != 1 or content.count(end) != 1
      or content.index(begin) > content.index(end)):
    raise ValueError(f'{path} must hold the markers {begin} and {end} once each, in that order')
  head, rest = content.split(begin)
  _, tail = rest.split(end)
  _write_text(path, f'{head}{begin}\n{text.strip()}\n{end}{tail}')


def status(runs_dir: str | os.PathLike) -> list[dict[str, Any]]:
  """The state of each run directory: done, running, failed, interrupted or new."""
  out = []
  for rundir in sorted(p for p in pathlib.Path(runs_dir).iterdir() if p.is_dir()):
    attempts = _read_jsonl(rundir / ATTEMPTS_FILE)
    info = {'name': rundir.name, 'attempts': sum('start' in a for a in attempts)}
    done = _read_json(rundir / DONE_FILE)
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


def _run_row(run: Mapping[str, Any]) -> dict[str, Any]:
  return {'name': run['name'], 'seed': run.get('seed'), **(run.get('config') or {}),
          'wall_time_s': run.get('wall_time_s')}


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


def _die_with_parent():
  """A preexec_fn asking Linux to SIGTERM the command when the grid dies (None elsewhere)."""
  if not sys.platform.startswith('linux'):
    return None
  prctl = ctypes.CDLL(None, use_errno=True).prctl
  parent = os.getpid()

  def preexec():
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


def _cpu_model() -> str:
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        if line.startswith('model name'):
          return line.split(':', 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def _duration(seconds: float) -> str:
  if seconds < 120:
    return f'{seconds:.0f} s'
  return f'{seconds / 60:.1f} min' if seconds < 7200 else f'{seconds / 3600:.1f} h'


def _hashable(value):
  return json.dumps(value, sort_keys=True) if isinstance(value, (list, dict)) else value


def _quote(argv: Sequence[str]) -> str:
  return shlex.join(argv)


def _now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')


def _say(line: str, err: bool = False) -> None:
  print(line, file=sys.stderr if err else sys.stdout, flush=True)


def _read_json(path: pathlib.Path) -> Any:
  try:
    return json.loads(path.read_text())
  except FileNotFoundError:
    return None


def _read_jsonl(path: pathlib.Path) -> list[dict]:
  if not path.exists():
    return []
  out = []
  for line in path.read_text().splitlines():
    try:
      out.append(json.loads(line))
    except ValueError:  # cut short by a kill
      pass
  return out


def _append_jsonl(path: pathlib.Path, entry: Mapping[str, Any]) -> None:
  with open(path, 'a') as f:
    f.write(json.dumps(entry) + '\n')


def _write_json(path: pathlib.Path, data: Any) -> None:
  _write_text(path, _dumps(data) + '\n')


def _write_text(path: pathlib.Path, text: str) -> None:
  """Whole or not at all: a reader (or a kill) never sees a half-written file."""
  tmp = path.with_name(f'.{path.name}.{os.getpid()}.tmp')
  with open(tmp, 'w') as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def _dumps(value: Any, indent: int = 0, width: int = 100) -> str:
  """Indented JSON with each short or flat object or list (a metrics line) on one line."""
  flat = json.dumps(value)
  if not isinstance(value, (dict, list)) or len(flat) + indent <= width:
    return flat
  if not any(isinstance(v, (dict, list)) for v in (value.values() if isinstance(value, dict)
                                                   else value)):
    return flat
  pad = ' ' * (indent + 1)
  if isinstance(value, dict):
    items = [f'{pad}{json.dumps(k)}: {_dumps(v, indent + 1, width)}' for k, v in value.items()]
    return '{\n' + ',\n'.join(items) + '\n' + ' ' * indent + '}'
  items = [pad + _dumps(v, indent + 1, width) for v in value]
  return '[\n' + ',\n'.join(items) + '\n' + ' ' * indent + ']'


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(
      prog='python -m experiments.runner', description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  commands = parser.add_subparsers(dest='command', required=True)
  status_parser = commands.add_parser('status', help='the state of each run in RUNS_DIR')
  status_parser.add_argument('runs_dir')
  args = parser.parse_args(argv)
  if not pathlib.Path(args.runs_dir).is_dir():
    sys.exit(f'No such directory: {args.runs_dir}')
  rows = status(args.runs_dir)
  print(markdown_table(rows, ['name', 'state', 'attempts', 'wall_time_s', 'returncode']), end='')


if __name__ == '__main__':
  main()
