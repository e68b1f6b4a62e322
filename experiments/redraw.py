"""Redraw every generated README section from the committed files and say which differ.

    python -m experiments.redraw [--sections=bottleneck/sweep,heads/voita] [--list]

A README's results lie between `<!-- name -->` and `<!-- /name -->`, written by its script
(`runner.write_section`) from the committed results; `SECTIONS` holds the command that redraws
each one (`--plot_only` or `--report_only`, with the flags that select it). Each command runs in
a scratch git worktree at HEAD, so the working tree is not touched and uncommitted changes are
not checked; after each, the worktree's tracked files are compared with HEAD and put back.
A section is `identical` (its README written again, nothing tracked changed), `differs` (the
files that changed, then the README lines), `not written` (the command exited 0 without writing
its README: flags that select no section) or `failed` (the command's exit status and last
lines). Exit status 1 unless every section is identical.

Runs directories: `{runs}` in a command is a scratch directory, so a redraw reads committed
files only (a script that finds a run directory recorded in its results may still copy files
from it, as its `--plot_only` does anywhere). Run time on the 2-core CPU: one to two hours
for all sections at nice 19 beside a training run, most of it the GLUE sections' bootstrap
intervals.
"""

import argparse
from collections.abc import Mapping, Sequence
import dataclasses
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time

from experiments.runner import REPO_ROOT

EXPERIMENTS = 'experiments'

_CONVERGENCE = ['-m', 'experiments.bottleneck.convergence', '--plot_only', '--runs_dir={runs}']
_GLUE_REPARAM = ['-m', 'experiments.collaborative.glue_reparam', '--plot_only', '--runs_dir={runs}']
_NMT = ['-m', 'experiments.collaborative.reparametrize_nmt', '--plot_only', '--runs_dir={runs}']

# '<folder>/<section>' (the README experiments/<folder>/README.md) -> the interpreter's arguments
# that redraw it; the commands the READMEs and LOG.md files state.
SECTIONS: dict[str, list[str]] = {
    'bottleneck/expressivity': [
        '-m',
        'experiments.bottleneck.expressivity',
        '--plot_only',
        '--runs_dir={runs}',
    ],
    'bottleneck/sweep': ['-m', 'experiments.bottleneck.sweep', '--plot_only', '--runs_dir={runs}'],
    'bottleneck/convergence': _CONVERGENCE + ['--steps=3000'],
    'bottleneck/convergence-12000st': _CONVERGENCE
    + ['--steps=12000', '--rate_steps=3000', '--stage=seeds', '--seeds=0,1'],
    'bottleneck/convergence-24000st': _CONVERGENCE
    + ['--steps=24000', '--rate_steps=3000', '--stage=seeds', '--seeds=0,1,2'],
    'bottleneck/convergence-24000st-drop0.1': _CONVERGENCE
    + ['--steps=24000', '--rate_steps=3000', '--stage=width', '--seeds=0,1', '--dropout=0.1'],
    'collaborative/glue_finetuned': _GLUE_REPARAM,
    'collaborative/glue_pretrained': _GLUE_REPARAM + ['--decompose=pretrained'],
    'collaborative/glue_finetuned-lr2e-05': _GLUE_REPARAM + ['--second_learning_rate=2e-5'],
    'collaborative/glue_finetuned-e10': _GLUE_REPARAM + ['--second_epochs=10'],
    'collaborative/minilm': ['-m', 'experiments.collaborative.reparametrize_minilm', '--plot_only'],
    'collaborative/stsb_zero_shot': [
        '-m',
        'experiments.collaborative.stsb_zero_shot',
        '--report_only',
    ],
    'collaborative/nmt': _NMT,
    'collaborative/nmt_seeds': _NMT
    + [
        # The source as the grid named it: the section's first line quotes it.
        '--source=/work/runs/multi30k/base',
        '--name=nmt_seeds',
        '--key_dims=64,32',
        '--methods=collaborative',
        '--seeds=0,1,2',
    ],
    'collaborative/from_scratch': [
        '-m',
        'experiments.collaborative.from_scratch',
        '--plot_only',
        '--runs_dir={runs}',
    ],
    'glue/finetune': ['-m', 'experiments.glue.finetune', '--plot_only', '--runs_dir={runs}'],
    'heads/results': ['-m', 'experiments.heads.run', '--plot_only', '--runs_dir={runs}'],
    'heads/voita': [
        '-m',
        'experiments.heads.run',
        '--protocol=voita',
        '--plot_only',
        # Without this run directory the baseline row comes from the committed voita/baseline.json.
        '--base=/work/runs/multi30k/base',
        '--runs_dir={runs}',
    ],
    'heads/glue_pruning': [
        '-m',
        'experiments.heads.glue_pruning',
        '--plot_only',
        '--runs_dir={runs}',
    ],
    'heads/roles-corpora': [
        '-m',
        'experiments.heads.roles',
        '--readme=experiments/heads/README.md',
    ],
}

_MARKER = re.compile(r'^<!-- ([A-Za-z0-9_.-]+) -->$', re.MULTILINE)


def readme_sections(root: pathlib.Path = REPO_ROOT) -> list[str]:
  """'<folder>/<section>' of every generated section in experiments/*/README.md under `root`."""
  found = []
  for readme in sorted((root / EXPERIMENTS).glob('*/README.md')):
    found += [f'{readme.parent.name}/{name}' for name in _MARKER.findall(readme.read_text())]
  return found


@dataclasses.dataclass
class Outcome:
  section: str
  status: str  # 'identical', 'differs', 'not written' or 'failed'
  detail: str = ''
  seconds: float = 0.0


def _environment(repo: pathlib.Path) -> dict[str, str]:
  """The commands' environment: LOWRANK_ATTN_DATA made absolute (the worktree lies elsewhere),
  or the checkout's ../shared/data where it has one and the variable is unset (as `make`)."""
  env = {**os.environ, 'PYTHONPATH': ''}
  data = os.environ.get('LOWRANK_ATTN_DATA')
  if data:
    env['LOWRANK_ATTN_DATA'] = str(pathlib.Path(data).resolve())
  elif (repo.parent / 'shared' / 'data').is_dir():
    env['LOWRANK_ATTN_DATA'] = str((repo.parent / 'shared' / 'data').resolve())
  return env


def _git(tree: pathlib.Path, *args: str) -> str:
  done = subprocess.run(['git', '-C', str(tree), *args], capture_output=True, text=True, check=True)
  return done.stdout


def _exit_on_sigterm(signum, frame):
  raise SystemExit(128 + signum)  # so that the scratch worktree is removed on the way out


def redraw(
    sections: Mapping[str, Sequence[str]],
    repo: pathlib.Path = REPO_ROOT,
    python: str = sys.executable,
    log=print,
) -> list[Outcome]:
  """Runs each section's command in a scratch worktree of `repo` at HEAD; one Outcome each."""
  outcomes = []
  previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
  with tempfile.TemporaryDirectory(prefix='redraw-') as scratch:
    tree, runs = pathlib.Path(scratch) / 'tree', pathlib.Path(scratch) / 'runs'
    _git(repo, 'worktree', 'add', '--detach', '--quiet', str(tree), 'HEAD')
    try:
      for section, args in sections.items():
        command = [python, *(a.replace('{runs}', str(runs)) for a in args)]
        log(f'redraw: {section}: {" ".join(command[1:])}')
        readme = tree / EXPERIMENTS / section.split('/')[0] / 'README.md'
        before = readme.stat().st_mtime_ns
        started = time.time()
        done = subprocess.run(
            command, cwd=tree, capture_output=True, text=True, env=_environment(repo)
        )
        seconds = time.time() - started
        changed = _git(tree, 'status', '--porcelain', '--untracked-files=no')
        if done.returncode != 0:
          tail = '\n'.join((done.stdout + done.stderr).strip().splitlines()[-15:])
          outcome = Outcome(section, 'failed', f'exit status {done.returncode}:\n{tail}', seconds)
        elif readme.stat().st_mtime_ns == before:
          outcome = Outcome(
              section, 'not written', f'{readme.relative_to(tree)} untouched', seconds
          )
        elif changed:
          diff = _git(tree, 'diff', '--unified=0', '--', '*.md')
          lines = [l for l in diff.splitlines() if l[:1] in '+-' and l[:3] not in ('+++', '---')]
          outcome = Outcome(section, 'differs', changed + '\n'.join(lines[:40]), seconds)
        else:
          outcome = Outcome(section, 'identical', '', seconds)
        log(f'redraw: {section}: {outcome.status} ({seconds:.0f} s)')
        outcomes.append(outcome)
        _git(tree, 'checkout', '--quiet', '--', '.')
    finally:
      signal.signal(signal.SIGTERM, previous)
      _git(repo, 'worktree', 'remove', '--force', str(tree))
  return outcomes


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument(
      '--sections', help='comma-separated <folder>/<section> names (default: every one)'
  )
  parser.add_argument('--list', action='store_true', help='print the sections and commands')
  args = parser.parse_args(argv)
  missing = sorted(set(readme_sections()) - set(SECTIONS))
  if missing:
    raise SystemExit(f'redraw: no command for the README sections {", ".join(missing)}')
  chosen = args.sections.split(',') if args.sections else list(SECTIONS)
  unknown = [s for s in chosen if s not in SECTIONS]
  if unknown:
    raise SystemExit(f'redraw: unknown sections {", ".join(unknown)}; --list names them')
  if args.list:
    for section in chosen:
      print(f'{section}: python {" ".join(SECTIONS[section])}')
    return 0
  outcomes = redraw({s: SECTIONS[s] for s in chosen})
  print()
  for o in outcomes:
    print(f'{o.section}: {o.status} ({o.seconds:.0f} s)' + (f'\n{o.detail}' if o.detail else ''))
  return int(any(o.status != 'identical' for o in outcomes))


if __name__ == '__main__':
  sys.exit(main())
