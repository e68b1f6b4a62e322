"""The experiment runner: resumable grids of tiny `python -c` commands, results, plots, tables."""

import json
import os
import pathlib
import re
import signal
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from experiments import runner

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


def py(code, *args):
  return [sys.executable, '-c', textwrap.dedent(code), *args]


def count(path):
  """A command that appends one character to `path`: how often it ran."""
  return py(f'open({str(path)!r}, "a").write("x")')


def grid_in_subprocess(runs, out_dir, runs_dir, wait=True):
  """`run_grid` in its own process, so that a test can kill it (or a run can kill it)."""
  code = textwrap.dedent(f"""
      from experiments.runner import Run, run_grid
      runs = [Run(name, command) for name, command in {runs!r}]
      run_grid(runs, {str(out_dir)!r}, runs_dir={str(runs_dir)!r}, stop_timeout_s=10)
  """)
  env = {**os.environ, 'PYTHONPATH': str(REPO_ROOT)}
  args = dict(cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  if not wait:
    return subprocess.Popen([sys.executable, '-c', code], **args)
  return subprocess.run([sys.executable, '-c', code], timeout=30, **args)


def wait_for(path, timeout=20.0):
  deadline = time.monotonic() + timeout
  while not path.exists():
    assert time.monotonic() < deadline, f'{path} never appeared'
    time.sleep(0.02)


def names(results):
  return [run['name'] for run in results['runs']]


def test_killed_grid_resumes_without_repeating_finished_runs(tmp_path):
  out, runs_dir = tmp_path / 'exp', tmp_path / 'runs'
  first, second = tmp_path / 'first.count', tmp_path / 'second.count'
  # The second run kills the grid (like a lost session) on its first attempt only.
  kill_grid_once = py(f"""
      import os, signal
      path = {str(second)!r}
      attempt = len(open(path).read()) + 1 if os.path.exists(path) else 1
      open(path, 'a').write('x')
      if attempt == 1:
        os.kill(os.getppid(), signal.SIGKILL)
  """)
  runs = [('first', count(first)), ('second', kill_grid_once)]

  killed = grid_in_subprocess(runs, out, runs_dir)
  assert killed.returncode == -signal.SIGKILL, killed.stderr
  assert (runs_dir / 'first' / 'DONE').exists()
  assert not (runs_dir / 'second' / 'DONE').exists()
  results = runner.load_results(out)
  assert names(results) == ['first'] and results['unfinished'] == ['second']

  rerun = grid_in_subprocess(runs, out, runs_dir)
  assert rerun.returncode == 0, rerun.stderr
  assert first.read_text() == 'x'  # not repeated
  assert second.read_text() == 'xx'  # run again, and finished
  results = runner.load_results(out)
  assert names(results) == ['first', 'second'] and results['unfinished'] == []
  assert [run['attempts'] for run in results['runs']] == [1, 2]


def test_an_attempt_killed_with_its_grid_counts_until_its_last_metrics_line(tmp_path):
  """A lost machine leaves an attempt without an end in attempts.jsonl; its run time is not
  zero but runs to the last line the run wrote to metrics.jsonl before the next attempt."""
  out, runs_dir, second = tmp_path / 'exp', tmp_path / 'runs', tmp_path / 'second.count'
  kill_grid_once = py(
      f"""
      import json, os, signal, sys, time
      path = {str(second)!r}
      attempt = len(open(path).read()) + 1 if os.path.exists(path) else 1
      open(path, 'a').write('x')
      if attempt == 1:
        time.sleep(2.5)
        with open(os.path.join(sys.argv[1], 'metrics.jsonl'), 'a') as f:
          f.write(json.dumps({{'step': 1, 'split': 'train', 'time': time.time()}}) + '\\n')
        os.kill(os.getppid(), signal.SIGKILL)
  """,
      '{rundir}',
  )
  assert grid_in_subprocess([('second', kill_grid_once)], out, runs_dir).returncode < 0
  rerun = grid_in_subprocess([('second', kill_grid_once)], out, runs_dir)
  assert rerun.returncode == 0, rerun.stderr
  (run,) = runner.load_results(out)['runs']
  assert run['attempts'] == 2
  # The killed attempt ran at least 2.5 s (its start is stamped to the second, rounded down).
  assert run['wall_time_total_s'] >= run['wall_time_s'] + 2.5
  # A run recorded by the old runner (the killed attempt's time left out) gets it at a refresh.
  done = runs_dir / 'second' / 'DONE'
  done.write_text(json.dumps({**run, 'wall_time_total_s': run['wall_time_s']}))
  grid = [runner.Run('second', kill_grid_once)]
  (refreshed,) = runner.run_grid(grid, out, runs_dir=runs_dir, refresh=True)['runs']
  assert refreshed['wall_time_total_s'] == run['wall_time_total_s']


def test_attempts_wall_time_reads_the_ends_and_dates_the_attempts_without_one(tmp_path):
  """Ended attempts count their recorded time; one without an end counts from its start to
  the last metrics line before the next attempt's start (lines of later attempts and lines
  without a time ignored), or nothing where it wrote none."""
  start = 1_800_000_000.0
  stamp = lambda t: runner.grid.datetime.datetime.fromtimestamp(
      t, runner.grid.datetime.timezone.utc
  ).isoformat(timespec='seconds')
  attempts = [
      {'attempt': 1, 'start': stamp(start)},  # killed at about start + 1000.5
      {'attempt': 2, 'start': stamp(start + 1000)},  # ended: 100 s
      {'attempt': 2, 'end': stamp(start + 1100), 'returncode': 143, 'wall_time_s': 100.0},
      {'attempt': 3, 'start': stamp(start + 2000)},  # killed before writing anything
      {'attempt': 4, 'start': stamp(start + 3000)},  # killed at about start + 3040
  ]
  metrics = [
      {'step': 0, 'split': 'hparams'},
      {'step': 10, 'split': 'train', 'time': start + 50},
      {'step': 20, 'split': 'eval', 'time': start + 200},
      # Within the second attempt 2's start is stamped to (rounded down): still attempt 1's.
      {'step': 25, 'split': 'train', 'time': start + 1000.5},
      {'step': 30, 'split': 'train', 'time': start + 1050},  # attempt 2's
      {'step': 40, 'split': 'train', 'time': start + 3040},
  ]
  for name, lines in (('attempts.jsonl', attempts), ('metrics.jsonl', metrics)):
    (tmp_path / name).write_text(''.join(json.dumps(line) + '\n' for line in lines))
  assert runner.grid.attempts_wall_time(tmp_path) == 1000.5 + 100 + 0 + 40


def test_sigterm_reaches_the_running_command_and_rerun_resumes_it(tmp_path):
  out, runs_dir = tmp_path / 'exp', tmp_path / 'runs'
  first, second = tmp_path / 'first.count', tmp_path / 'second.count'
  ready, saved = tmp_path / 'ready', tmp_path / 'saved'
  # Like our training CLI: on SIGTERM, save a checkpoint and exit 143.
  slow_once = py(f"""
      import os, signal, sys, time
      path = {str(second)!r}
      attempt = len(open(path).read()) + 1 if os.path.exists(path) else 1
      open(path, 'a').write('x')
      if attempt == 1:
        def save(signum, frame):
          open({str(saved)!r}, 'w').write('checkpoint')
          sys.exit(143)
        signal.signal(signal.SIGTERM, save)
        open({str(ready)!r}, 'w').close()
        time.sleep(30)
  """)
  runs = [('first', count(first)), ('second', slow_once)]

  grid = grid_in_subprocess(runs, out, runs_dir, wait=False)
  wait_for(ready)
  grid.send_signal(signal.SIGTERM)
  _, stderr = grid.communicate(timeout=20)
  assert grid.returncode == 128 + signal.SIGTERM, stderr
  assert 'interrupted by SIGTERM' in stderr
  assert saved.read_text() == 'checkpoint'
  assert not (runs_dir / 'second' / 'DONE').exists()
  last = runner.files.read_jsonl(runs_dir / 'second' / runner.ATTEMPTS_FILE)[-1]
  assert last['returncode'] == 143 and last['interrupted']
  assert [s['state'] for s in runner.status(runs_dir)] == ['done', 'interrupted']

  rerun = grid_in_subprocess(runs, out, runs_dir)
  assert rerun.returncode == 0, rerun.stderr
  assert (first.read_text(), second.read_text()) == ('x', 'xx')
  resumed = runner.load_results(out)['runs'][1]
  assert resumed['attempts'] == 2
  assert resumed['wall_time_total_s'] > resumed['wall_time_s'] > 0  # the stopped attempt too


def test_rerun_waits_for_a_command_that_outlived_its_killed_grid(tmp_path):
  out, runs_dir = tmp_path / 'exp', tmp_path / 'runs'
  events, ready = tmp_path / 'events', tmp_path / 'ready'
  # First attempt: when told to stop (the kernel's SIGTERM once the grid is gone), it takes a
  # while to save before it exits. Its rerun must not start in the same directory meanwhile.
  run = py(f"""
      import os, signal, sys, time
      path = {str(events)!r}
      attempt = open(path).read().count('start') + 1 if os.path.exists(path) else 1
      open(path, 'a').write(f'start{{attempt}} ')
      if attempt == 1:
        def save(signum, frame):
          time.sleep(3)  # longer than the rerun takes to start, even on a loaded machine
          open(path, 'a').write('saved1 ')
          sys.exit(143)
        signal.signal(signal.SIGTERM, save)
        open({str(ready)!r}, 'w').close()
        time.sleep(10)
      open(path, 'a').write(f'end{{attempt}} ')
  """)
  grid = grid_in_subprocess([('only', run)], out, runs_dir, wait=False)
  wait_for(ready)
  grid.kill()
  grid.wait()
  rerun = grid_in_subprocess([('only', run)], out, runs_dir)
  assert rerun.returncode == 0, rerun.stderr
  assert events.read_text().split() == ['start1', 'saved1', 'start2', 'end2']
  assert 'waiting for only' in rerun.stdout


def test_failed_run_is_reported_and_the_others_still_run(tmp_path, capsys):
  out, runs_dir = tmp_path / 'exp', tmp_path / 'runs'
  counts = {name: tmp_path / f'{name}.count' for name in ('ok1', 'ok2')}
  bad = py("""
      import sys
      print('loading data')
      print('boom: out of memory', file=sys.stderr)
      sys.exit(3)
  """)
  runs = [
      runner.Run('ok1', count(counts['ok1'])),
      runner.Run('bad', bad),
      runner.Run('missing', [str(tmp_path / 'no-such-program')]),
      runner.Run('ok2', count(counts['ok2'])),
  ]

  with pytest.raises(SystemExit) as exit_info:
    runner.run_grid(runs, out, runs_dir=runs_dir)
  assert '2 of 4 runs failed: bad (exit code 3' in str(exit_info.value.code)
  err = capsys.readouterr().err
  assert 'FAILED bad: exit code 3' in err and 'FAILED missing: could not start' in err
  assert '| loading data' in err and '| boom: out of memory' in err
  results = runner.load_results(out)
  assert names(results) == ['ok1', 'ok2']
  assert [f['name'] for f in results['failed']] == ['bad', 'missing']
  assert [s['state'] for s in runner.status(runs_dir)] == ['failed', 'failed', 'done', 'done']

  # Rerun: only the failed run is tried again.
  results = runner.run_grid(runs, out, runs_dir=runs_dir, exit_on_failure=False)
  assert [f['name'] for f in results['failed']] == ['bad', 'missing']
  assert [p.read_text() for p in counts.values()] == ['x', 'x']
  assert (runs_dir / 'bad' / 'log.txt').read_text().count('=== attempt') == 2

  runner.main(['status', str(runs_dir)])
  table = capsys.readouterr().out
  assert '| bad | failed | 2 |  | 3 |' in table and '| ok1 | done | 1 |' in table


RECORDING_RUN = """
    import json, pathlib, sys
    rundir, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    # What results.json held while this run was going: the runs finished before it.
    seen = [run['name'] for run in json.loads((out / 'results.json').read_text())['runs']]
    (rundir / 'result.json').write_text(json.dumps({'seen': seen}))
    lines = [{'step': 0, 'split': 'hparams', 'lr': 1.0},
             {'step': 1, 'split': 'train', 'loss': 3.0},
             {'step': 2, 'split': 'train', 'loss': 2.5},
             {'step': 2, 'split': 'train', 'loss': 2.0},  # again, after a resume
             {'step': 2, 'split': 'eval', 'loss': 2.2}]
    with open(rundir / 'metrics.jsonl', 'w') as f:
      f.write(''.join(json.dumps(line) + '\\n' for line in lines) + '{"step": 3, "spl')
"""


def test_results_collected_after_each_run_and_from_done_files(tmp_path):
  out, runs_dir = tmp_path / 'exp', tmp_path / 'runs'
  runs = [
      runner.Run(f'r{k}', py(RECORDING_RUN, '{rundir}', str(out)), config={'lr': k / 10}, seed=k)
      for k in range(3)
  ]
  results = runner.run_grid(runs, out, runs_dir=runs_dir)

  assert [run['result']['seen'] for run in results['runs']] == [[], ['r0'], ['r0', 'r1']]
  first = results['runs'][0]
  assert [(m['split'], m['step'], m['loss']) for m in first['metrics']] == [
      ('eval', 2, 2.2),
      ('train', 1, 3.0),
      ('train', 2, 2.0),
  ]
  assert (first['seed'], first['config'], first['attempts']) == (0, {'lr': 0.0}, 1)
  assert first['command'][-2:] == ['{rundir}', str(out)]  # the template, not the path
  assert first['wall_time_s'] > 0
  assert {'platform', 'cpu_count', 'jax', 'python'} <= set(first['machine'])
  summary = runner.runs_summary(results)
  assert re.match(r'3 runs, \d+ s of run time in all \(longest \d+ s\), on ', summary)
  assert f"jax {first['machine']['jax']}" in summary and summary.count(' on ') == 1
  partial = {
      **results,
      'runs': results['runs'][:1],
      'unfinished': ['r2'],
      'failed': [{'name': 'r1', 'why': 'exit 1'}],
  }
  assert runner.runs_summary(partial).startswith(
      '1 of 3 runs finished (failed: r1; still to run: r2), '
  )
  # A README section that reports part of the runs counts those alone.
  assert runner.runs_summary(partial, names=['r0', 'r2']).startswith(
      '1 of 2 runs finished (still to run: r2), '
  )
  assert runner.runs_summary(partial, names=['r0', 'r1']).startswith(
      '1 of 2 runs finished (failed: r1), '
  )
  assert runner.runs_summary(partial, names=['r1', 'r2']) == 'No finished runs.'
  assert runner.load_results(out) == results

  # The work tree wiped, the run directories kept: results.json comes back, nothing reruns.
  before = {p: p.stat().st_mtime_ns for p in runs_dir.glob('*/result.json')}
  (out / 'results.json').unlink()
  assert runner.run_grid(runs, out, runs_dir=runs_dir) == results
  assert {p: p.stat().st_mtime_ns for p in runs_dir.glob('*/result.json')} == before

  # A new collector for finished runs, without running them.
  custom = [
      runner.Run(
          r.name,
          r.command,
          r.config,
          r.seed,
          collect=lambda d: {'final_loss': runner.read_metrics(d)[-1]['loss']},
      )
      for r in runs
  ]
  refreshed = runner.run_grid(custom, out, runs_dir=runs_dir, refresh=True)
  assert [run['final_loss'] for run in refreshed['runs']] == [2.0, 2.0, 2.0]
  assert 'metrics' not in refreshed['runs'][0] and refreshed['runs'][0]['seed'] == 0
  assert {p: p.stat().st_mtime_ns for p in runs_dir.glob('*/result.json')} == before


def test_runs_and_train_run_validate(tmp_path):
  with pytest.raises(ValueError, match='names a directory'):
    runner.Run('../up', ['true'])
  with pytest.raises(ValueError, match='argv list'):
    runner.Run('a', 'python -c pass')
  with pytest.raises(ValueError, match='JSON'):
    runner.Run('a', ['true'], config={'f': object()})
  with pytest.raises(ValueError, match="repeated: \\['a'\\]"):
    runner.run_grid([runner.Run('a', ['true'])] * 2, tmp_path)
  run = runner.train_run(
      'kd32-s1', 'configs/nmt.py:tiny', seed=1, overrides={'model.encoder.attention.key_dim': 32}
  )
  assert run.command[1:] == (
      '-m',
      'lowrank_attn.main',
      '--config=configs/nmt.py:tiny',
      '--workdir={rundir}',
      '--config.seed=1',
      '--config.model.encoder.attention.key_dim=32',
  )
  assert run.config == {'config': 'configs/nmt.py:tiny', 'model.encoder.attention.key_dim': 32}
  assert run.seed == 1


RESULTS = {
    'runs': [
        {
            'name': f'{kind}-d{dim}-s{seed}',
            'seed': seed,
            'config': {'kind': kind, 'dim': dim},
            'wall_time_s': 1.0,
            'result': {'params': dim * 10},
            'metrics': [
                {
                    'step': step,
                    'split': 'eval',
                    'bleu': dim + [0, 1, 5][seed] + step + (kind == 'b'),
                }
                for step in (1, 2)
            ],
        }
        for kind in ('a', 'b')
        for dim in (16, 8)
        for seed in (0, 1, 2)
    ]
}


def test_final_history_aggregate_and_table():
  rows = runner.final(RESULTS, split='eval')
  assert rows[0] == {
      'name': 'a-d16-s0',
      'seed': 0,
      'kind': 'a',
      'dim': 16,
      'wall_time_s': 1.0,
      'wall_time_total_s': 1.0,  # one attempt: the same
      'attempts': 1,
      'params': 160,
      'step': 2,
      'split': 'eval',
      'bleu': 18,
  }
  resumed = {**RESULTS['runs'][0], 'wall_time_s': 1.0, 'wall_time_total_s': 5.0, 'attempts': 2}
  (row,) = runner.final({'runs': [resumed]}, split='eval')
  assert (row['wall_time_s'], row['wall_time_total_s'], row['attempts']) == (1.0, 5.0, 2)
  seven = pytest.approx(7**0.5)
  assert len(runner.history(RESULTS, 'eval')) == 24
  agg = runner.aggregate(rows, by=['kind', 'dim'], values=['bleu'])
  assert [(r['kind'], r['dim'], r['n']) for r in agg] == [
      ('a', 16, 3),
      ('a', 8, 3),
      ('b', 16, 3),
      ('b', 8, 3),
  ]
  assert (agg[0]['bleu'], agg[0]['bleu_std'], agg[0]['bleu_min'], agg[0]['bleu_max']) == (
      20.0,
      seven,
      18.0,
      23.0,
  )
  table = runner.markdown_table(
      agg[:2],
      [
          'kind',
          ('key dim', 'dim'),
          ('BLEU', lambda r: f"{r['bleu']:.1f} ± {r['bleu_std']:.1f}"),
          ('max', 'bleu_max'),
          ('note', lambda r: None),
      ],
  )
  assert table == (
      '| kind | key dim | BLEU | max | note |\n'
      '|---|---|---|---|---|\n'
      '| a | 16 | 20.0 ± 2.6 | 23 |  |\n'
      '| a | 8 | 12.0 ± 2.6 | 15 |  |\n'
  )


def test_plot_lines_draws_mean_and_seed_spread(tmp_path):
  rows = runner.final(RESULTS, split='eval') + [{'kind': 'a', 'dim': 4}]  # no bleu: left out
  out = tmp_path / 'plots' / 'bleu.png'
  series = runner.plot_lines(rows, x='dim', y='bleu', group='kind', out=out)
  assert out.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n' and out.stat().st_size > 5000
  assert series['kind=a'] == {
      'x': [8, 16],
      'mean': [12.0, 20.0],
      'lo': [10.0, 18.0],
      'hi': [15.0, 23.0],
      'n': [3, 3],
  }
  assert series['kind=b']['mean'] == [13.0, 21.0]
  curves = runner.plot_lines(
      runner.history(RESULTS, 'eval'),
      x='step',
      y='bleu',
      group=['kind', 'dim'],
      spread='std',
      out=tmp_path / 'curves.pdf',
  )
  seven = 7**0.5
  curve = curves['kind=b, dim=8']
  assert (curve['x'], curve['mean'], curve['n']) == ([1, 2], [12.0, 13.0], [3, 3])
  assert curve['lo'] == pytest.approx([12 - seven, 13 - seven])
  assert curve['hi'] == pytest.approx([12 + seven, 13 + seven])
  assert (tmp_path / 'curves.pdf').read_bytes()[:4] == b'%PDF'


def test_write_section_replaces_only_between_markers(tmp_path):
  readme = tmp_path / 'README.md'
  readme.write_text('# X\n\n<!-- results -->\nold\n<!-- /results -->\n\nAfter.\n')
  runner.write_section(readme, 'results', '| a |\n|---|\n')
  assert readme.read_text() == (
      '# X\n\n<!-- results -->\n| a |\n|---|\n<!-- /results -->\n\nAfter.\n'
  )
  with pytest.raises(ValueError, match='<!-- plots -->'):
    runner.write_section(readme, 'plots', 'x')


def test_each_run_records_the_commit_and_the_uncommitted_changes_it_ran(tmp_path):
  checkout = tmp_path / 'checkout'
  checkout.mkdir()
  git = lambda *args: subprocess.run(
      ['git', '-C', str(checkout), *args], check=True, capture_output=True, text=True
  ).stdout.strip()
  git('init', '-q')
  (checkout / 'model.py').write_text('scale = 1.0\n')
  (checkout / 'notes.txt').write_text('untracked files are not code\n')
  git('add', 'model.py')
  git('-c', 'user.name=t', '-c', 'user.email=t@t', 'commit', '-q', '-m', 'model')
  commit = git('rev-parse', 'HEAD')
  out, runs_dir = tmp_path / 'exp', tmp_path / 'runs'
  clean = runner.run_grid([runner.Run('clean', py('pass'))], out, runs_dir=runs_dir, cwd=checkout)
  assert clean['runs'][0]['code'] == [{'commit': commit, 'modified': []}]

  (checkout / 'model.py').write_text('scale = 2.0\n')  # edited while the grid goes on
  (checkout / 'results.json').write_text('{}')  # what grids write is not code
  git('add', 'results.json')
  edited = runner.run_grid([runner.Run('edited', py('pass'))], out, runs_dir=runs_dir, cwd=checkout)
  assert edited['runs'][0]['code'] == [{'commit': commit, 'modified': ['model.py']}]
  attempts = [json.loads(line) for line in (runs_dir / 'edited' / 'attempts.jsonl').open()]
  assert attempts[0]['code']['modified'] == ['model.py']


def test_then_commands_run_in_order_after_the_command_succeeds(tmp_path):
  out, runs_dir, trace = tmp_path / 'exp', tmp_path / 'runs', tmp_path / 'trace'
  write = lambda word: py(f'open({str(trace)!r}, "a").write({word!r})')
  runs = [
      runner.Run('ok', write('train '), then=[write('eval '), write('plot')]),
      runner.Run('bad', py('raise SystemExit(3)'), then=[write('never')]),
  ]
  results = runner.run_grid(runs, out, runs_dir=runs_dir, exit_on_failure=False)
  assert trace.read_text() == 'train eval plot'
  assert [r['name'] for r in results['runs']] == ['ok']
  assert results['runs'][0]['command'] == list(runs[0].command)  # the then commands aside
  assert [f['name'] for f in results['failed']] == ['bad'] and 'code 3' in results['failed'][0][
      'why'
  ]
  with pytest.raises(ValueError, match='then must hold'):
    runner.Run('x', py('pass'), then=['echo'])


def test_machine_names_the_gpus_nvidia_smi_lists(tmp_path, monkeypatch):
  smi = tmp_path / 'nvidia-smi'
  smi.write_text('#!/bin/sh\n[ "$1" = --query-gpu=name ] && echo "NVIDIA H200"\n')
  smi.chmod(0o755)
  monkeypatch.setenv('PATH', f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
  machine = runner.machine()
  assert machine['gpus'] == ['NVIDIA H200']
  run = {'name': 'r', 'wall_time_s': 1.0, 'machine': machine}
  assert 'with NVIDIA H200.' in runner.runs_summary({'runs': [run], 'failed': [], 'unfinished': []})
  monkeypatch.setenv('PATH', str(tmp_path / 'nowhere'))
  assert 'gpus' not in runner.machine()


def test_code_outside_git_has_no_commit(tmp_path):
  assert runner.code_version(tmp_path) == {'commit': None, 'modified': []}


def test_a_copy_without_git_reports_its_manifests_commit_and_its_edits(tmp_path):
  """The tree sent to an accelerator machine has no .git: its manifest names the commit, and
  a tracked Python file whose content differs from that commit's counts as modified."""
  checkout = tmp_path / 'checkout'
  (checkout / 'pkg').mkdir(parents=True)
  git = lambda *args: subprocess.run(
      ['git', '-C', str(checkout), *args], check=True, capture_output=True, text=True
  ).stdout.strip()
  git('init', '-q')
  (checkout / 'pkg' / 'model.py').write_text('scale = 1.0\n')
  (checkout / 'README.md').write_text('prose\n')
  git('add', '.')
  git('-c', 'user.name=t', '-c', 'user.email=t@t', 'commit', '-q', '-m', 'model')
  commit = git('rev-parse', 'HEAD')
  runner.provenance.write_manifest(checkout)
  copy = tmp_path / 'copy'
  shutil.copytree(checkout, copy, ignore=shutil.ignore_patterns('.git'))
  assert runner.code_version(copy) == {'commit': commit, 'modified': [], 'copy_of_checkout': True}
  (copy / 'README.md').write_text('other prose\n')  # not code
  (copy / 'pkg' / 'model.py').write_text('scale = 1.5\n')
  assert runner.code_version(copy)['modified'] == ['pkg/model.py']
  # git's own object names: the hash `git hash-object` gives for the edited content.
  blob = subprocess.run(
      ['git', 'hash-object', str(copy / 'pkg' / 'model.py')], capture_output=True, text=True
  ).stdout.strip()
  assert runner.provenance._blob_hash(copy / 'pkg' / 'model.py') == blob

  # A copy sent with a stale .git (HEAD one commit back): the manifest names the code's commit.
  (checkout / 'pkg' / 'model.py').write_text('scale = 3.0\n')
  git('-c', 'user.name=t', '-c', 'user.email=t@t', 'commit', '-q', '-am', 'scale 3')
  newer = git('rev-parse', 'HEAD')
  runner.provenance.write_manifest(checkout)
  git('reset', '-q', '--soft', commit)
  assert runner.code_version(checkout) == {
      'commit': newer,
      'modified': [],
      'copy_of_checkout': True,
  }
  (checkout / 'pkg' / 'model.py').write_text('scale = 4.0\n')  # then neither explains it
  assert runner.code_version(checkout) == {'commit': commit, 'modified': ['pkg/model.py']}


def test_committed_results_stand_for_lost_run_directories_and_other_runs_are_kept(tmp_path):
  out, runs_dir = tmp_path / 'exp', tmp_path / 'runs'
  marks = {name: tmp_path / f'{name}.count' for name in ('a', 'b', 'c')}
  first = [runner.Run(name, count(marks[name])) for name in ('a', 'b')]
  runner.run_grid(first, out, runs_dir=runs_dir)

  # A new machine: the run directories are gone, results.json was committed. Running 'b'
  # (same command, another interpreter path) and a new 'c' reruns neither 'a' nor 'b'.
  for rundir in runs_dir.iterdir():
    for path in rundir.iterdir():
      path.unlink()
    rundir.rmdir()
  moved = lambda run: runner.Run(run.name, ['/elsewhere/python', *run.command[1:]])
  results = runner.run_grid(
      [moved(first[1]), runner.Run('c', count(marks['c']))], out, runs_dir=runs_dir
  )
  assert {name: mark.read_text() for name, mark in marks.items()} == {'a': 'x', 'b': 'x', 'c': 'x'}
  assert names(results) == ['b', 'c', 'a']  # this grid's runs in order, then the kept one
  assert runner.load_results(out) == results

  # Another command under the same name is not the recorded run: it runs.
  changed = runner.Run('a', py(f'open({str(marks["a"])!r}, "a").write("y")'))
  runner.run_grid([changed], out, runs_dir=runs_dir)
  assert marks['a'].read_text() == 'xy'


def test_a_recorded_run_stands_on_a_machine_with_another_runs_dir(tmp_path):
  """A command naming its runs directory (a data set prepared beside the runs) matches its
  record made under another runs directory; any other difference in that argument does not."""
  out, mark = tmp_path / 'exp', tmp_path / 'a.count'

  def run_in(runs_dir, suffix='tfds'):
    command = [*py(f'open({str(mark)!r}, "a").write("x")'), f'--data={runs_dir}/{suffix}']
    return runner.Run('a', command)

  first = tmp_path / 'gpu_machine_runs'
  runner.run_grid([run_in(first)], out, runs_dir=first)
  shutil.rmtree(first)  # the run directories stayed on the other machine
  here = tmp_path / 'runs_here'
  runner.run_grid([run_in(here)], out, runs_dir=here)
  assert mark.read_text() == 'x'
  runner.run_grid([run_in(here, 'other')], out, runs_dir=here)
  assert mark.read_text() == 'xx'


def test_rerun_lost_runs_a_recorded_run_again_and_its_old_entry_stands_until_then(tmp_path):
  out, runs_dir = tmp_path / 'exp', tmp_path / 'runs'
  mark, stop = tmp_path / 'a.count', tmp_path / 'fail'
  # 'a' records how often it ran; its collector writes what the run directory held.
  command = py(f"""
      import os, sys
      open({str(mark)!r}, 'a').write('x')
      sys.exit(3 if os.path.exists({str(stop)!r}) else 0)
      """)
  run = runner.Run('a', command)
  first = runner.run_grid([run], out, runs_dir=runs_dir)
  shutil.rmtree(runs_dir / 'a')  # a new machine: the run directory is gone

  # Without the flag the record stands for the lost run; with it the run runs again, and
  # while the rerun has not finished (here: it fails) the old entry stays in results.json.
  runner.run_grid([run], out, runs_dir=runs_dir)
  assert mark.read_text() == 'x'
  stop.write_text('')
  failed = runner.run_grid([run], out, runs_dir=runs_dir, rerun_lost=True, exit_on_failure=False)
  assert mark.read_text() == 'xx'
  assert failed['runs'] == first['runs'] and [f['name'] for f in failed['failed']] == ['a']
  stop.unlink()
  again = runner.run_grid([run], out, runs_dir=runs_dir, rerun_lost=True)
  assert mark.read_text() == 'xxx'
  # The new entry: the failed attempt and this one, in the new run directory.
  assert first['runs'][0]['attempts'] == 1 and again['runs'][0]['attempts'] == 2
  # Its directory exists now: the flag runs nothing more.
  runner.run_grid([run], out, runs_dir=runs_dir, rerun_lost=True)
  assert mark.read_text() == 'xxx'


def test_rerun_lost_by_name_runs_again_only_the_named_lost_runs(tmp_path):
  """An experiment names the lost runs that later runs start from (their checkpoints): those
  run again, the other recorded runs still count as finished, and a name outside the grid is
  an error before anything runs."""
  out, runs_dir = tmp_path / 'exp', tmp_path / 'runs'
  count = lambda name: py(f"open({str(tmp_path / name)!r}, 'a').write('x')")
  runs = [runner.Run('source', count('source')), runner.Run('other', count('other'))]
  runner.run_grid(runs, out, runs_dir=runs_dir)
  shutil.rmtree(runs_dir)  # a new machine
  with pytest.raises(ValueError, match="not in the grid: \\['typo'\\]"):
    runner.run_grid(runs, out, runs_dir=runs_dir, rerun_lost={'typo'})
  runner.run_grid(runs, out, runs_dir=runs_dir, rerun_lost={'source'})
  assert (tmp_path / 'source').read_text() == 'xx' and (tmp_path / 'other').read_text() == 'x'
  assert runner.recorded(out) == {'source', 'other'} and runner.recorded(tmp_path) == set()


def test_only_starts_the_matching_runs_and_keeps_the_records_of_the_others(tmp_path, capsys):
  """`only` (a grid's `--only`): the runs matching a pattern start, the others wait for another
  invocation; finished runs outside the patterns stay recorded; a pattern matching no run says so.
  """
  out, runs_dir = tmp_path / 'exp', tmp_path / 'runs'
  count = lambda name: py(f"open({str(tmp_path / name)!r}, 'a').write('x')")
  runs = [runner.Run(name, count(name)) for name in ('a-lr1', 'a-lr3', 'b-lr1', 'b-lr3')]
  ran = lambda: sorted(p.name for p in tmp_path.iterdir() if p.is_file())

  results = runner.run_grid(runs, out, runs_dir=runs_dir, only=['*-lr3', 'c-*'])
  assert ran() == ['a-lr3', 'b-lr3']
  assert names(results) == ['a-lr3', 'b-lr3'] and results['unfinished'] == ['a-lr1', 'b-lr1']
  assert "--only 'c-*' matches no run of this grid" in capsys.readouterr().out

  results = runner.run_grid(runs, out, runs_dir=runs_dir, only=['b-lr1', 'a-lr3'])
  assert ran() == ['a-lr3', 'b-lr1', 'b-lr3']
  assert names(results) == ['a-lr3', 'b-lr1', 'b-lr3']  # grid order; none ran twice
  assert all((tmp_path / name).read_text() == 'x' for name in ran())
  said = capsys.readouterr().out
  assert '1 to run, 1 left for another invocation (--only)' in said
  assert 'matches no run' not in said  # 'a-lr3' matches a finished run

  results = runner.run_grid(runs, out, runs_dir=runs_dir)  # no patterns: the rest
  assert ran() == ['a-lr1', 'a-lr3', 'b-lr1', 'b-lr3'] and results['unfinished'] == []
  # The flag: comma-separated patterns, into run_grid's keyword.
  args = runner.arg_parser(None, 'exp').parse_args(['--only=concat-h32-*,,fixed*-lr0.003-*'])
  assert runner.grid_options(args)['only'] == ['concat-h32-*', 'fixed*-lr0.003-*']


def test_pinned_runs_each_get_cpus_of_their_own_and_single_threaded_xla(tmp_path):
  usable = sorted(os.sched_getaffinity(0))
  parallel = min(2, len(usable))
  report = lambda name: py(f"""
      import json, os, time
      json.dump({{'cpus': sorted(os.sched_getaffinity(0)),
                 'xla': os.environ.get('XLA_FLAGS', '')}}, open({str(tmp_path / name)!r}, 'w'))
      time.sleep(0.5)  # overlap with the other run
      """)
  runs = [runner.Run(name, report(name)) for name in ('a', 'b', 'c')]
  runner.run_grid(
      runs, tmp_path / 'exp', runs_dir=tmp_path / 'runs', parallel=parallel, pin_cpus=True
  )
  seen = {name: json.loads((tmp_path / name).read_text()) for name in ('a', 'b', 'c')}
  size = len(usable) // parallel
  slots = {tuple(usable[i * size : (i + 1) * size]) for i in range(parallel)}
  assert {tuple(s['cpus']) for s in seen.values()} <= slots  # a slot each, reused when free
  assert tuple(seen['a']['cpus']) != tuple(seen['b']['cpus']) or parallel == 1
  for s in seen.values():
    assert ('--xla_cpu_multi_thread_eigen=false' in s['xla']) == (size == 1)
  with pytest.raises(ValueError, match='cannot each have a CPU of their own'):
    runner.run_grid(
        runs,
        tmp_path / 'exp2',
        runs_dir=tmp_path / 'runs2',
        parallel=len(usable) + 1,
        pin_cpus=True,
    )
  assert not (tmp_path / 'exp2').exists()  # refused before anything was made


def test_two_grids_writing_one_results_file_keep_each_others_runs(tmp_path):
  """Grid A reads results.json, then its run starts grid B on the same file, which finishes
  'b' first; A's own write must merge what B wrote, not restore the file it read."""
  out, runs_dir = tmp_path / 'exp', tmp_path / 'runs'
  inner = textwrap.dedent(f"""
      from experiments.runner import Run, run_grid
      import sys
      run_grid([Run('b', [sys.executable, '-c', 'pass'])], {str(out)!r}, runs_dir={str(runs_dir)!r})
  """)
  env = {**os.environ, 'PYTHONPATH': str(REPO_ROOT)}
  a = runner.Run('a', [sys.executable, '-c', inner])
  results = runner.run_grid([a], out, runs_dir=runs_dir, env=env)
  assert names(runner.load_results(out)) == ['a', 'b']
  assert names(results) == ['a', 'b']


def test_a_finished_run_of_another_command_under_the_name_stops_the_grid(tmp_path):
  """Two grids sharing a runs directory and a run name (two protocols of one experiment): the
  second finds the first's DONE with another command and refuses before running anything,
  naming the run and both commands; nothing of the other run enters its results.json. The
  same command again (another interpreter path) still counts as finished."""
  runs_dir, mark = tmp_path / 'runs', tmp_path / 'b.count'
  runner.run_grid([runner.Run('a', py('pass'))], tmp_path / 'one', runs_dir=runs_dir)
  other = runner.Run('a', py('print("the other protocol")'))
  unrelated = runner.Run('b', py(f'open({str(mark)!r}, "a").write("x")'))
  with pytest.raises(ValueError, match=r'1 run directories .*\na: its directory holds a run of'):
    runner.run_grid([unrelated, other], tmp_path / 'two', runs_dir=runs_dir)
  assert not mark.exists()
  assert not (tmp_path / 'two' / runner.RESULTS_FILE).exists()
  same = runner.Run('a', ['/elsewhere/bin/python', *py('pass')[1:]])
  assert [
      e['name'] for e in runner.run_grid([same], tmp_path / 'three', runs_dir=runs_dir)['runs']
  ] == ['a']


LONG_RUN = """
    import json, pathlib, sys
    rundir = pathlib.Path(sys.argv[1])
    lines = [{'step': step, 'split': 'train', 'loss': 10.0 / step} for step in range(1, 31)]
    lines += [{'step': step, 'split': 'eval', 'loss': 1.0 + 10.0 / step} for step in (10, 20, 30)]
    (rundir / 'metrics.jsonl').write_text(''.join(json.dumps(line) + '\\n' for line in lines))
"""


def evenly(first, last, count):
  """`count` integers from `first` to `last`, evenly spaced (rounded): numpy's own."""
  import numpy as np  # pylint: disable=import-outside-toplevel

  return [int(x) for x in np.rint(np.linspace(first, last, count))]


def test_thin_train_keeps_first_last_and_evenly_between_and_every_eval_line():
  lines = [{'step': s, 'split': 'train'} for s in range(1, 18)]  # 17 train lines
  lines.insert(5, {'step': 5, 'split': 'eval'})
  lines.append({'step': 17, 'split': 'validation'})
  thinned = runner.thin_train(lines, keep=5)
  assert [m['step'] for m in thinned if m['split'] == 'train'] == [1, 5, 9, 13, 17]
  assert [m for m in thinned if m['split'] != 'train'] == [lines[5], lines[-1]]
  assert thinned.index(lines[5]) == 2  # in its place among the train lines
  assert runner.thin_train(thinned, keep=5) == thinned  # twice changes nothing more
  assert runner.thin_train(lines[:4], keep=5) == lines[:4]
  with pytest.raises(ValueError, match='keep=1'):
    runner.thin_train(lines, keep=1)


def test_results_json_keeps_few_train_lines_and_old_full_entries_still_count(tmp_path):
  out, runs_dir = tmp_path / 'exp', tmp_path / 'runs'
  runs = [runner.Run(name, py(LONG_RUN, '{rundir}')) for name in ('a', 'b')]
  results = runner.run_grid(runs, out, runs_dir=runs_dir)
  keep = runner.TRAIN_LINES
  assert 2 <= keep < 30
  for entry in (*results['runs'], *runner.load_results(out)['runs']):
    assert [m['step'] for m in entry['metrics'] if m['split'] == 'train'] == evenly(1, 30, keep)
    assert [m['step'] for m in entry['metrics'] if m['split'] == 'eval'] == [10, 20, 30]
  # The whole curve stays in the run directory.
  assert len(runner.read_metrics(runs_dir / 'a')) == 33

  # A results.json written before the thinning (every train line) ...
  full = json.loads((out / 'results.json').read_text())
  for entry in full['runs']:
    entry['metrics'] = runner.read_metrics(runs_dir / entry['name'])
  (out / 'results.json').write_text(json.dumps(full))
  # ... is thinned by the next grid's write, also the entries of runs not in that grid ...
  runner.run_grid(runs[:1], out, runs_dir=runs_dir)
  assert runner.load_results(out)['runs'] == results['runs']
  (out / 'results.json').write_text(json.dumps(full))
  # ... and still records the runs its directories hold: that entry, or the thinned one.
  for entry in (*full['runs'], *results['runs']):
    assert runner.holds_run(entry, runs_dir / entry['name'])
  assert not runner.holds_run(full['runs'][0], runs_dir / 'b' / 'missing')
  other = {**full['runs'][0], 'metrics': full['runs'][0]['metrics'][1:]}
  assert not runner.holds_run(other, runs_dir / 'a')

  # `compact` thins that file as a grid now writes it; the runs, their directories gone,
  # still count as finished and do not run again.
  before, after = runner.compact(out)
  assert after < before
  assert runner.load_results(out)['runs'] == results['runs']
  shutil.rmtree(runs_dir)
  again = runner.run_grid(runs, out, runs_dir=runs_dir)
  assert again['runs'] == results['runs'] and not runs_dir.joinpath('a', 'metrics.jsonl').exists()


def test_results_json_leaves_out_the_resolved_config_the_collectors_read(tmp_path):
  """`full_config` (the run's config.json) reaches a collector and the run's DONE, not
  results.json; `compact` drops it from a file written before, which still counts its runs."""
  out, runs_dir = tmp_path / 'exp', tmp_path / 'runs'
  write = py(
      'import json, pathlib, sys; d = pathlib.Path(sys.argv[1]); '
      "(d / 'config.json').write_text(json.dumps({'eval_every_steps': 7, 'lr': 0.1}))",
      '{rundir}',
  )

  def collect(rundir):
    out = runner.read_run(rundir)
    return {**out, 'every': out['full_config']['eval_every_steps']}  # as the bottleneck's do

  run = runner.Run('a', write, collect=collect)
  entry = runner.run_grid([run], out, runs_dir=runs_dir)['runs'][0]
  assert entry['every'] == 7 and 'full_config' not in entry
  assert 'full_config' not in runner.load_results(out)['runs'][0]
  done = json.loads((runs_dir / 'a' / 'DONE').read_text())
  assert done['full_config'] == {'eval_every_steps': 7, 'lr': 0.1}

  old = runner.load_results(out)
  old['runs'][0]['full_config'] = done['full_config']  # as results.json kept it before
  (out / 'results.json').write_text(json.dumps(old))
  runner.compact(out)
  assert runner.load_results(out)['runs'][0] == entry
  shutil.rmtree(runs_dir)
  assert runner.run_grid([run], out, runs_dir=runs_dir)['runs'][0] == entry
  assert not (runs_dir / 'a' / 'DONE').exists()


def test_compact_command_refuses_a_file_that_is_not_a_grids_and_does_the_others(tmp_path):
  other = tmp_path / 'other' / 'results.json'
  other.parent.mkdir()
  other.write_text('[{"method": "original"}]')
  grid = tmp_path / 'grid'
  runner.run_grid([runner.Run('a', py(LONG_RUN, '{rundir}'))], grid, runs_dir=tmp_path / 'runs')
  full = runner.load_results(grid)
  full['runs'][0]['metrics'] = runner.read_metrics(tmp_path / 'runs' / 'a')
  runner.files.write_json(grid / 'results.json', full)
  done = subprocess.run(
      [sys.executable, '-m', 'experiments.runner', 'compact', str(other), str(grid)],
      cwd=REPO_ROOT,
      capture_output=True,
      text=True,
  )
  assert done.returncode == 1 and 'not a grid' in done.stderr and str(other) in done.stderr
  assert other.read_text() == '[{"method": "original"}]'
  lines = runner.load_results(grid)['runs'][0]['metrics']
  assert len([m for m in lines if m['split'] == 'train']) == runner.TRAIN_LINES


def test_a_directory_holding_another_run_than_the_record_stops_the_grid(tmp_path):
  """The same command run twice (its directory lost, the run made again elsewhere, the two
  results.json merged): the record is not replaced without a word."""
  out, runs_dir, mark = tmp_path / 'exp', tmp_path / 'runs', tmp_path / 'a.count'
  runs = [runner.Run('a', count(mark)), runner.Run('b', count(tmp_path / 'b.count'))]
  runner.run_grid(runs, out, runs_dir=runs_dir)
  first = (out / 'results.json').read_text()
  (runs_dir / 'a' / 'DONE').unlink()
  time.sleep(1.1)  # finish times have whole seconds
  runner.run_grid(runs, out, runs_dir=runs_dir, rerun_lost=['a'])  # the run made again
  assert mark.read_text() == 'xx'
  second = runner.load_results(out)
  (out / 'results.json').write_text(first)  # ... and the first one's record merged back

  with pytest.raises(ValueError, match='records the run that finished') as raised:
    runner.run_grid(runs, out, runs_dir=runs_dir)
  recorded_at = json.loads(first)['runs'][0]['finished']
  assert recorded_at in str(raised.value) and second['runs'][0]['finished'] in str(raised.value)
  assert "'b'" not in str(raised.value) and '\nb:' not in str(raised.value)
  assert (out / 'results.json').read_text() == first and mark.read_text() == 'xx'

  # Named in rerun_lost, the directory's run is taken, without running it a third time.
  taken = runner.run_grid(runs, out, runs_dir=runs_dir, rerun_lost=['a'])
  assert taken['runs'][0]['finished'] == second['runs'][0]['finished'] and mark.read_text() == 'xx'


def test_take_runs_takes_a_run_another_experiment_made_again_under_this_grids_config(tmp_path):
  """Two experiments share a runs directory and a run (same name, same command): the second
  ran it again after the first recorded it. `--take_runs` lets the first take the directory's
  run, described by its own config, without running it again; the error names the flag."""
  runs_dir, mark = tmp_path / 'runs', tmp_path / 'a.count'
  first, second = tmp_path / 'first', tmp_path / 'second'
  runs = [runner.Run('a', count(mark), config={'by': 'first'}), runner.Run('b', count(mark))]
  runner.run_grid(runs, first, runs_dir=runs_dir)
  recorded = runner.load_results(first)['runs'][0]
  (runs_dir / 'a' / 'DONE').unlink()
  time.sleep(1.1)  # finish times have whole seconds
  again = runner.run_grid(
      [runner.Run('a', count(mark), config={'by': 'second'})], second, runs_dir=runs_dir
  )['runs'][0]
  assert mark.read_text() == 'xxx' and again['finished'] != recorded['finished']

  with pytest.raises(ValueError, match='records the run that finished') as raised:
    runner.run_grid(runs, first, runs_dir=runs_dir)
  assert '--take_runs=a;' in str(raised.value)

  flags = runner.arg_parser(None, 'first').parse_args(['--take_runs=a,not-in-this-grid'])
  taken = runner.run_grid(runs, first, runs_dir=runs_dir, **runner.grid_options(flags))
  assert mark.read_text() == 'xxx'  # nothing ran again
  a, b = taken['runs']
  assert a['finished'] == again['finished'] and a['metrics'] == again['metrics']
  assert a['config'] == {'by': 'first'} and b['name'] == 'b'
  assert runner.load_results(first)['runs'][0] == a


def _experiment(folder, runs, extra_files):
  """An experiment folder as a grid leaves it: results.json recording `runs` (name -> finish
  time) and the files beside it."""
  entries = [
      {'name': name, 'finished': when, 'metrics': [{'split': 'eval', 'step': 1, 'loss': 1.0}]}
      for name, when in runs.items()
  ]
  folder.mkdir(parents=True)
  runner.files.write_json(folder / 'results.json', {'runs_dir': '/runs', 'runs': entries})
  for relative, text in extra_files.items():
    (folder / relative).parent.mkdir(parents=True, exist_ok=True)
    (folder / relative).write_text(text)


def _merge(source, dest, *take, keep=()):
  return subprocess.run(
      [sys.executable, '-m', 'experiments.runner', 'merge', str(source), str(dest)]
      + ([f'--take={",".join(take)}'] if take else [])
      + ([f'--keep={",".join(keep)}'] if keep else []),
      cwd=REPO_ROOT,
      capture_output=True,
      text=True,
  )


def test_merge_adds_what_the_other_copy_finished_and_keeps_what_both_hold(tmp_path):
  """A worktree's grid (the source) started from this checkout's results (the destination),
  which meanwhile took another worktree's runs: the merge adds the source's new runs and
  their files, keeps every record and file the destination holds, and runs again to no
  effect."""
  dest, source = tmp_path / 'main', tmp_path / 'worktree'
  _experiment(
      dest,
      {'a': 'T1', 'b': 'T2', 'elsewhere': 'T3'},
      {
          'predictions/a.json': '[1]',
          'conversions.json': '{"a": 0.1, "elsewhere": 0.3}',
          'table.json': '{"rows": 3}',
      },
  )
  (dest / 'plot.png').write_bytes(b'\x89PNG here')
  _experiment(
      source,
      {'a': 'T1', 'b': 'T2', 'c': 'T4'},
      {
          'predictions/a.json': '[1]',
          'predictions/c.json': '[3]',
          'conversions.json': '{"a": 0.1, "c": 0.4}',
          'table.json': '{"rows": 2}',
      },
  )
  (source / 'plot.png').write_bytes(b'\x89PNG there')
  (source / 'broken.json').write_text('{"cut short')
  (dest / 'broken.json').write_text('{"cut')
  before = json.loads((dest / 'results.json').read_text())
  before['runs'][0]['config'] = {'as': 'recorded here'}  # e.g. compacted here, not there
  runner.files.write_json(dest / 'results.json', before)
  done = _merge(source, dest)
  assert done.returncode == 0, done.stderr
  merged = json.loads((dest / 'results.json').read_text())
  assert [e['name'] for e in merged['runs']] == ['a', 'b', 'elsewhere', 'c']
  assert merged['runs'][:3] == before['runs']
  assert (dest / 'predictions' / 'c.json').read_text() == '[3]'
  conversions = json.loads((dest / 'conversions.json').read_text())
  assert conversions == {'a': 0.1, 'elsewhere': 0.3, 'c': 0.4}
  assert (dest / 'table.json').read_text() == '{"rows": 3}'  # a report: redrawn, not merged
  assert (dest / 'plot.png').read_bytes() == b'\x89PNG here'
  assert (dest / 'broken.json').read_text() == '{"cut'
  assert 'runs added (1): c' in done.stdout
  assert all(name in done.stdout for name in ('table.json', 'plot.png', 'broken.json'))
  snapshot = {p: p.read_bytes() for p in dest.rglob('*') if p.is_file()}
  again = _merge(source, dest)
  assert again.returncode == 0 and 'runs added (0)' in again.stdout
  assert {p: p.read_bytes() for p in dest.rglob('*') if p.is_file()} == snapshot


def _a_made_again(tmp_path):
  """This checkout's folder (`main`) and a worktree's whose grid made run `a` again (another
  finish time) and then `c`; the worktree holds a file named after `a` that main lacks."""
  dest, source = tmp_path / 'main', tmp_path / 'worktree'
  _experiment(
      dest,
      {'a': 'T1', 'b': 'T2'},
      {'predictions/a.json': '[1]', 'conversions.json': '{"a": 0.1, "b": 0.2}'},
  )
  _experiment(
      source,
      {'a': 'T9', 'b': 'T2', 'c': 'T4'},
      {
          'predictions/a.json': '[9]',
          'predictions/c.json': '[3]',
          'roles/a.json': '{"of": "T9"}',
          'conversions.json': '{"a": 0.9, "b": 0.2, "c": 0.4}',
      },
  )
  return dest, source


def test_merge_refuses_a_run_recorded_as_another_unless_taken(tmp_path):
  """The source's run `a` was lost and made again (another finish time): without --take the
  merge writes nothing and names the run; with it, the source's record and the files named
  after the run replace the destination's."""
  dest, source = _a_made_again(tmp_path)
  snapshot = {p: p.read_bytes() for p in dest.rglob('*') if p.is_file()}
  refused = _merge(source, dest)
  assert refused.returncode == 1
  assert 'a: ' in refused.stderr and 'T1' in refused.stderr and 'T9' in refused.stderr
  assert {p: p.read_bytes() for p in dest.rglob('*') if p.is_file()} == snapshot
  unknown = _merge(source, dest, 'nope')
  assert unknown.returncode == 1 and "['nope']" in unknown.stderr
  taken = _merge(source, dest, 'a')
  assert taken.returncode == 0, taken.stderr
  runs = {e['name']: e['finished'] for e in json.loads((dest / 'results.json').read_text())['runs']}
  assert runs == {'a': 'T9', 'b': 'T2', 'c': 'T4'}
  assert (dest / 'predictions' / 'a.json').read_text() == '[9]'
  assert (dest / 'roles' / 'a.json').read_text() == '{"of": "T9"}'
  assert json.loads((dest / 'conversions.json').read_text()) == {'a': 0.9, 'b': 0.2, 'c': 0.4}


def test_merge_keeps_a_run_recorded_as_another_when_kept(tmp_path):
  """The source's grid made the original `a` again (its own copy, which its new run `c`
  starts from); the destination keeps its record of `a` for its other runs: with --keep the
  merge adds `c` and its files, and leaves `a`'s record, files and keys as the destination has
  them, even where it lacks a file the source holds for `a`."""
  dest, source = _a_made_again(tmp_path)
  both = _merge(source, dest, 'a', keep=['a'])
  assert both.returncode == 1 and "both name ['a']" in both.stderr
  unknown = _merge(source, dest, keep=['nope'])
  assert unknown.returncode == 1 and '--keep names runs' in unknown.stderr
  kept = _merge(source, dest, keep=['a'])
  assert kept.returncode == 0, kept.stderr
  assert 'records kept (1): a' in kept.stdout
  runs = {e['name']: e['finished'] for e in json.loads((dest / 'results.json').read_text())['runs']}
  assert runs == {'a': 'T1', 'b': 'T2', 'c': 'T4'}
  assert (dest / 'predictions' / 'a.json').read_text() == '[1]'
  assert (dest / 'predictions' / 'c.json').read_text() == '[3]'
  assert not (dest / 'roles' / 'a.json').exists()
  assert json.loads((dest / 'conversions.json').read_text()) == {'a': 0.1, 'b': 0.2, 'c': 0.4}


def test_merge_takes_the_record_of_a_run_collected_again_only_when_named(tmp_path):
  """A worktree's grid ran `--refresh`: its record of `a` is the same run (same finish time)
  with a new result. A plain merge keeps the destination's record; `--take=a` replaces it."""
  dest, source = tmp_path / 'main', tmp_path / 'worktree'
  _experiment(dest, {'a': 'T1', 'b': 'T2'}, {})
  _experiment(source, {'a': 'T1', 'b': 'T2'}, {})
  results = json.loads((source / 'results.json').read_text())
  results['runs'][0]['result'] = {'rows': [1.5, 2.5]}
  runner.files.write_json(source / 'results.json', results)
  records = lambda: {e['name']: e for e in json.loads((dest / 'results.json').read_text())['runs']}
  plain = _merge(source, dest)
  assert plain.returncode == 0, plain.stderr
  assert 'result' not in records()['a']
  taken = _merge(source, dest, 'a')
  assert taken.returncode == 0, taken.stderr
  assert records()['a']['result'] == {'rows': [1.5, 2.5]} and 'records taken (1): a' in taken.stdout
  assert 'result' not in records()['b']
