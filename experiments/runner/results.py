"""Reading a grid's results: a run's metrics, results.json, one row per run or per metrics
line, aggregates over seeds, and the README line saying what ran where and for how long."""

from collections.abc import Collection, Iterable, Mapping, Sequence
import dataclasses
import json
import math
import os
import pathlib
from typing import Any

from experiments.runner import files
from experiments.runner.files import METRICS_FILE, RESULT_FILE, RESULTS_FILE

# The train lines results.json keeps per run: the run's whole curve is in its metrics.jsonl and
# TensorBoard; results.json is the grid's committed record (eval lines, result.json, config),
# and a GLUE fine-tune's train lines were two thirds of it.
TRAIN_LINES = 8


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


def thin_train(lines: Sequence[Mapping[str, Any]], keep: int = TRAIN_LINES) -> list[Any]:
  """`lines` with at most `keep` (>= 2) of their train lines: the first, the last and evenly
  spaced between them, in order; every other split's lines stay. Thinning twice changes
  nothing more."""
  if keep < 2:
    raise ValueError(f'keep={keep}: at least the first and the last train line stay')
  train = [i for i, line in enumerate(lines) if line['split'] == 'train']
  if len(train) <= keep:
    return list(lines)
  kept = {train[round(j * (len(train) - 1) / (keep - 1))] for j in range(keep)}
  return [line for i, line in enumerate(lines) if line['split'] != 'train' or i in kept]


def thin_entry(entry: Mapping[str, Any]) -> Mapping[str, Any]:
  """A results.json entry as results.json keeps it: its train lines thinned (`thin_train`)
  and without `full_config`, the resolved config `read_run` gives the collectors (2-3 KB a
  run; it stays in the run directory's config.json and DONE, and the entry's `command` at its
  `code` commit resolves it again)."""
  thin = {key: value for key, value in entry.items() if key != 'full_config'}
  return {**thin, 'metrics': thin_train(entry['metrics'])} if 'metrics' in entry else thin


def read_run(rundir: str | os.PathLike) -> dict[str, Any]:
  """The default collector: metrics.jsonl (without the hparams line), result.json, config.json.

  `metrics`: the lines of `read_metrics`, train lines thinned (`thin_train`); `result`: the
  run's own `result.json` ({} if none); `full_config`: the resolved config our training CLI
  writes (omitted if absent), for collectors that need it; results.json leaves it out
  (`thin_entry`).
  """
  rundir = pathlib.Path(rundir)
  out = {
      'metrics': thin_train([m for m in read_metrics(rundir) if m['split'] != 'hparams']),
      'result': files.read_json(rundir / RESULT_FILE) or {},
  }
  full_config = files.read_json(rundir / 'config.json')
  if full_config is not None:
    out['full_config'] = full_config
  return out


def holds_run(entry: Mapping[str, Any], rundir: str | os.PathLike) -> bool:
  """Whether `rundir` holds the run that results.json's `entry` records: its metrics lines
  are the entry's (not a run of the same name trained again since, e.g. by another
  experiment sharing the runs directory, whose results.json records that one). An entry
  written before its train lines were thinned (`compact`) still matches."""
  as_text = lambda lines: json.dumps(lines, sort_keys=True)  # NaN equals NaN here
  return 'metrics' in entry and as_text(read_run(rundir)['metrics']) == as_text(
      thin_train(entry['metrics'])
  )


def compact(path: str | os.PathLike) -> tuple[int, int]:
  """Thins the train lines of every run results.json (the file or its folder) records, as
  `read_run` now collects them; returns the file's size in bytes before and after."""
  path = pathlib.Path(path)
  path = path / RESULTS_FILE if path.is_dir() else path
  with files.results_lock(path):  # not while a grid merges its runs into the file
    before = path.stat().st_size
    results = load_results(path)
    if not isinstance(results, dict) or not isinstance(results.get('runs'), list):
      raise ValueError(f'{path}: not a grid\'s results.json (no list of runs under "runs")')
    files.write_json(path, {**results, 'runs': [thin_entry(entry) for entry in results['runs']]})
    return before, path.stat().st_size


def load_results(path: str | os.PathLike) -> dict[str, Any]:
  """results.json, given the file or the experiment folder that holds it."""
  path = pathlib.Path(path)
  return json.loads((path / RESULTS_FILE if path.is_dir() else path).read_text())


def recorded(path: str | os.PathLike) -> set[str]:
  """The names of the runs results.json (the file or its folder) records as finished; none
  if it does not exist yet."""
  path = pathlib.Path(path)
  found = files.read_json(path / RESULTS_FILE if path.is_dir() else path)
  return {entry['name'] for entry in (found or {}).get('runs', [])}


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
  return [
      {**_run_row(run), **line}
      for run in results['runs']
      for line in run.get('metrics', ())
      if line['split'] == split
  ]


def runs_summary(results: Mapping[str, Any], names: Iterable[str] | None = None) -> str:
  """A README line: how many runs, their run time, and the machines they ran on.

  A grid that is not through yet says so: 'N of M runs finished (still to run: ...)'.
  names: count only these runs (finished, failed or still to run), for a README section that
    reports part of what results.json holds; None: every run.
  """
  keep = (lambda name: True) if names is None else set(names).__contains__
  runs = [run for run in results['runs'] if keep(run['name'])]
  if not runs:
    return 'No finished runs.'
  failed = [f['name'] for f in results.get('failed', []) if keep(f['name'])]
  unfinished = [name for name in results.get('unfinished', []) if keep(name)]
  left = [
      f'{label}: {", ".join(names)}'
      for label, names in (('failed', failed), ('still to run', unfinished))
      if names
  ]
  total = len(runs) + len(failed) + len(unfinished)
  count = (
      f'{len(runs)} of {total} runs finished ({"; ".join(left)})' if left else (f'{len(runs)} runs')
  )
  times = [run.get('wall_time_total_s', run['wall_time_s']) for run in runs]
  machines = []
  for run in runs:
    m = run.get('machine', {})
    line = (
        f"{m.get('cpu', '?')} ({m.get('cpus_available', m.get('cpu_count', '?'))} CPUs "
        f"available), {m.get('platform', '?')}, Python {m.get('python', '?')}, "
        f"jax {m.get('jax', '?')}"
    )
    if m.get('gpus'):
      line += ' with ' + ', '.join(m['gpus'])
    if line not in machines:
      machines.append(line)
  return (
      f'{count}, {_duration(sum(times))} of run time in all (longest '
      f'{_duration(max(times))}), on ' + '; '.join(machines) + '.'
  )


def aggregate(
    rows: Iterable[Mapping[str, Any]], by: Sequence[str], values: Sequence[str]
) -> list[dict[str, Any]]:
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
      agg[f'{key}_std'] = (
          math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
          if len(xs) > 1
          else 0.0
          if xs
          else None
      )
      agg[f'{key}_min'] = min(xs) if xs else None
      agg[f'{key}_max'] = max(xs) if xs else None
    out.append(agg)
  return out


def _run_row(run: Mapping[str, Any]) -> dict[str, Any]:
  return {
      'name': run['name'],
      'seed': run.get('seed'),
      **(run.get('config') or {}),
      'wall_time_s': run.get('wall_time_s'),  # the last attempt's
      'wall_time_total_s': run.get('wall_time_total_s', run.get('wall_time_s')),
      'attempts': run.get('attempts', 1),
  }


def _duration(seconds: float) -> str:
  if seconds < 120:
    return f'{seconds:.0f} s'
  return f'{seconds / 60:.1f} min' if seconds < 7200 else f'{seconds / 3600:.1f} h'


def _hashable(value):
  return json.dumps(value, sort_keys=True) if isinstance(value, (list, dict)) else value


@dataclasses.dataclass
class Merged:
  """What `merge` did, by run name and by path relative to the experiment folder."""

  added: list[str] = dataclasses.field(default_factory=list)  # runs new to the destination
  taken: list[str] = dataclasses.field(default_factory=list)  # records replaced (`take`)
  kept: list[str] = dataclasses.field(default_factory=list)  # records kept (`keep`)
  copied: list[str] = dataclasses.field(default_factory=list)  # files new to it, or taken
  extended: list[str] = dataclasses.field(default_factory=list)  # JSON objects given new keys
  left: list[str] = dataclasses.field(default_factory=list)  # other files that differ


def merge(
    source: str | os.PathLike,
    dest: str | os.PathLike,
    take: Collection[str] = (),
    keep: Collection[str] = (),
) -> Merged:
  """Adds to the experiment folder `dest` what another copy of it, `source`, holds and it does
  not: the runs a worktree's grid or an accelerator call finished since the two parted.

  results.json: a run `dest` does not record is added; one both record as the same run
  (`another_run`: the same finish time) stays as `dest` has it; one both record as two runs (the
  run lost and made again) is a conflict, unless `take` names it: then `source`'s record replaces
  it (as it replaces the record of the same run where `take` names one that a grid's `--refresh`
  collected again there); or `keep` does: then `dest`'s stays, with its files (the runs `source`
  finished from its own copy of that run are still added). Any conflict stops the merge before
  anything is written.
  The other files under `source` (e.g. a run's kept predictions): a file `dest` lacks is
  copied, and so is one named after a taken run (`<name>.json`), and none named after a kept
  run; a JSON object is given the keys it lacks (a key both hold with other values leaves the
  file, unless the key is a taken run's name, or a kept run's: that keeps its value); any
  other file that differs is left as `dest` has it and listed in `left`: tables and plots,
  which the experiment's `--plot_only` redraws from the merged files.
  results.json is written last, so a merge cut short is completed by running it again."""
  source, dest = pathlib.Path(source), pathlib.Path(dest)
  theirs = load_results(source)
  ours = files.read_json(dest / RESULTS_FILE) or {'runs': []}
  take, keep = set(take), set(keep)
  recorded_there = {entry['name'] for entry in theirs['runs']}
  for flag, names in (('--take', take), ('--keep', keep)):
    if names - recorded_there:
      raise ValueError(
          f'merge: {flag} names runs {source / RESULTS_FILE} does not record: '
          f'{sorted(names - recorded_there)}'
      )
  if take & keep:
    raise ValueError(f'merge: --take and --keep both name {sorted(take & keep)}')
  merged, out = {entry['name']: entry for entry in ours['runs']}, Merged()
  conflicts = []
  for entry in theirs['runs']:
    name = entry['name']
    if name not in merged:
      merged[name] = entry
      out.added.append(name)
    elif name in take:  # made again there, or the same run collected again (--refresh)
      merged[name] = entry
      out.taken.append(name)
    elif not another_run(merged[name], entry):
      continue
    elif name in keep:
      out.kept.append(name)
    else:
      conflicts.append(
          f'{name}: {dest / RESULTS_FILE} records the run that finished '
          f'{merged[name].get("finished")}, {source / RESULTS_FILE} one that finished '
          f'{entry.get("finished")}'
      )
  if conflicts:
    raise ValueError(
        f'merge: {len(conflicts)} runs are recorded as other runs in the two folders:\n'
        + '\n'.join(conflicts)
        + "\nNothing was written. To take the source's records, name them in --take; to keep "
        "the destination's (and add the source's runs that start from its copy), in --keep."
    )
  for path in sorted(p for p in source.rglob('*') if p.is_file()):
    relative = path.relative_to(source)
    if relative == pathlib.Path(RESULTS_FILE):
      continue
    target, data = dest / relative, path.read_bytes()
    if path.stem in keep or (target.exists() and data == target.read_bytes()):
      continue
    if not target.exists() or path.stem in take:
      target.parent.mkdir(parents=True, exist_ok=True)
      files.write_bytes(target, data)
      out.copied.append(str(relative))
      continue
    extended = _extended(target, path, take, keep) if path.suffix == '.json' else None
    if extended is not None:
      files.write_json(target, extended)
      out.extended.append(str(relative))
    else:
      out.left.append(str(relative))
  with files.results_lock(dest / RESULTS_FILE):
    found = files.read_json(dest / RESULTS_FILE) or {}
    files.write_json(dest / RESULTS_FILE, {**theirs, **found, 'runs': list(merged.values())})
  return out


def another_run(record: Mapping[str, Any], other: Mapping[str, Any]) -> bool:
  """Whether two records of a run name (results.json's, a DONE file's, another copy's
  results.json's) are two runs: each records when it finished (records without the time are
  taken to be the same run)."""
  return None not in (record.get('finished'), other.get('finished')) and (
      record['finished'] != other['finished']
  )


def _extended(
    ours: pathlib.Path, theirs: pathlib.Path, take: Collection[str], keep: Collection[str]
) -> dict[str, Any] | None:
  """The JSON object in `ours` with the keys of the one in `theirs` it lacks (taken runs' keys
  replaced, kept runs' left), when the two agree on every other key they share; else None."""
  try:
    ours, theirs = files.read_json(ours), files.read_json(theirs)
  except ValueError:  # not JSON after all (UnicodeDecodeError is one)
    return None
  if not (isinstance(ours, dict) and isinstance(theirs, dict)):
    return None
  theirs = {key: value for key, value in theirs.items() if key not in keep}
  if any(key not in take and ours[key] != value for key, value in theirs.items() if key in ours):
    return None
  return {**ours, **theirs}
