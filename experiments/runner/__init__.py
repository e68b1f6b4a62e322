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
`results.json` in the experiment folder is rebuilt from the DONE files after every finished run;
it keeps every eval line but at most `TRAIN_LINES` train lines per run (the first, the last and
evenly between: the whole curve stays in the run's metrics.jsonl and TensorBoard).
Each attempt records the code it ran (`code`: the commit of the commands' checkout and the
tracked Python files modified in it), because a command imports the code anew at every (re)start: a
grid run from a tree someone is editing says so in its log, its attempts and its DONE entry.
Run long grids from a checkout nobody edits (`git worktree add ../exp HEAD`), with `python -m`
from its root: a script run by its path (`tpu/compile.py`, `benchmarks/*.py`) imports the package
from where the venv's editable install points (the main checkout) unless `PYTHONPATH` names
the worktree.

`python -m experiments.runner status RUNS_DIR` lists the state of each run directory;
`python -m experiments.runner compact RESULTS...` thins a results.json written before that.
`python -m experiments.runner merge SOURCE DEST` adds to an experiment folder the runs another
copy of it (a worktree's, an accelerator call's) finished since the two parted.

One module per concern, their public names all here (`from experiments import runner`):
`grid` (Run, train_run, run_grid, status: the scheduler), `results` (reading metrics and
results.json, rows, aggregates), `report` (plots, Markdown tables, README sections),
`provenance` (machine, code version, where runs go), `files` (what a run directory holds;
the one whole-file writer), `cli` (the command line).
"""

from experiments.runner import files, grid, provenance, report, results
from experiments.runner.cli import main
from experiments.runner.files import (
    ATTEMPTS_FILE,
    DONE_FILE,
    LOCK_FILE,
    LOG_FILE,
    METRICS_FILE,
    RESULT_FILE,
    RESULTS_FILE,
)
from experiments.runner.grid import Run, arg_parser, grid_options, run_grid, status, train_run
from experiments.runner.provenance import (
    REPO_ROOT,
    RUNS_ENV,
    code_version,
    default_runs_dir,
    machine,
)
from experiments.runner.report import markdown_table, plot_lines, write_section
from experiments.runner.results import (
    TRAIN_LINES,
    aggregate,
    bleu_of,
    compact,
    final,
    history,
    holds_run,
    load_results,
    merge,
    read_metrics,
    read_run,
    recorded,
    runs_summary,
    thin_entry,
    thin_train,
)
