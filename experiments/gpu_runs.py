r"""Finished runs for a GPU machine that takes 64 MiB a call: each run's slim copy
(`RunDir.write_slim_copy`: config, vocabulary, final evaluations, the last checkpoint's
parameters) with the parameters rounded to float16, and the runner's files (`DONE`,
`attempts.jsonl`, `log.txt`). Unpacked into the runs directory of a grid there, such a run
counts as finished (its DONE records its command) and the runs that start from it (SST-2's
analyses, conversions and fine-tunes from its fine-tuned original) start from the rounded copy.

    # here: .gpu_runs/ (git-ignored), carried to the GPU machine
    python -m experiments.gpu_runs pack .gpu_runs /work/runs/glue_reparam/sst2-original-s0
    # there (experiments/gpu_grid.sh does it when it finds .gpu_runs/):
    python3 -m experiments.gpu_runs unpack .gpu_runs /tmp/gpu_grid_runs

Fine-tuned MiniLM: 45 MB packed instead of 91. The rounding is a deviation of every run that
starts from the copy; `python -m experiments.gpu_runs check RUN OUT.json` measures what it
changes in a GLUE run's dev predictions and score.
"""

import argparse
import json
import pathlib
import shutil

import numpy as np

from experiments.runner.files import ATTEMPTS_FILE, DONE_FILE, LOG_FILE

# Copied beside the parameters; DONE last, so that a copy cut short never counts as finished.
RUNNER_FILES = (LOG_FILE, ATTEMPTS_FILE, DONE_FILE)


def pack(dest: pathlib.Path, runs: list[pathlib.Path]) -> None:
  """`dest/<run name>/`: each finished run's slim copy, parameters in float16."""
  from lowrank_attn.runs import RunDir  # pylint: disable=g-import-not-at-top  (JAX: lazily)

  if dest.exists() and any(dest.iterdir()):
    raise ValueError(f'pack: {dest} is not empty: pack writes a new directory.')
  names = [run.name for run in runs]
  if len(set(names)) != len(names):
    raise ValueError(f'pack: two runs of one name in {names}: a runs directory holds one.')
  for run in runs:
    if not (run / DONE_FILE).is_file():
      raise ValueError(f'pack: {run} has no {DONE_FILE}: only finished runs travel.')
  for run in runs:
    RunDir(run).write_slim_copy(dest / run.name, dtype=np.float16)
    _copy_runner_files(run, dest / run.name)


def unpack(packed: pathlib.Path, runs_dir: pathlib.Path) -> list[str]:
  """Each packed run into `runs_dir/<name>/`, its parameters in float32 again; the names
  unpacked. A run already finished there (an earlier call on a warm machine) is left alone; a
  directory there without DONE (a run the grid started, a copy cut short) is an error."""
  from lowrank_attn.runs import RunDir  # pylint: disable=g-import-not-at-top

  sources = sorted(p for p in packed.iterdir() if p.is_dir())
  if not sources:
    raise ValueError(f'unpack: {packed} holds no packed run.')
  done = []
  for source in sources:
    target = runs_dir / source.name
    if (target / DONE_FILE).is_file():
      print(f'gpu_runs: {target} is finished already; left as it is')
      continue
    if target.exists() and any(target.iterdir()):
      raise ValueError(
          f'unpack: {target} holds an unfinished run (no {DONE_FILE}): remove it to unpack '
          f'{source.name} there, or give another runs directory.'
      )
    RunDir(source).write_slim_copy(target, dtype=np.float32)
    _copy_runner_files(source, target)
    done.append(source.name)
    print(f'gpu_runs: unpacked {source.name} into {target}')
  return done


def _copy_runner_files(source: pathlib.Path, target: pathlib.Path) -> None:
  for name in RUNNER_FILES:
    if (source / name).is_file():
      shutil.copy2(source / name, target / name)


def check(run: pathlib.Path, out: pathlib.Path) -> dict:
  """A GLUE run's dev score and predictions, from its parameters and from their float16
  rounding (pack, then unpack)."""
  import tempfile  # pylint: disable=g-import-not-at-top

  from experiments.heads import glue_pruning  # pylint: disable=g-import-not-at-top
  from lowrank_attn import tasks  # pylint: disable=g-import-not-at-top
  from lowrank_attn.runs import RunDir  # pylint: disable=g-import-not-at-top
  from lowrank_attn.tasks.glue import glue_metrics, glue_task  # pylint: disable=g-import-not-at-top

  config = RunDir(run).config
  task = glue_task(config.data.name)[0]
  dev = list(
      tasks.make_pipeline(
          config.data,
          split='validation',
          seed=config.seed,
          global_batch_size=32,
          train=False,
          workdir=str(run),
      )
  )
  predicted = {}
  with tempfile.TemporaryDirectory() as scratch:
    scratch = pathlib.Path(scratch)
    pack(scratch / 'packed', [run])
    unpack(scratch / 'packed', scratch / 'runs')
    for name, path in (('original', run), ('float16_rounded', scratch / 'runs' / run.name)):
      predicted[name], labels = glue_pruning.dev_predictions(RunDir(path).model(), dev)
  a, b = predicted['original'], predicted['float16_rounded']
  result = {
      'run': run.name,
      'task': task,
      'examples': int(len(labels)),
      **{name: glue_metrics(task, p, labels)['score'] for name, p in predicted.items()},
      'predictions_changed': int(np.sum(a != b)),
      'max_prediction_difference': float(np.max(np.abs(a.astype(float) - b.astype(float)))),
  }
  out.write_text(json.dumps(result, indent=1) + '\n')
  return result


def main(argv=None):
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  sub = parser.add_subparsers(dest='command', required=True)
  packing = sub.add_parser('pack')
  packing.add_argument('dest', type=pathlib.Path)
  packing.add_argument('runs', type=pathlib.Path, nargs='+')
  unpacking = sub.add_parser('unpack')
  unpacking.add_argument('packed', type=pathlib.Path)
  unpacking.add_argument('runs_dir', type=pathlib.Path)
  checking = sub.add_parser('check')
  checking.add_argument('run', type=pathlib.Path)
  checking.add_argument('out', type=pathlib.Path)
  args = parser.parse_args(argv)
  if args.command == 'pack':
    pack(args.dest, args.runs)
  elif args.command == 'unpack':
    unpack(args.packed, args.runs_dir)
  else:
    print(check(args.run, args.out))


if __name__ == '__main__':
  main()
