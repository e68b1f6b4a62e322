"""experiments/gpu_slim_index.sh in a scratch repository: `slim` takes the non-Python files
under the given folders out of the index (on disk, ignored meanwhile), `restore` puts back
exactly what it took and the exclude file as it was; both refuse what would lose work."""

import pathlib
import subprocess

import pytest

SCRIPT = pathlib.Path(__file__).parents[2] / 'experiments' / 'gpu_slim_index.sh'


def git(repo, *args):
  return subprocess.run(
      ['git', *args], cwd=repo, check=True, capture_output=True, text=True
  ).stdout.split('\n')


@pytest.fixture
def repo(tmp_path):
  files = {
      'experiments/gpu_slim_index.sh': SCRIPT.read_text(),
      'experiments/heads/results.json': '{}',
      'experiments/heads/run.py': 'print()',
      'experiments/heads/glue/table.json': '[]',
      'experiments/collaborative/results.json': '{}',
  }
  for name, text in files.items():
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text(text)
  git(tmp_path, 'init', '-q')
  git(tmp_path, 'add', '-A')
  git(tmp_path, '-c', 'user.name=t', '-c', 'user.email=t@t', 'commit', '-qm', 'x')
  (tmp_path / '.git' / 'info').mkdir(exist_ok=True)
  (tmp_path / '.git' / 'info' / 'exclude').write_text('/.whl/\n')
  return tmp_path


def slim(repo, *args):
  return subprocess.run(
      ['bash', 'experiments/gpu_slim_index.sh', *args], cwd=repo, capture_output=True, text=True
  )


def test_slim_leaves_the_data_out_of_the_index_and_restore_puts_it_back(repo):
  before = git(repo, 'ls-files')
  assert slim(repo, 'slim', 'experiments/heads').returncode == 0
  tracked = set(git(repo, 'ls-files')) - {''}
  assert tracked == {
      'experiments/gpu_slim_index.sh',
      'experiments/heads/run.py',  # the code travels
      'experiments/collaborative/results.json',  # not under the folder named
  }
  assert (repo / 'experiments/heads/glue/table.json').exists()  # on disk still
  assert git(repo, 'status', '--porcelain', '--untracked-files=all') == [
      'D  experiments/heads/glue/table.json',
      'D  experiments/heads/results.json',
      '',
  ]
  refused = slim(repo, 'slim')
  assert refused.returncode == 1 and 'restore first' in refused.stderr
  assert slim(repo, 'restore').returncode == 0
  assert git(repo, 'ls-files') == before
  assert git(repo, 'status', '--porcelain', '--untracked-files=all') == ['']
  assert (repo / '.git/info/exclude').read_text() == '/.whl/\n'
  assert slim(repo, 'restore').returncode == 1  # nothing in force


def test_slim_refuses_a_staged_change_and_a_folder_without_data(repo):
  (repo / 'experiments/heads/results.json').write_text('{"runs": []}')
  git(repo, 'add', 'experiments/heads/results.json')
  refused = slim(repo, 'slim')
  assert refused.returncode == 1 and 'staged changes' in refused.stderr
  git(repo, 'reset', '-q')
  refused = slim(repo, 'slim', 'experiments/nothing')
  assert refused.returncode == 1 and 'no tracked non-Python file' in refused.stderr
  assert not (repo / '.git/gpu_slim').exists()
