"""experiments/gpu_runs.py: a finished run packed with its parameters in float16, unpacked into
another runs directory, where a grid of the same command counts it as finished and a run that
starts from it reads the rounded parameters."""

import json
import pathlib
import sys
import textwrap

import numpy as np
import pytest

from experiments import gpu_runs, runner
from lowrank_attn.runs import RunDir

# A training run's stand-in: config.json, metrics.jsonl and a checkpoint (step 30: parameters,
# an integer leaf, and optimizer state that does not travel).
WRITE_RUN = textwrap.dedent("""
    import json, pathlib, sys
    import jax.numpy as jnp, numpy as np
    from lowrank_attn.train import checkpoints
    run = pathlib.Path(sys.argv[1])
    (run / 'config.json').write_text(json.dumps({'seed': 3}))
    (run / 'metrics.jsonl').write_text('{"step": 30, "split": "eval", "score": 71.5}\\n')
    rng = np.random.default_rng(0)
    params = {
        'encoder': {'layers': {0: {'kernel': rng.standard_normal((4, 8), np.float32)}}},
        'position_ids': np.arange(6, dtype=np.int32),
    }
    checkpointer = checkpoints.Checkpointer(str(run), keep=1, async_save=False)
    checkpointer.save(30, {'step': jnp.asarray(30, jnp.int32), 'params': params,
                           'opt_state': {'mu': params['encoder']}}, {})
    checkpointer.close()
""")


def training_run():
  return runner.Run('original-s0', [sys.executable, '-c', WRITE_RUN, '{rundir}'], seed=0)


def leaves(tree, prefix=''):
  if isinstance(tree, dict):
    return {k: v for key, sub in tree.items() for k, v in leaves(sub, f'{prefix}/{key}').items()}
  return {prefix: np.asarray(tree)}


@pytest.fixture(scope='module')
def finished_run(tmp_path_factory):
  """The stand-in run, finished by a grid in runs directory `here/runs`."""
  here = tmp_path_factory.mktemp('here')
  results = runner.run_grid([training_run()], here / 'exp', runs_dir=here / 'runs')
  assert [r['name'] for r in results['runs']] == ['original-s0']
  return here / 'runs' / 'original-s0'


def test_unpacked_run_is_finished_for_the_grid_and_holds_the_rounded_parameters(
    finished_run, tmp_path
):
  packed, there = tmp_path / 'packed', tmp_path / 'there'
  gpu_runs.pack(packed, [finished_run])
  # What travels: the parameters alone, in float16 (the integers as they are).
  travelled = leaves(RunDir(packed / 'original-s0').params())
  assert travelled['/encoder/layers/0/kernel'].dtype == np.float16
  assert travelled['/position_ids'].dtype == np.int32

  assert gpu_runs.unpack(packed, there) == ['original-s0']
  copy = RunDir(there / 'original-s0')
  assert copy.steps() == [30]
  original, restored = leaves(RunDir(finished_run).params()), leaves(copy.params())
  assert restored.keys() == original.keys()
  kernel = original['/encoder/layers/0/kernel']
  assert restored['/encoder/layers/0/kernel'].dtype == np.float32
  np.testing.assert_array_equal(
      restored['/encoder/layers/0/kernel'], kernel.astype(np.float16).astype(np.float32)
  )
  assert not np.array_equal(restored['/encoder/layers/0/kernel'], kernel)  # rounded indeed
  np.testing.assert_array_equal(restored['/position_ids'], np.arange(6))
  for name in ('config.json', 'metrics.jsonl', 'DONE', 'attempts.jsonl', 'log.txt'):
    assert (there / 'original-s0' / name).read_bytes() == (finished_run / name).read_bytes()

  # A grid there, of the same command: nothing runs again (the command would overwrite the
  # rounded parameters with the original's), and its results hold the run's record.
  results = runner.run_grid([training_run()], tmp_path / 'exp', runs_dir=there)
  assert [r['name'] for r in results['runs']] == ['original-s0']
  assert json.loads((there / 'original-s0' / 'attempts.jsonl').read_text().splitlines()[-1])
  assert len((there / 'original-s0' / 'attempts.jsonl').read_text().splitlines()) == len(
      (finished_run / 'attempts.jsonl').read_text().splitlines()
  )
  np.testing.assert_array_equal(
      leaves(RunDir(there / 'original-s0').params())['/encoder/layers/0/kernel'],
      kernel.astype(np.float16).astype(np.float32),
  )

  # A second unpack (a later call on the warm machine) leaves the finished run alone.
  assert gpu_runs.unpack(packed, there) == []


def test_only_finished_runs_travel_and_unfinished_ones_there_are_not_overwritten(
    finished_run, tmp_path
):
  unfinished = tmp_path / 'runs' / 'original-s1'
  unfinished.mkdir(parents=True)
  with pytest.raises(ValueError, match=r'original-s1 has no DONE: only finished runs'):
    gpu_runs.pack(tmp_path / 'packed', [finished_run, unfinished])
  assert not (tmp_path / 'packed').exists()  # nothing packed halfway

  gpu_runs.pack(tmp_path / 'packed', [finished_run])
  with pytest.raises(ValueError, match='is not empty'):
    gpu_runs.pack(tmp_path / 'packed', [finished_run])
  started = tmp_path / 'there' / 'original-s0'
  started.mkdir(parents=True)
  (started / 'log.txt').write_text('a run the grid started there\n')
  with pytest.raises(ValueError, match=r'original-s0 holds an unfinished run \(no DONE\)'):
    gpu_runs.unpack(tmp_path / 'packed', tmp_path / 'there')
  assert (started / 'log.txt').read_text() == 'a run the grid started there\n'
  with pytest.raises(ValueError, match='holds no packed run'):
    gpu_runs.unpack(tmp_path / 'there' / 'original-s0', tmp_path / 'elsewhere')


def test_the_copy_keeps_done_last(monkeypatch, finished_run, tmp_path):
  """A copy cut short before its DONE does not count as finished (the grid would run it)."""
  copied = []
  real_copy = gpu_runs.shutil.copy2
  monkeypatch.setattr(
      gpu_runs.shutil, 'copy2', lambda a, b: (copied.append(pathlib.Path(b).name), real_copy(a, b))
  )
  gpu_runs.pack(tmp_path / 'packed', [finished_run])
  runner_files = [name for name in copied if name in gpu_runs.RUNNER_FILES]
  assert runner_files[-1] == 'DONE'
