"""Seed 1 at 12,000 steps from what its runs left: the periodic evaluation at the last step.

    python -m experiments.bottleneck.seed1_periodic \\
        /work/runs/bottleneck_convergence_h100_seed1_partial

The six seed-1 runs of stage seeds at 12,000 steps (2026-11-26, fifth session, an H100) reached
their last step, but the device time ended before their final evaluation on the whole
validation split (`convergence.evaluate_run`, from the final checkpoint, which did not come
back), so they have no DONE and no results.json entry. Their periodic evaluations on the
validation split's first 24 batches did come back (`metrics.jsonl`); seed 0 has the same number
in results.json (`bits_per_char_periodic`). This writes both per arm, and fixed_head minus concat
at h = 8 and 32 per seed, to `convergence/seed1_periodic-12000st.json`.
"""

import json
import math
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
STEPS = 12000


def main(runs_dir: str, out_dir: pathlib.Path = HERE / 'convergence') -> dict:
  """Reads `<out_dir>/results.json` (seed 0) and the seed-1 runs; writes the JSON beside it."""
  runs = pathlib.Path(runs_dir)
  recorded = json.loads((out_dir / 'results.json').read_text())['runs']
  seed0 = {entry['name']: entry['result'] for entry in recorded}
  out = {
      'what': (
          'bits/char on the first 24 validation batches (the periodic evaluation) at step '
          f"{STEPS:,}; seed 0 from results.json, seed 1 from its runs' metrics.jsonl (eval loss "
          '/ ln 2): the seed-1 runs have no final whole-validation evaluation'
      ),
      'runs_dir_seed1': str(runs),
      'arms': {},
  }
  for rundir in sorted(runs.glob(f'*-{STEPS}st-s1')):
    arm = rundir.name.removesuffix('-s1')
    lines = (json.loads(line) for line in (rundir / 'metrics.jsonl').open())
    last = [m for m in lines if m.get('split') == 'eval' and m['step'] == STEPS]
    if not last:
      raise ValueError(f'{rundir}: no periodic evaluation at step {STEPS}')
    result = seed0[f'{arm}-s0']
    out['arms'][arm] = {
        'seed0': round(result['bits_per_char_periodic'], 4),
        'seed1': round(last[-1]['loss'] / math.log(2), 4),
        'whole_validation_seed0': round(result['bits_per_char'], 4),
    }
  arms = out['arms']
  for h in (8, 32):
    (fixed,) = [a for a in arms if a.startswith(f'fixed128-h{h}-')]
    (concat,) = [a for a in arms if a.startswith(f'concat-h{h}-')]
    out[f'fixed_minus_concat_h{h}'] = {
        seed: round(arms[fixed][seed] - arms[concat][seed], 4) for seed in ('seed0', 'seed1')
    }
  path = out_dir / f'seed1_periodic-{STEPS}st.json'
  path.write_text(json.dumps(out, indent=1) + '\n')
  return out


if __name__ == '__main__':
  print(json.dumps(main(sys.argv[1]), indent=1))
