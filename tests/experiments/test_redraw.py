"""experiments/redraw.py: every generated README section has a redraw command, and a redraw in
a scratch worktree tells identical from differs and failed without touching the working tree."""

import signal
import subprocess
import sys
import time

import pytest

from experiments import redraw

README = """# x

<!-- table -->
| a |
|---|
| 1 |
<!-- /table -->
"""


def test_every_readme_section_has_a_redraw_command_and_every_command_a_section():
  found = redraw.readme_sections()
  assert len(found) == len(set(found))
  assert sorted(found) == sorted(redraw.SECTIONS)


def git(repo, *args):
  subprocess.run(['git', '-C', str(repo), *args], check=True, capture_output=True)


def writes(value):
  """A script body that writes the section with `value` in its table, as a redraw does."""
  text = README.replace('| 1 |', f'| {value} |')
  return ['-c', f'import pathlib; pathlib.Path("experiments/x/README.md").write_text({text!r})']


def fake_repo(tmp_path):
  """A git repository with one experiment README holding one section, committed."""
  repo = tmp_path / 'repo'
  (repo / 'experiments' / 'x').mkdir(parents=True)
  (repo / 'experiments' / 'x' / 'README.md').write_text(README)
  git(repo, 'init', '-q')
  git(repo, '-c', 'user.name=t', '-c', 'user.email=t@t', 'add', '.')
  git(repo, '-c', 'user.name=t', '-c', 'user.email=t@t', 'commit', '-qm', 'x')
  return repo


def worktrees(repo):
  listed = subprocess.run(
      ['git', '-C', str(repo), 'worktree', 'list'], capture_output=True, text=True, check=True
  )
  return listed.stdout.strip().splitlines()


def test_redraw_tells_identical_from_differs_and_failed_at_head(tmp_path):
  repo = fake_repo(tmp_path)
  readme = repo / 'experiments' / 'x' / 'README.md'
  assert redraw.readme_sections(repo) == ['x/table']
  path = 'experiments/x/README.md'
  readme.write_text(README + 'an edit not committed\n')  # the check runs at HEAD
  outcomes = redraw.redraw(
      {
          'x/same': writes(1),
          'x/other': writes(2),
          'x/broken': ['-c', 'import sys; print("no results"); sys.exit(3)'],
          'x/silent': ['-c', 'print("README.md has no section x")'],
          # Writes the README as it finds it: the worktree was put back after 'x/other'.
          'x/after': [
              '-c',
              f'import pathlib; p = pathlib.Path({path!r}); p.write_text(p.read_text())',
          ],
      },
      repo=repo,
      python=sys.executable,
      log=lambda line: None,
  )
  assert [(o.section, o.status) for o in outcomes] == [
      ('x/same', 'identical'),
      ('x/other', 'differs'),
      ('x/broken', 'failed'),
      ('x/silent', 'not written'),
      ('x/after', 'identical'),
  ]
  assert 'experiments/x/README.md' in outcomes[1].detail
  assert '-| 1 |' in outcomes[1].detail and '+| 2 |' in outcomes[1].detail
  assert 'exit status 3' in outcomes[2].detail and 'no results' in outcomes[2].detail
  assert readme.read_text() == README + 'an edit not committed\n'
  assert len(worktrees(repo)) == 1  # the scratch worktree is gone from the repository's list


def test_a_redraw_stopped_by_sigterm_removes_its_worktree(tmp_path):
  """A grid-style stop (SIGTERM, as a deadline watcher sends) ends the running command and
  leaves no scratch worktree behind."""
  repo = fake_repo(tmp_path)
  code = (
      'import pathlib\n'
      'from experiments import redraw\n'
      f"redraw.redraw({{'x/slow': ['-c', 'import time; time.sleep(120)']}}, "
      f'repo=pathlib.Path({str(repo)!r}), log=lambda line: print(line, flush=True))\n'
  )
  proc = subprocess.Popen(
      [sys.executable, '-c', code], cwd=redraw.REPO_ROOT, stdout=subprocess.PIPE, text=True
  )
  assert proc.stdout.readline().startswith('redraw: x/slow: ')
  assert len(worktrees(repo)) == 2
  time.sleep(0.5)
  proc.send_signal(signal.SIGTERM)
  assert proc.wait(timeout=60) == 128 + signal.SIGTERM
  assert len(worktrees(repo)) == 1


def test_an_unknown_section_is_refused_by_name(capsys):
  with pytest.raises(SystemExit, match='unknown sections heads/nothing'):
    redraw.main(['--sections=heads/nothing'])
  assert redraw.main(['--list', '--sections=heads/voita']) == 0
  assert '--protocol=voita' in capsys.readouterr().out


def test_the_data_directory_reaches_the_commands_as_an_absolute_path(tmp_path, monkeypatch):
  """The worktree lies elsewhere, so a relative LOWRANK_ATTN_DATA would name another place;
  unset, it is the checkout's ../shared/data where that exists, as under `make`."""
  (tmp_path / 'shared' / 'data').mkdir(parents=True)
  repo = tmp_path / 'repo'
  monkeypatch.chdir(repo.parent)
  monkeypatch.setenv('LOWRANK_ATTN_DATA', 'shared/data')
  assert redraw._environment(repo)['LOWRANK_ATTN_DATA'] == str(tmp_path / 'shared' / 'data')
  monkeypatch.delenv('LOWRANK_ATTN_DATA')
  assert redraw._environment(repo)['LOWRANK_ATTN_DATA'] == str(tmp_path / 'shared' / 'data')
  assert 'LOWRANK_ATTN_DATA' not in redraw._environment(tmp_path / 'shared' / 'repo')
