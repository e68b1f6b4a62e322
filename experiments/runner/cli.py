"""`python -m experiments.runner status RUNS_DIR`: the state of each run directory.
`python -m experiments.runner compact RESULTS...`: thins the train lines of results.json files
written before results.json kept at most `results.TRAIN_LINES` of them per run.
`python -m experiments.runner manifest`: writes provenance.MANIFEST in this checkout, for a copy
of it without .git (an accelerator machine's) to record the commit its runs ran.
`python -m experiments.runner merge SOURCE DEST [--take NAMES]`: adds to the experiment folder
DEST the runs (and their kept files) another copy of it, SOURCE, finished since the two parted:
a worktree's grid, an accelerator call's unpacked experiment.tar.gz (`results.merge`)."""

import argparse
from collections.abc import Sequence
import pathlib
import sys

from experiments.runner.grid import status
from experiments.runner.provenance import REPO_ROOT, write_manifest
from experiments.runner.results import TRAIN_LINES, compact, merge
from experiments.runner.report import markdown_table


def main(argv: Sequence[str] | None = None) -> None:
  from experiments import runner  # pylint: disable=import-outside-toplevel  (for its docstring)

  parser = argparse.ArgumentParser(
      prog='python -m experiments.runner',
      description=runner.__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  commands = parser.add_subparsers(dest='command', required=True)
  status_parser = commands.add_parser('status', help='the state of each run in RUNS_DIR')
  status_parser.add_argument('runs_dir')
  commands.add_parser(
      'manifest', help=f'write the commit and file hashes for copies of {REPO_ROOT}'
  )
  compact_parser = commands.add_parser(
      'compact', help=f'keep at most {TRAIN_LINES} train lines per run in results.json files'
  )
  compact_parser.add_argument('results', nargs='+', help='results.json files or their folders')
  merge_parser = commands.add_parser(
      'merge', help='add the runs another copy of an experiment folder finished to this one'
  )
  merge_parser.add_argument('source', help="the other copy's experiment folder")
  merge_parser.add_argument('dest', help='the experiment folder to add them to (this checkout)')
  merge_parser.add_argument(
      '--take',
      default='',
      help="comma-separated runs whose records in SOURCE replace DEST's (the run was lost "
      "and made again there, or collected again there by a grid's --refresh)",
  )
  merge_parser.add_argument(
      '--keep',
      default='',
      help='comma-separated runs recorded as other runs in SOURCE whose records in DEST stay '
      "(SOURCE's runs that start from its copy are added)",
  )
  args = parser.parse_args(argv)
  if args.command == 'merge':
    if not (pathlib.Path(args.source) / 'results.json').exists():
      sys.exit(f'merge: no results.json in {args.source}')
    if not pathlib.Path(args.dest).is_dir():
      sys.exit(f'merge: no such folder: {args.dest}')
    try:
      done = merge(
          args.source,
          args.dest,
          take=[n for n in args.take.split(',') if n],
          keep=[n for n in args.keep.split(',') if n],
      )
    except ValueError as e:
      sys.exit(str(e))
    for label, names in (
        ('runs added', done.added),
        ('records taken', done.taken),
        ('records kept', done.kept),
        ('files copied', done.copied),
        ('JSON files given new keys', done.extended),
    ):
      print(f'{label} ({len(names)}): {", ".join(names) or "-"}')
    if done.left:
      print(
          f'left as {args.dest} has them ({len(done.left)}, differing): {", ".join(done.left)}'
          "\n(tables and plots: redraw them with the experiment's --plot_only)"
      )
    return
  if args.command == 'compact':  # every file it can; then exit 1 if it refused any
    refused = [path for path in args.results if not pathlib.Path(path).exists()]
    for path in refused:
      print(f'No such file or folder: {path}', file=sys.stderr)
    for path in [path for path in args.results if path not in refused]:
      try:
        before, after = compact(path)
      except ValueError as e:
        print(f'left as it is: {e}', file=sys.stderr)
        refused.append(path)
        continue
      print(f'{path}: {before / 1024:.0f} KB -> {after / 1024:.0f} KB')
    if refused:
      sys.exit(1)
    return
  if args.command == 'manifest':
    print(write_manifest(REPO_ROOT))
    return
  if not pathlib.Path(args.runs_dir).is_dir():
    sys.exit(f'No such directory: {args.runs_dir}')
  rows = status(args.runs_dir)
  print(markdown_table(rows, ['name', 'state', 'attempts', 'wall_time_s', 'returncode']), end='')
