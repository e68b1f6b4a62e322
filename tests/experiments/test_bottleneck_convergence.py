"""experiments/bottleneck/convergence.py: the stages' run lists, the best-rate pick, equal
compute from the models' FLOPs, the flatness check and the report (no training)."""

import dataclasses
import json
import math
import pathlib
import subprocess

import numpy as np
import pytest

from experiments import runner
from experiments.bottleneck import convergence as conv

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
VOCAB = conv.VOCAB_SIZE
N = 128  # context


def plan(**kwargs):
  return conv.Plan(runs_dir=REPO_ROOT / 'runs' / 'unused', **kwargs)


def flag(run, field):
  (value,) = [a.split('=', 1)[1] for a in run.command if a.startswith(f'--config.{field}=')]
  return value


def closed_form_train_flops_per_token(emb_dim, heads, head_dim, mlp_dim, layers=2, vocab=VOCAB):
  """3 x forward matmul FLOPs per token: per layer Q, K, V, O projections (4 D h d), logits and
  weighted sum over the n positions (2 n h d), the MLP (2 D m); then the output layer (D V);
  2 FLOPs per multiply-add."""
  width = heads * head_dim
  per_layer = 2 * (4 * emb_dim * width + 2 * N * width + 2 * emb_dim * mlp_dim)
  return 3 * (layers * per_layer + 2 * emb_dim * vocab)


def test_lr_stage_is_six_arms_at_three_rates():
  p = plan()
  runs = [conv.make_run(point, p) for point in conv.lr_points(p)]
  names = [run.name for run in runs]
  assert len(names) == len(set(names)) == 18
  arms = {(a.kind, a.heads, a.d, a.emb_dim) for a in conv.LR_ARMS}
  assert arms == {
      ('concat', 1, 256, 256),
      ('concat', 2, 128, 256),
      ('concat', 8, 32, 256),
      ('concat', 32, 8, 256),
      ('fixed_head', 8, 128, 256),
      ('fixed_head', 32, 128, 256),
  }
  assert 'concat-h8-D256-lr0.003-3000st-s0' in names
  assert 'fixed128-h32-D256-lr0.01-3000st-s0' in names
  for run in runs:
    assert '--config=configs/lm.py:bottleneck' in run.command
    assert flag(run, 'seed') == '0'
    assert float(flag(run, 'learning_rate')) in (1e-3, 3e-3, 1e-2)
    assert flag(run, 'num_train_steps') == '3000'
    assert flag(run, 'warmup_steps') == '360'  # the config's 30 of 250 steps, scaled
    assert flag(run, 'eval_every_steps') == '250'  # 12 evaluations
    assert flag(run, 'num_eval_steps') == '24'
  fixed = next(r for r in runs if r.name.startswith('fixed128-h8-'))
  assert flag(fixed, 'model.attention.kind') == 'fixed_head'
  assert flag(fixed, 'model.attention.head_dim') == '128'
  # Other budgets are other runs.
  assert not set(names) & {p.name for p in conv.lr_points(plan(steps=2000))}


def test_seeds_stage_picks_each_arms_best_rate():
  p = plan()
  finals = {}
  hand = {  # arm -> bits/char at 1e-3, 3e-3, 1e-2
      conv.Arm(1): (2.10, 2.00, 2.05),
      conv.Arm(2): (1.95, 2.01, math.inf),  # 1e-2 diverged
      conv.Arm(8): (2.30, 2.20, 2.10),
      conv.Arm(8, head_dim=128): (2.0, 2.0, 2.2),  # a tie: the lower rate
      conv.Arm(32, head_dim=128): (math.inf,) * 3,  # every rate diverged: no pick
  }
  for arm, values in hand.items():
    for point, value in zip(conv.lr_points(p, [arm]), values):
      finals[point.name] = value
  # concat h = 32 has a rate without a result: no pick.
  finals[conv.Point(conv.Arm(32), 1e-3, 0, p.steps).name] = 2.0
  best, notes = conv.best_rates(finals, conv.LR_ARMS, p)
  assert best == {conv.Arm(1): 3e-3, conv.Arm(2): 1e-3, conv.Arm(8): 1e-2, conv.Arm(8, 128): 1e-3}
  assert len(notes) == 2 and any('diverged' in n for n in notes)
  points = conv.seed_points(best, p)
  assert sorted((pt.arm.key, pt.lr, pt.seed) for pt in points) == sorted(
      (arm.key, lr, seed) for arm, lr in best.items() for seed in (0, 1)
  )
  # Seed 0 is stage lr's run: the same name and command, so the runner trains it once.
  lr_runs = {pt.name: conv.make_run(pt, p) for pt in conv.lr_points(p)}
  for point in points:
    if point.seed == 0:
      assert conv.make_run(point, p).command == lr_runs[point.name].command
    else:
      assert point.name not in lr_runs


def test_analytic_flops_match_the_closed_form():
  fixed = closed_form_train_flops_per_token(128, 8, 128, 512)
  concat = closed_form_train_flops_per_token(256, 8, 32, 1024)
  assert conv.train_flops_per_token(conv.WIDTH_ARM) == pytest.approx(fixed, rel=1e-9)
  assert conv.train_flops_per_token(conv.WIDTH_BASELINE) == pytest.approx(concat, rel=1e-9)


def test_width_stage_gives_the_cheaper_model_the_steps_of_equal_compute():
  p = plan()
  fixed = closed_form_train_flops_per_token(128, 8, 128, 512)  # D = 128, h = 8, d_p = 128
  concat = closed_form_train_flops_per_token(256, 8, 32, 1024)  # D = 256, h = 8, d = 32
  assert fixed > concat  # at n = 128, h d_p = 1024 costs more than concat's 256 at twice D
  best = {conv.WIDTH_ARM: 3e-3, conv.WIDTH_BASELINE: 1e-3}
  flops = conv.width_flops()  # the models' own accounting (checked against the closed form above)
  groups = conv.width_points(best, p, flops)
  assert conv.width_points(best, p, {conv.WIDTH_ARM: fixed, conv.WIDTH_BASELINE: concat}) == groups
  steps = {(pt.arm, pt.seed): pt.steps for pt in groups['equal steps']}
  assert steps == {(arm, s): 3000 for arm in best for s in (0, 1)}
  compute = {(pt.arm, pt.seed): pt for pt in groups['equal compute']}
  assert len(compute) == 4
  want = round(3000 * fixed / concat)
  assert want == 3208
  for seed in (0, 1):
    assert compute[conv.WIDTH_BASELINE, seed].steps == want
    assert compute[conv.WIDTH_BASELINE, seed].lr == 1e-3
    assert compute[conv.WIDTH_ARM, seed].steps == 3000
    assert compute[conv.WIDTH_ARM, seed].lr == 3e-3
  # The equal-steps concat runs are the seeds stage's (same names).
  seeds = {pt.name for pt in conv.seed_points({conv.WIDTH_BASELINE: 1e-3}, p)}
  assert seeds == {pt.name for pt in groups['equal steps'] if pt.arm == conv.WIDTH_BASELINE}
  names = [pt.name for pt in conv.unique(sum(groups.values(), []))]
  assert len(names) == len(set(names)) == 6
  run = conv.make_run(compute[conv.WIDTH_BASELINE, 0], p)
  assert flag(run, 'num_train_steps') == '3208'
  assert flag(run, 'warmup_steps') == str(round(3208 * 30 / 250))
  fixed_run = conv.make_run(compute[conv.WIDTH_ARM, 0], p)
  assert flag(fixed_run, 'model.emb_dim') == '128'
  assert flag(fixed_run, 'model.mlp_dim') == '512'


def test_flatness_compares_the_last_evaluation_with_the_one_a_window_earlier():
  steps = [250 * k for k in range(1, 13)]
  falling = [[s, 3.0 - 0.0001 * s] for s in steps]  # 0.025 per window
  flat = [[s, 2.0 + 1.0 / s] for s in steps]  # 0.0003 over the last window
  assert conv.flatness(falling, 250) == {
      'flat': False,
      'last_change': pytest.approx(-0.025),
      'last_change_from': 2750,
  }
  assert conv.flatness(flat, 250)['flat'] is True
  # The threshold: 0.009 is flat, 0.011 is not, either sign.
  assert conv.flatness([[0, 2.0], [250, 2.009]], 250)['flat'] is True
  assert conv.flatness([[0, 2.0], [250, 1.989]], 250)['flat'] is False
  assert conv.flatness([[0, 2.0], [250, 2.011]], 250, tol=0.02)['flat'] is True
  # An uneven last step (equal compute: 3208 steps, evaluations every 267) is compared with the
  # evaluation at least 267 steps before it (2937), not with 3204.
  uneven = [[267 * k, 3.0 - 0.0001 * 267 * k] for k in range(1, 13)] + [[3208, 2.6]]
  result = conv.flatness(uneven, 267)
  assert result['last_change_from'] == 2937 and result['flat'] is False
  assert conv.flatness([[250, 2.0]], 250)['flat'] is None
  assert conv.flatness([], 250)['flat'] is None


def test_train_curve_is_the_mean_training_loss_over_each_evaluation_interval():
  """Each evaluation step gets the mean of the training losses logged after the evaluation
  before it, up to and including its own step, in bits (nats / ln 2); an interval with no
  training line gets no point."""
  logged = [(100, 3.0), (200, 2.0), (250, 1.0), (300, 1.5), (500, 0.5), (510, 9.0)]
  train = [{'step': step, 'split': 'train', 'loss': loss} for step, loss in logged]
  got = conv.train_curve(train, [250, 500, 505])
  assert [step for step, _ in got] == [250, 500]
  assert got[0][1] == pytest.approx((3.0 + 2.0 + 1.0) / 3 / math.log(2))
  assert got[1][1] == pytest.approx((1.5 + 0.5) / 2 / math.log(2))
  assert conv.train_curve([], [250]) == []


def test_collect_averages_every_training_line_of_the_run_not_results_jsons_few(tmp_path):
  """The training column comes from the run's whole metrics.jsonl (a line every steps/100),
  not from the handful of train lines the runner keeps for results.json; the final value
  covers the run's last eval_every_steps steps even where its last evaluation follows the one
  before by less (a run of 2,410 steps evaluating every 200: at 2,400 and 2,410)."""
  steps, every, log_every = 2410, 200, 24
  rng = np.random.default_rng(0)
  at = np.array([1, *range(log_every, steps, log_every), steps])
  losses = rng.uniform(1.0, 3.0, size=len(at))
  lines = [{'step': int(s), 'split': 'train', 'loss': float(l)} for s, l in zip(at, losses)]
  eval_steps = [*range(every, steps, every), steps]
  evals = [{'step': s, 'split': 'eval', 'loss': 1.5} for s in eval_steps]
  with open(tmp_path / runner.METRICS_FILE, 'w') as f:
    for line in sorted(lines + evals, key=lambda m: (m['step'], m['split'])):
      f.write(json.dumps(line) + '\n')
  runner.files.write_json(tmp_path / 'config.json', {'eval_every_steps': every})
  whole = {'batches': -1, 'loss': 1.4, 'seconds': 1.0, 'vocab_size': conv.VOCAB_SIZE}
  whole |= {key: 1.0 for key in conv.SIZE_KEYS if key != 'vocab_size'}
  runner.files.write_json(tmp_path / conv.WHOLE_FILE, whole)
  assert len(runner.read_run(tmp_path)['metrics']) < len(lines)  # the runner thins them
  result = conv.collect(tmp_path)['result']
  bits = lambda low, high: losses[(at > low) & (at <= high)].mean() / np.log(2)
  expected = [[end, bits(start, end)] for start, end in zip([0, *eval_steps], eval_steps)]
  assert [s for s, _ in result['train_curve']] == eval_steps
  np.testing.assert_allclose([b for _, b in result['train_curve']], [b for _, b in expected])
  assert result['train_bits_per_char'] == pytest.approx(bits(steps - every, steps))


def fake_run(point, bits, flat=True, train=None):
  return {
      'name': point.name,
      'seed': point.seed,
      'config': {},
      'wall_time_s': 600.0,
      'result': {
          'bits_per_char': bits,
          'params': 1.6e6,
          'train_flops': 1e14,
          'final_eval': {'seconds': 30.0},
          'curve': [[s, bits + 1 / s] for s in (250, 500, 750)],
          'flat': flat,
          'last_change': -0.001,
          **({'train_bits_per_char': train} if train is not None else {}),
      },
  }


def run_with_rows(point, nll):
  """A finished run whose final evaluation recorded per-row nats `nll` over rows of 128
  characters (the same text for every such run), its bits/char their mean."""
  run = fake_run(point, nll.sum() / (128 * len(nll) * math.log(2)))
  run['result']['final_eval'] = {
      'seconds': 30.0,
      'row_nll': nll.tolist(),
      'row_tokens': [128] * len(nll),
      'rows_digest': 'same',
  }
  return run


def report(runs, p):
  return conv.report({'runs': runs, 'failed': [], 'unfinished': []}, p)


def longer_budget(tmp_path):
  """A plan of 24,000 steps and its 3,000-step rate sweep finished, 3e-3 the best rate of
  every arm (the width arm's included)."""
  p = conv.Plan(steps=24000, rate_steps=3000, runs_dir=tmp_path, out_dir=tmp_path / 'convergence')
  rp = p.rate_plan
  runs = [
      fake_run(q, 2.2 + (0.0 if q.lr == 3e-3 else 0.05))
      for q in conv.lr_points(rp) + conv.lr_points(rp, [conv.WIDTH_ARM])
  ]
  return p, runs


def test_report_tables_and_differences(tmp_path):
  p = conv.Plan(runs_dir=tmp_path, out_dir=tmp_path / 'convergence')
  rates = dict(zip(conv.RATES, (0.1, 0.0, 0.2)))  # 3e-3 is best for every arm
  runs = []
  for point in conv.lr_points(p) + conv.lr_points(p, [conv.WIDTH_ARM]):
    runs.append(fake_run(point, 2.0 + rates[point.lr] + 0.01 * point.arm.heads))
  best = {arm: 3e-3 for arm in conv.LR_ARMS}
  for point in conv.seed_points(best, p):
    if point.seed == 1:
      base = 2.0 + 0.01 * point.arm.heads
      runs.append(fake_run(point, base + 0.004))
  wbest = {conv.WIDTH_ARM: 3e-3, conv.WIDTH_BASELINE: 3e-3}
  names = {r['name'] for r in runs}
  for point in sum(conv.width_points(wbest, p, conv.width_flops()).values(), []):
    if point.name not in names:
      names.add(point.name)
      runs.append(fake_run(point, 2.05, flat=False))
  text = report(runs, p)
  assert '**Stage lr**' in text and '**Stage seeds**' in text and '**Stage width**' in text
  assert text.count('(best)') == 6 + 1
  # h = 8: fixed (2.08, 2.084) minus concat (2.08, 2.084): zero, within the seed range.
  assert '- h = 8: +0.0000 bits/char' in text
  assert 'seed 0: +0.0000; seed 1: +0.0000' in text
  assert 'equal compute, fixed_head D = 128 minus concat D = 256' in text
  assert '3208 steps' in text
  for png in ('convergence_rates.png', 'convergence_best.png', 'convergence_width.png'):
    assert (p.out_dir / png).exists()


def test_a_longer_budget_with_no_width_run_yet_links_no_plot(tmp_path):
  """A grid at a longer budget reported before its first width run finishes (a run spanning
  sessions): the section says so and neither draws nor links the width plot; once one run has
  finished, its row, the plot and the link are there, and no difference is claimed."""
  p, runs = longer_budget(tmp_path)
  text = report(runs, p)
  png = p.out_dir / 'convergence_width-24000st.png'
  assert 'No run of 24000 steps has finished yet.' in text
  assert 'convergence_width-24000st.png' not in text and not png.exists()
  assert '**Stage seeds**' not in text
  first = conv.Point(conv.WIDTH_ARM, 3e-3, 0, 24000)
  runs.append(fake_run(first, 2.0))
  text = report(runs, p)
  assert 'No run of 24000 steps has finished yet.' not in text
  assert '| fixed_head | 8 | 128 | 128 | 0.003 | 24000 | 1 | 2.0000 |' in text
  assert '![width stage learning curves](convergence/convergence_width-24000st.png)' in text
  assert png.exists()
  assert 'minus concat D = 256' not in text


def test_a_longer_budget_shows_its_own_rate_runs_once_one_leaves_the_picked_rate(tmp_path):
  """`--rate_steps`: stage lr's runs at the section's own budget (run with `--only` on a slow
  machine) get a table of their own once one is at a rate other than the 3,000-step pick, with
  fixed_head minus concat at equal rates and each fully swept arm's best rate at this budget."""
  p, runs = longer_budget(tmp_path)  # every arm picked 3e-3 at 3,000 steps
  at = lambda arm, lr, bits: fake_run(conv.Point(arm, lr, 0, 24000), bits)
  fixed32, concat32 = conv.Arm(32, head_dim=conv.LENGTH), conv.Arm(32)
  runs += [at(concat32, 3e-3, 2.02), at(fixed32, 3e-3, 2.03)]  # stage seeds' seed 0
  assert '**Stage lr at 24000 steps**' not in report(runs, p)
  runs += [at(concat32, 1e-3, 2.00), at(fixed32, 1e-3, 1.95)]
  text = report(runs, p)
  assert '**Stage lr at 24000 steps** (seed 0) as far as it has run, 4 of 21 runs' in text
  assert text.count('| 0.003 (picked) | 24000 |') == 2 and '| 0.001 | 24000 | 1 | 2.0000 |' in text
  assert '- h = 32, lr 0.001: -0.0500 bits/char' in text
  assert '- h = 32, lr 0.003: +0.0100 bits/char' in text
  assert 'best at 24000 steps' not in text  # no arm has all three rates yet
  assert (p.out_dir / 'convergence_rates-24000st.png').exists()
  assert '(convergence/convergence_rates-24000st.png)' in text
  assert text.startswith('25 runs, ')  # the 21 of the sweep and these 4
  runs.append(at(concat32, 1e-2, 2.30))
  text = report(runs, p)
  assert (
      '- concat, h = 32, d = 8, D = 256: best at 24000 steps lr 0.001, at 3000 steps 0.003.' in text
  )
  # The swept arm's other rates against its best; no interval where runs lack their rows.
  assert '- concat, h = 32, d = 8, D = 256, lr 0.003 minus 0.001: +0.0200 bits/char' in text
  assert '- concat, h = 32, d = 8, D = 256, lr 0.01 minus 0.001: +0.3000 bits/char' in text
  assert text.count('minus 0.001: ') == 2 and 'minus 0.003: ' not in text
  # The section with dropout reports the sweep without dropout, not this table again.
  assert '**Stage lr at 24000 steps**' not in report(runs, dataclasses.replace(p, dropout=0.1))


def test_the_train_column_shows_where_runs_record_training_bits_and_gives_the_gap(tmp_path):
  """Runs collected with a training curve get the column (seed mean, final minus it); tables
  of runs collected before it (here the 3000-step sweep) keep their old columns."""
  p, runs = longer_budget(tmp_path)
  text = report(runs, p)
  assert conv.TRAIN_HEADER not in text
  for seed, (bits, train) in enumerate([(2.0, 1.9), (2.1, 1.95)]):
    runs.append(fake_run(conv.Point(conv.WIDTH_ARM, 3e-3, seed, 24000), bits, train=train))
  text = report(runs, p)
  # One table has the column (its header and the budget line's explanation name it).
  assert text.count(f'| {conv.TRAIN_HEADER} |') == 1
  assert text.count(conv.TRAIN_HEADER) == 2
  # Seed means 2.05 and 1.925: the gap is +0.125.
  assert (
      '| 2.0500 (seeds: 2.0000, 2.1000; range 0.1000) | yes (-0.001, -0.001) | 1.9250 (gap +0.1250) |'
      in text
  )
  # A run without the record leaves the group's cell empty rather than averaging one seed.
  del runs[-1]['result']['train_bits_per_char']
  text = report(runs, p)
  assert f'| {conv.TRAIN_HEADER} |' not in text
  assert '| 2.0500 (seeds: 2.0000, 2.1000; range 0.1000) | yes (-0.001, -0.001) | 1.60M |' in text


def test_a_section_summarises_only_the_runs_it_reports(tmp_path):
  """results.json holds every budget's runs; a section's first line counts, times and places
  only the runs it reports, and its budget line explains the training column only where one of
  its tables shows it."""
  p, runs = longer_budget(tmp_path)  # 21 runs of 3000 steps, 600 s each
  elsewhere = conv.Point(conv.WIDTH_ARM, 3e-3, 0, 12000)  # a budget no section below reports
  runs.append({**fake_run(elsewhere, 2.0, train=1.8), 'wall_time_s': 9000.0})
  runs[-1]['machine'] = {'cpu': 'Elsewhere CPU'}
  short = conv.Plan(steps=3000, runs_dir=tmp_path, out_dir=tmp_path / 'convergence')
  text = report(runs, short)
  assert text.startswith('21 runs, 3.5 h of run time in all (longest 10.0 min), on ? (')
  assert 'Elsewhere' not in text and conv.TRAIN_HEADER not in text
  width = conv.Point(conv.WIDTH_ARM, 3e-3, 0, 24000)
  runs.append({**fake_run(width, 2.0, train=1.9), 'wall_time_s': 1200.0})
  runs.append(fake_run(conv.Point(conv.WIDTH_BASELINE, 3e-3, 0, 24000), 1.9))
  text = report(runs, p)
  assert text.startswith('23 runs, 4.0 h of run time in all (longest 20.0 min), on ')
  assert 'Elsewhere' not in text and text.count(conv.TRAIN_HEADER) == 2
  # With dropout: its runs, the sweep and the runs without dropout it is compared with (not
  # concat's, whose run with dropout has not finished).
  runs.append(fake_run(dataclasses.replace(width, dropout=0.1), 2.1))
  text = report(runs, dataclasses.replace(p, dropout=0.1))
  assert text.startswith('23 runs, 4.0 h of run time in all (longest 20.0 min), on ')


def test_a_seeds_stage_with_one_arm_of_a_pair_finished_claims_no_difference(tmp_path):
  """The width stage's concat run at a longer budget is also stage seeds' concat h = 8 run:
  with it finished and no fixed_head run at that budget, stage seeds shows its row and says no
  difference can be given (no heading over an empty list); with fixed_head h = 8 finished
  too, the difference is there."""
  p, runs = longer_budget(tmp_path)
  runs.append(fake_run(conv.Point(conv.Arm(8), 3e-3, 0, 24000), 1.98))
  text = report(runs, p)
  seeds = text.split('**Stage seeds**')[1].split('**Stage width**')[0]
  assert '| concat | 8 | 32 | 256 | 0.003 | 24000 | 1 | 1.9800 |' in seeds
  assert 'minus concat at the same h' not in seeds
  assert 'no difference' in seeds
  runs.append(fake_run(conv.Point(conv.Arm(8, head_dim=conv.LENGTH), 3e-3, 0, 24000), 1.97))
  text = report(runs, p)
  seeds = text.split('**Stage seeds**')[1].split('**Stage width**')[0]
  assert 'minus concat at the same h' in seeds and '- h = 8' in seeds
  assert 'no difference' not in seeds


def test_a_run_failed_in_one_stage_and_finished_in_a_later_one_is_no_failure(tmp_path, monkeypatch):
  """A grid's failure (a data-preparation race, say) that a later stage's grid reran to the end
  must not make the report say 'Failed' nor the command exit non-zero."""
  p = conv.Plan(runs_dir=tmp_path, out_dir=tmp_path / 'convergence')
  name = conv.lr_points(p, [conv.WIDTH_BASELINE])[1].name  # in stage lr and stage width
  calls = []

  def fake_grid(runs, *args, **kwargs):
    calls.append([r.name for r in runs])
    if len(calls) == 1:
      return {'runs': [], 'failed': [{'name': name, 'why': 'exit code 1'}], 'unfinished': []}
    return {'runs': [{'name': name, 'result': {}}], 'failed': [], 'unfinished': []}

  monkeypatch.setattr(conv.runner, 'run_grid', fake_grid)
  failures = {}
  conv.run_stages(p, 'all', {'parallel': 2, 'refresh': False}, failures=failures)
  assert len(calls) == 2 and name in calls[0] and name in calls[1]  # stages lr and width
  assert failures == {}


def run_all_stages(p, short, monkeypatch, rerun_lost=False, lost=None):
  """`run_stages(p, 'all')` with the grid faked: `short`'s rate sweep recorded as finished in
  p's results.json, 1e-2 best for every arm (bits/char lowest at the highest rate), the width
  model twice the baseline's FLOPs. Returns the run names each grid call was given (and, into
  `lost`, what each call was told to run again of the runs whose directories are gone)."""
  swept = conv.lr_points(short) + conv.lr_points(short, [conv.WIDTH_ARM])
  runs = [{'name': q.name, 'result': {'bits_per_char': 3.0 - q.lr}} for q in swept]
  p.out_dir.mkdir(exist_ok=True)
  runner.files.write_json(p.out_dir / runner.RESULTS_FILE, {'runs': runs, 'failed': []})
  calls = []

  def fake_grid(runs, *args, **kwargs):
    calls.append([r.name for r in runs])
    if lost is not None:
      lost.append(kwargs['rerun_lost'])
    return {'runs': [], 'failed': [], 'unfinished': []}

  monkeypatch.setattr(conv.runner, 'run_grid', fake_grid)
  flops = {conv.WIDTH_ARM: 2.0, conv.WIDTH_BASELINE: 1.0}
  monkeypatch.setattr(conv, 'width_flops', lambda in_subprocess=False: flops)
  options = {'parallel': 1, 'refresh': False}
  conv.run_stages(p, 'all', options, failures={}, rerun_lost=rerun_lost)
  return calls


def test_rerun_lost_trains_again_the_runs_of_this_budget_never_a_shorter_sweeps(
    tmp_path, monkeypatch
):
  """--rerun_lost (runs recorded, directories gone: trained again to record their rows) at
  --steps=12000 --rate_steps=3000: the grids of stages seeds and width at 12,000 steps are told
  to run their lost runs again; the 3,000-step sweeps, whose picks they would move, are not.
  Without a rate plan the rate sweep is this budget's own; without the flag, nothing."""
  p = conv.Plan(steps=12000, rate_steps=3000, runs_dir=tmp_path, out_dir=tmp_path / 'out')
  short = conv.Plan(steps=3000, runs_dir=tmp_path, out_dir=tmp_path / 'out')
  lost = []
  calls = run_all_stages(p, short, monkeypatch, rerun_lost=True, lost=lost)
  assert lost == [False, calls[1], False, calls[3]]
  own = tmp_path / 'own'
  own.mkdir()
  lost = []
  mine = conv.Plan(steps=3000, runs_dir=own, out_dir=own / 'out')
  calls = run_all_stages(mine, mine, monkeypatch, rerun_lost=True, lost=lost)
  assert lost[0] == calls[0] == [q.name for q in conv.lr_points(mine)]
  lost = []
  run_all_stages(mine, mine, monkeypatch, lost=lost)
  assert lost and not any(lost)


def test_a_longer_budget_takes_its_rates_from_a_shorter_budgets_sweep(tmp_path, monkeypatch):
  """--steps=12000 --rate_steps=3000: stages seeds and width train at 12,000 steps at the rates
  the 3,000-step sweep picked; the sweep itself is not trained again at 12,000."""
  p = conv.Plan(steps=12000, rate_steps=3000, runs_dir=tmp_path, out_dir=tmp_path / 'out')
  short = conv.Plan(steps=3000, runs_dir=tmp_path, out_dir=tmp_path / 'out')
  assert p.rate_plan == dataclasses.replace(short, rate_steps=None) and short.rate_plan is short
  assert (p.tag, short.tag) == ('-12000st', '')
  calls = run_all_stages(p, short, monkeypatch)
  lr_names = [q.name for q in conv.lr_points(short)]
  assert calls[0] == lr_names  # finished: the grid skips them
  assert calls[1] == [
      f'{arm.key}-lr0.01-12000st-s{seed}' for arm in conv.LR_ARMS for seed in conv.SEEDS
  ]
  assert calls[2] == [q.name for q in conv.lr_points(short, [conv.WIDTH_ARM, conv.WIDTH_BASELINE])]
  # Width at 12,000 steps; the cheaper baseline trains twice as long at equal compute.
  assert set(calls[3]) == {f'fixed128-h8-D128-lr0.01-12000st-s{s}' for s in conv.SEEDS} | {
      f'concat-h8-D256-lr0.01-{n}st-s{s}' for n in (12000, 24000) for s in conv.SEEDS
  }


def test_dropout_trains_its_own_runs_at_the_rates_of_the_sweep_without(tmp_path, monkeypatch):
  """--dropout=0.1 --steps=24000 --rate_steps=3000: stages seeds and width train runs of their
  own (names ending -drop0.1) with dropout on the model and on the attention probabilities; the
  rates come from the 3,000-step sweep without dropout, which is not trained again."""
  p = conv.Plan(steps=24000, rate_steps=3000, dropout=0.1, runs_dir=tmp_path, out_dir=tmp_path)
  assert p.tag == '-24000st-drop0.1'
  assert p.rate_plan == conv.Plan(steps=3000, runs_dir=tmp_path, out_dir=tmp_path)
  # Without --rate_steps the sweep is this budget's, still without dropout.
  same = conv.Plan(steps=3000, dropout=0.1, runs_dir=tmp_path, out_dir=tmp_path).rate_plan
  assert same == conv.Plan(steps=3000, runs_dir=tmp_path, out_dir=tmp_path)
  # The config's own dropout is none: the runs without --dropout are the runs without dropout.
  config = conv.arm_config(conv.WIDTH_BASELINE)
  assert config.model.dropout_rate == 0.0 and config.model.attention.dropout_rate == 0.0
  point = conv.Point(conv.WIDTH_BASELINE, 3e-3, 1, 24000, 0.1)
  assert point.name == 'concat-h8-D256-lr0.003-24000st-s1-drop0.1'
  run = conv.make_run(point, p)
  assert float(flag(run, 'model.dropout_rate')) == 0.1
  assert float(flag(run, 'model.attention.dropout_rate')) == 0.1
  plain = conv.make_run(conv.Point(conv.WIDTH_BASELINE, 3e-3, 1, 24000), p)
  assert plain.name == 'concat-h8-D256-lr0.003-24000st-s1'
  assert not [a for a in plain.command if 'dropout_rate=' in a]
  # The stages: the sweep's names without dropout, the others with it.
  short = p.rate_plan
  calls = run_all_stages(p, short, monkeypatch)
  assert calls[0] == [q.name for q in conv.lr_points(short)]
  assert calls[1] == [
      f'{arm.key}-lr0.01-24000st-s{seed}-drop0.1' for arm in conv.LR_ARMS for seed in conv.SEEDS
  ]
  assert calls[2] == [q.name for q in conv.lr_points(short, [conv.WIDTH_ARM, conv.WIDTH_BASELINE])]
  assert set(calls[3]) == {f'fixed128-h8-D128-lr0.01-24000st-s{s}-drop0.1' for s in conv.SEEDS} | {
      f'concat-h8-D256-lr0.01-{n}st-s{s}-drop0.1' for n in (24000, 48000) for s in conv.SEEDS
  }
  with pytest.raises(ValueError, match='dropout=1.0'):
    conv.Plan(dropout=1.0)


def test_the_dropout_report_gives_each_run_against_the_same_run_without(tmp_path):
  """A plan with dropout reports its own runs (the width difference between runs with dropout
  only) and, per arm and budget, dropout minus none over the seeds both have finished."""
  p, runs = longer_budget(tmp_path)
  d = dataclasses.replace(p, dropout=0.1)
  fixed, concat = conv.WIDTH_ARM, conv.WIDTH_BASELINE
  for seed, (f0, c0, f1, c1) in enumerate([(2.05, 1.98, 2.00, 1.95), (2.04, 1.99, 2.01, 1.93)]):
    runs += [
        fake_run(conv.Point(fixed, 3e-3, seed, 24000), f0),
        fake_run(conv.Point(concat, 3e-3, seed, 24000), c0),
        fake_run(conv.Point(fixed, 3e-3, seed, 24000, 0.1), f1, train=1.9),
    ]
    if seed == 0:  # concat with dropout: seed 0 only
      runs.append(fake_run(conv.Point(concat, 3e-3, seed, 24000, 0.1), c1))
  text = report(runs, d)
  assert 'Dropout 0.1 on the embeddings' in text and 'the best of the 3000-step sweep' in text
  assert 'measured with dropout on' in text
  # The width difference compares runs with dropout: fixed (2.00, 2.01) against concat (1.95).
  assert (
      '- equal steps, fixed_head D = 128 minus concat D = 256: +0.0500 bits/char on the common seed 0'
      in text
  )
  effect = text.split('Dropout 0.1 minus none')[1]
  # fixed: (2.00 - 2.05, 2.01 - 2.04) = (-0.05, -0.03), mean -0.04; concat: seed 0 only, -0.03.
  assert f'- {fixed.label}, 24000 steps: -0.0400 bits/char' in effect
  assert 'seed 0: -0.0500; seed 1: -0.0300' in effect
  assert f'- {concat.label}, 24000 steps: -0.0300 bits/char' in effect
  assert 'seed noise unmeasured' in effect  # one seed of concat with dropout
  assert (tmp_path / 'convergence' / 'convergence_width-24000st-drop0.1.png').exists()
  # The report without dropout shows none of it.
  assert 'minus none' not in report(runs, p) and 'Dropout 0.1' not in report(runs, p)


def _summary(arm, values):
  return {
      'arm': arm,
      'lr': 3e-3,
      'steps': 12000,
      'seeds': list(range(len(values))),
      'values': values,
      'bits_per_char': sum(values) / len(values),
      'range': max(values) - min(values),
  }


def test_a_difference_between_single_seed_arms_claims_no_verdict():
  """One seed per arm has a seed range of zero, which any difference exceeds: the line must
  say the noise is unmeasured instead of calling the difference larger than it."""
  one = conv.difference(_summary('a', [2.00]), _summary('b', [2.03]), 'h = 8')
  assert 'seed noise unmeasured' in one and 'larger than' not in one
  two = conv.difference(_summary('a', [2.00, 2.002]), _summary('b', [2.03, 2.031]), 'h = 8')
  assert 'larger than both seed ranges' in two
  near = conv.difference(_summary('a', [2.00, 2.04]), _summary('b', [2.01, 2.02]), 'h = 8')
  assert 'within a seed range' in near


def test_a_difference_with_a_seed_missing_on_one_side_compares_the_common_seeds():
  """Half a grid: arm a has seeds 0 and 1, arm b seed 0 only. The headline must be seed 0's
  paired difference, not a's two-seed mean minus b's one-seed value."""
  a = _summary('a', [2.05, 2.03])
  line = conv.difference(a, _summary('b', [1.98]), 'equal steps')
  assert line.startswith('- equal steps: +0.0700 bits/char on the common seed 0 (')
  assert 'seed 0: +0.0700' in line and 'seed noise unmeasured' in line
  both = conv.difference(a, _summary('b', [1.98, 2.00]), 'equal steps')
  assert both.startswith('- equal steps: +0.0500 bits/char (') and 'common seed' not in both


def test_seed1_periodic_reads_the_last_periodic_evaluation(tmp_path):
  """Seed 1's bits/char is its step-12,000 eval loss over ln 2 (not an earlier step's, not the
  train split's); seed 0's comes from results.json; the differences are fixed minus concat."""
  from experiments.bottleneck import seed1_periodic  # pylint: disable=g-import-not-at-top

  runs, out = tmp_path / 'runs', tmp_path / 'out'
  out.mkdir()
  losses = {'fixed128-h8': 1.0, 'concat-h8': 1.1, 'fixed128-h32': 1.3, 'concat-h32': 1.2}
  recorded = []
  for i, (arm, loss) in enumerate(losses.items()):
    name = f'{arm}-D256-lr0.003-12000st'
    (runs / f'{name}-s1').mkdir(parents=True)
    lines = [
        {'step': 11000, 'split': 'eval', 'loss': 5.0},
        {'step': 12000, 'split': 'eval', 'loss': loss},
        {'step': 12000, 'split': 'train', 'loss': 7.0},
    ]
    (runs / f'{name}-s1' / 'metrics.jsonl').write_text(''.join(json.dumps(m) + '\n' for m in lines))
    result = {'bits_per_char_periodic': 2.0 + i / 100, 'bits_per_char': 2.1}
    recorded.append({'name': f'{name}-s0', 'result': result})
  (out / 'results.json').write_text(json.dumps({'runs': recorded}))
  got = seed1_periodic.main(str(runs), out)
  arm = got['arms']['fixed128-h8-D256-lr0.003-12000st']
  assert arm['seed1'] == pytest.approx(1.0 / math.log(2), abs=1e-4)
  assert arm['seed0'] == 2.0
  assert got['fixed_minus_concat_h8']['seed1'] == pytest.approx(-0.1 / math.log(2), abs=2e-4)
  assert got['fixed_minus_concat_h32']['seed0'] == pytest.approx(0.02 - 0.03, abs=1e-9)
  assert json.loads((out / 'seed1_periodic-12000st.json').read_text()) == got


def test_minutes_per_run_are_given_per_seed_where_the_seeds_ran_on_different_machines(tmp_path):
  """A mean of a CPU run's minutes and a GPU run's describes neither: where a row's seeds ran on
  different machines the column gives each seed's minutes and machine (a GPU run by its GPU,
  not its host CPU); on one machine, the mean as before."""
  p, runs = longer_budget(tmp_path)
  cpu = {'cpu': 'AMD EPYC'}
  gpu = {'cpu': 'Intel(R) Xeon(R) Processor', 'gpus': ['NVIDIA H200']}
  for seed, (wall, machine) in enumerate([(2670.0, cpu), (510.0, gpu)]):
    point = conv.Point(conv.WIDTH_ARM, 3e-3, seed, 24000)
    runs.append({**fake_run(point, 2.0 + seed / 10), 'wall_time_s': wall, 'machine': machine})
  text = report(runs, p)
  # (2670 + 30) / 60 = 45.0 and (510 + 30) / 60 = 9.0 (each run's final evaluation included).
  assert '| 0.100 | 45.0 (AMD EPYC), 9.0 (NVIDIA H200) |' in text
  assert '27.0' not in text
  runs[-1]['machine'] = cpu
  text = report(runs, p)
  assert '| 0.100 | 27.0 |' in text


# ------------------------------------------- the paired interval over the validation text

BLOCK = 32  # rows of 128 characters: the README's 4,096-character blocks


def _with_rows(arm, nll_per_seed, tokens, digest='same'):
  """A summary whose seeds carry validation rows (`validation_rows`' record)."""
  values = [float(np.sum(n) / np.sum(tokens) / np.log(2)) for n in nll_per_seed]
  return {
      **_summary(arm, values),
      'rows': [(list(map(float, n)), list(map(int, tokens)), digest) for n in nll_per_seed],
  }


def _text(rows, seed):
  """Rows of 128 tokens whose nll (nats) differs from block to block of BLOCK rows."""
  rng = np.random.default_rng(seed)
  return np.repeat(rng.normal(1.4, 0.2, rows // BLOCK), BLOCK) * 128 + rng.normal(0, 2, rows)


def test_a_constant_gain_per_character_has_an_interval_of_that_gain_alone():
  """b scores every character 0.01 nats better than a: every resample of the text gives
  0.01 / ln 2 bits/char, so the interval is that point; identical runs give [0, 0]."""
  tokens = np.full(160, 128)
  a = _text(160, 0)
  line = conv.difference(_with_rows('a', [a], tokens), _with_rows('b', [a - 1.28], tokens), 'x')
  gain = 0.01 / np.log(2)
  assert f'- x: {gain:+.4f} [{gain:+.4f}, {gain:+.4f}] bits/char' in line
  assert 'the interval resamples the validation text' in line and 'no interval claimed' not in line
  same = conv.difference(_with_rows('a', [a], tokens), _with_rows('b', [a], tokens), 'x')
  assert '+0.0000 [+0.0000, +0.0000] bits/char' in same


def test_the_interval_resamples_blocks_of_rows_and_averages_the_seeds():
  """Differences shared within each block of BLOCK rows (neighbouring text), independent
  between blocks: the 95% interval is about the mean block difference +- 1.96 standard errors
  over blocks (the plain formula), sqrt(32) = 5.7x wider than resampling single rows would make
  it; two seeds per arm enter as their mean on each resample."""
  blocks = 400
  rows = blocks * BLOCK
  tokens = np.full(rows, 128)
  rng = np.random.default_rng(3)
  a0, a1 = _text(rows, 1), _text(rows, 2)
  shift = np.repeat(rng.normal(0.02, 0.3, blocks), BLOCK) * 128  # nats per row
  b0, b1 = a0 - shift, a1 - shift + 0.64  # seed 1 of b: 0.005 nats/char worse than seed 0
  a = _with_rows('a', [a0, a1], tokens)
  b = _with_rows('b', [b0, b1], tokens)
  interval = conv.text_interval(a, b, [0, 1])
  per_block = (shift.reshape(blocks, -1).sum(1) - 0.32 * BLOCK) / (128 * BLOCK)
  mean, se = per_block.mean() / np.log(2), per_block.std(ddof=1) / np.sqrt(blocks) / np.log(2)
  assert interval.estimate == pytest.approx(a['bits_per_char'] - b['bits_per_char'], abs=1e-9)
  assert interval.estimate == pytest.approx(mean, abs=1e-9)
  # The 2.5% quantile of 2,000 resamples errs by sqrt(.025 .975 / 2000) / phi(1.96) = 0.06 standard
  # errors (the 400 blocks' normal data leave the bootstrap distribution near normal): 4x that.
  assert interval.low == pytest.approx(mean - 1.96 * se, abs=0.25 * se)
  assert interval.high == pytest.approx(mean + 1.96 * se, abs=0.25 * se)


def test_runs_scored_on_other_rows_or_without_rows_give_no_paired_interval():
  tokens = np.full(32, 128)
  a = _with_rows('a', [_text(32, 0)], tokens)
  with pytest.raises(ValueError, match='different validation rows'):
    conv.text_interval(a, _with_rows('b', [_text(32, 1)], tokens, digest='other'), [0])
  assert conv.text_interval(a, _summary('b', [2.0]), [0]) is None  # collected before rows
  line = conv.difference(a, _summary('b', [2.0]), 'x')
  assert 'no interval claimed' in line and '[' not in line.split('bits/char')[0]


def test_seeds_whose_runs_both_recorded_rows_get_their_own_interval_where_the_rest_lack_rows():
  """Seed 0 of each arm trained before runs recorded their validation rows, seed 1 after: no
  interval for the two-seed mean, but seed 1's difference (b 0.01 nats better on every
  character, so every resample gives 0.01 / ln 2) gets its own, named as seed 1's alone."""
  tokens = np.full(160, 128)
  text = _text(160, 0)
  a = _with_rows('a', [text, text], tokens)
  b = _with_rows('b', [text, text - 1.28], tokens)
  a['rows'][0] = b['rows'][0] = None
  b['values'][0] = a['values'][0] - 0.05
  b['bits_per_char'] = sum(b['values']) / 2
  line = conv.difference(a, b, 'x')
  gain = 0.01 / np.log(2)
  assert line.startswith(f'- x: {(0.05 + gain) / 2:+.4f} bits/char (')
  assert (
      f'no interval claimed over all of them; seed 1 alone, where both runs recorded their '
      f'validation rows: {gain:+.4f} [{gain:+.4f}, {gain:+.4f}]'
  ) in line
  # Rows on seed 1 of one arm only: nothing to pair, no interval at all.
  b['rows'][1] = None
  assert 'alone' not in conv.difference(a, b, 'x')


def test_a_swept_arm_s_other_rates_get_the_interval_against_its_best_rate_s_rows(tmp_path):
  """The width arm swept at 24,000 steps, each run with its validation rows: each other rate's
  line carries the paired interval against the best rate's rows. Rows above the best's by a
  constant c nats each (128 characters) differ by c / (128 ln 2) bits/char in every resample,
  so the interval is that difference at both ends; paired with the wrong run, it is not."""
  p, runs = longer_budget(tmp_path)
  rows = 4 * BLOCK
  base = _text(rows, 0)
  for lr, shift in ((1e-3, 0.0), (3e-3, 0.02), (1e-2, 0.05)):
    runs.append(
        run_with_rows(conv.Point(conv.WIDTH_ARM, lr, 0, 24000), base + shift * 128 * math.log(2))
    )
  text = report(runs, p)
  label = conv.WIDTH_ARM.label
  assert f'- {label}, lr 0.003 minus 0.001: +0.0200 [+0.0200, +0.0200] bits/char' in text
  assert f'- {label}, lr 0.01 minus 0.001: +0.0500 [+0.0500, +0.0500] bits/char' in text
  assert 'the worse minus the better' not in text  # the best's lines have their intervals


def test_validation_rows_leave_out_padding_and_pair_runs_by_their_text():
  """`validation_rows` over two batches of a tiny LM, the second ending in rows of padding: one
  entry per real row, in order, adding up per batch to `eval_step`'s sums; the digest names the
  text: the same for another model, another once a target token changes."""
  import functools  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top

  from lowrank_attn import tasks as tasks_lib  # pylint: disable=g-import-not-at-top
  from lowrank_attn import train  # pylint: disable=g-import-not-at-top
  from lowrank_attn.train import config as config_lib  # pylint: disable=g-import-not-at-top

  config = config_lib.load(f'{REPO_ROOT / "configs" / "lm.py"}:tiny')
  for key, value in {'emb_dim': 16, 'mlp_dim': 16, 'num_decoder_layers': 1}.items():
    config.model[key] = value
  config.model.attention.num_heads = 2
  config.mesh.data = 1
  rng = np.random.default_rng(4)

  def batch(lengths):
    tokens = rng.integers(1, 64, (4, 17)).astype(np.int32)
    real = np.arange(16)[None, :] < np.asarray(lengths)[:, None]
    return {
        'inputs': tokens[:, :-1] * real,
        'targets': tokens[:, 1:] * real,
        'weights': real.astype(np.float32),
        'segment_ids': real.astype(np.int32),
        'positions': np.where(real, np.arange(16), 0).astype(np.int32),
    }

  class Pipeline(list):

    def reset(self):
      pass

  batches = Pipeline([batch([16, 16, 12, 5]), batch([16, 7, 0, 0])])

  models = {}

  def rows_of(seed, pipeline):
    if seed not in models:  # one setup (and compile) per model
      config.seed = seed
      s = train.setup(config, vocab_size=64, bos_id=1, devices=jax.devices()[:1])
      sums = jax.jit(functools.partial(train.eval_step, options=s.options))
      models[seed] = (s, train.create_state(s)['params'], sums)
    s, params, sums = models[seed]
    rows = conv.validation_rows(tasks_lib.EvalContext(s, sums, None), params, pipeline)
    return rows, [float(sums(params, b)['nll']) for b in pipeline]

  rows, batch_nll = rows_of(0, batches)
  assert rows['row_tokens'] == [16, 16, 12, 5, 16, 7]
  # Each row rounded to 3 decimals: 4 rows err by at most 0.002 nats of ~100.
  assert sum(rows['row_nll'][:4]) == pytest.approx(batch_nll[0], abs=2e-3 + 1e-5 * batch_nll[0])
  assert sum(rows['row_nll'][4:]) == pytest.approx(batch_nll[1], abs=1e-3 + 1e-5 * batch_nll[1])
  other, _ = rows_of(1, batches)
  assert other['rows_digest'] == rows['rows_digest'] and other['row_nll'] != rows['row_nll']
  changed = Pipeline([dict(b) for b in batches])
  changed[1]['targets'] = changed[1]['targets'].copy()
  changed[1]['targets'][1, 3] = changed[1]['targets'][1, 3] % 63 + 1
  assert rows_of(0, changed)[0]['rows_digest'] != rows['rows_digest']


def test_an_evaluation_cached_without_rows_is_run_again_only_where_the_final_checkpoint_is(
    tmp_path, monkeypatch
):
  """`final_evaluation` (what `collect` and the grid's --refresh call): a record from before the
  rows were recorded is kept while the run's final checkpoint is gone, scored again once it is
  there, and the new record (with rows) is cached."""
  calls = []

  def evaluate(command, **kwargs):
    del kwargs
    calls.append(command)
    runner.files.write_json(tmp_path / conv.WHOLE_FILE, {'batches': -1, 'row_nll': [1.5]})
    return subprocess.CompletedProcess(command, 0, '', '')

  monkeypatch.setattr(conv.subprocess, 'run', evaluate)
  runner.files.write_json(tmp_path / 'config.json', {'num_train_steps': 50})
  runner.files.write_json(tmp_path / conv.WHOLE_FILE, {'batches': -1, 'loss': 1.0})
  assert conv.final_evaluation(tmp_path) == {'batches': -1, 'loss': 1.0}
  (tmp_path / 'checkpoints' / '40').mkdir(parents=True)  # an earlier step's only
  assert conv.final_evaluation(tmp_path) == {'batches': -1, 'loss': 1.0} and not calls
  (tmp_path / 'checkpoints' / '50').mkdir()
  assert conv.final_evaluation(tmp_path)['row_nll'] == [1.5] and len(calls) == 1
  assert conv.final_evaluation(tmp_path)['row_nll'] == [1.5] and len(calls) == 1


def test_the_train_column_says_how_many_runs_logged_a_sample_and_its_standard_error(
    tmp_path, monkeypatch
):
  """Runs whose last attempt's commit lacks LOGGING_FIX (git's ancestry, here in a scratch
  repository) are counted in the header; the coverage and standard error come from
  train_records.json's intervals past each run's first quarter (plain arithmetic below)."""
  repo = tmp_path / 'repo'
  repo.mkdir()
  git = lambda *a: subprocess.run(
      ['git', '-C', str(repo), *a], check=True, capture_output=True, text=True
  ).stdout.strip()
  git('init', '-q')
  commits = []
  for message in ('old', 'fix', 'new'):
    git('-c', 'user.name=t', '-c', 'user.email=t@t', 'commit', '-q', '--allow-empty', '-m', message)
    commits.append(git('rev-parse', 'HEAD'))
  old, fix, new = commits
  monkeypatch.setattr(conv, 'HERE', repo)
  monkeypatch.setattr(conv, 'LOGGING_FIX', fix)
  assert [conv._before_logging_fix(c) for c in (old, fix, new, '0' * 40)] == [
      True,
      False,
      False,
      None,
  ]
  p, runs = longer_budget(tmp_path)
  trained = []
  for seed, commit in enumerate((old, new)):
    trained.append(fake_run(conv.Point(conv.WIDTH_ARM, 3e-3, seed, 24000), 2.0, train=1.9))
    trained[-1]['code'] = [{'commit': old}, {'commit': commit}]  # the last attempt counts
  text = report(runs + trained, p)
  assert f'1 of the 2 runs with that column trained before {fix},' in text
  assert 'train_records.json' not in text  # none read yet
  intervals = [  # (end, steps covered, standard error): the first quarter's is left out
      (2000, 10, 0.5),
      (8000, 30, 0.010),
      (10000, 60, 0.030),
      (12000, 45, 0.020),
  ]
  record = {
      'num_train_steps': 24000,
      'intervals': [
          {'end': e, 'steps_covered': c, 'steps': 2000, 'standard_error': se}
          for e, c, se in intervals
      ],
  }
  (p.out_dir / conv.TRAIN_RECORDS).write_text(json.dumps({'a': record}))
  text = report(runs + trained, p)
  half_width = 1.96 * math.sqrt(2) * 0.020  # the median of 0.010, 0.030, 0.020
  assert (
      'Read from 1 runs while they trained on this CPU (`convergence/train_records.json`, 3 '
      "intervals past their first quarter), such records covered 1.5%-3.0% of an interval's "
      'steps, and their spread puts the standard error of its mean at 0.010-0.030 bits/char '
      f'(median 0.020), so the difference of two such runs has a 95% half-width of about '
      f'{half_width:.3f} at the median.'
  ) in text
  # No run before the fix: no note; commits git cannot place still get it, counted as such.
  trained[0]['code'][-1]['commit'] = new
  assert 'trained before' not in report(runs + trained, p)
  trained[0]['code'][-1]['commit'] = '0' * 40
  assert '0 of the 2 runs with that column (1 unknown to git here) trained before' in report(
      runs + trained, p
  )


def test_each_rate_has_one_colour_in_every_panel_of_the_rate_plot(tmp_path, monkeypatch):
  """An arm that has not run every rate yet (a sweep running across sessions) keeps the colours
  of the others: a lone 0.003 curve is drawn in 0.003's colour, not in the first rate's."""
  import matplotlib.colors
  import matplotlib.figure

  drawn = []
  monkeypatch.setattr(matplotlib.figure.Figure, 'savefig', lambda fig, *a, **k: drawn.append(fig))
  full, partial = conv.LR_ARMS[0], conv.LR_ARMS[1]
  curve = [[2000, 2.5], [4000, 2.3]]
  rows = [{'key': full.key, 'lr': lr, 'curve': curve} for lr in conv.RATES]
  rows.append({'key': partial.key, 'lr': 3e-3, 'curve': curve})
  conv.plot_rates(rows, [full, partial], tmp_path / 'rates.png', 'bits/char')
  (fig,) = drawn
  colours = {}
  for ax in fig.axes:
    for line in ax.get_lines():
      colours.setdefault(line.get_label(), set()).add(matplotlib.colors.to_hex(line.get_color()))
  assert set(colours) == {f'lr {lr:g}' for lr in conv.RATES}
  assert all(len(c) == 1 for c in colours.values()), colours
  assert len(set().union(*colours.values())) == len(conv.RATES)


def test_where_the_best_rate_has_no_rows_the_other_two_rates_get_their_interval(tmp_path):
  """The best rate's run collected before runs recorded their validation rows (its line claims
  no interval): the other two rates, both with rows, are compared with each other, the worse
  minus the better, with the interval over the text. Rows above by a constant c nats each (128
  characters) differ by c / (128 ln 2) bits/char in every resample."""
  p, runs = longer_budget(tmp_path)
  rows = 4 * BLOCK
  base = _text(rows, 0)
  arm = conv.WIDTH_ARM
  runs.append(fake_run(conv.Point(arm, 3e-3, 0, 24000), 1.5))  # best, no rows
  for lr, shift in ((1e-3, 0.0), (1e-2, 0.03)):
    runs.append(run_with_rows(conv.Point(arm, lr, 0, 24000), base + shift * 128 * math.log(2)))
  unrecorded = conv.LR_ARMS[0]  # every rate without rows: nothing to add
  for lr, bits in ((1e-3, 1.6), (3e-3, 1.5), (1e-2, 1.7)):
    runs.append(fake_run(conv.Point(unrecorded, lr, 0, 24000), bits))
  text = report(runs, p)
  assert f'- {unrecorded.label}, lr 0.01 minus 0.001:' not in text
  (against_best,) = [
      x for x in text.splitlines() if x.startswith(f'- {arm.label}, lr 0.01 minus 0.003:')
  ]
  assert 'no interval claimed' in against_best
  assert 'the other two rates, the worse minus the better:' in text
  assert f'- {arm.label}, lr 0.01 minus 0.001: +0.0300 [+0.0300, +0.0300] bits/char' in text
  assert text.count(f'- {arm.label}, lr 0.01 minus 0.001:') == 1


def test_a_longer_budget_gives_each_arm_at_its_own_best_rate_with_its_seeds(tmp_path):
  """Once an arm's sweep at the longer budget is complete, the section gives it at the best
  rate of that budget with every seed that has run there (the issue's seeds at the best rate),
  even where that is not the 3,000-step pick; fixed_head minus concat pairs the arms each at
  its own best rate, on the seeds both have, and the width arm against concat D = 256 too."""
  p, runs = longer_budget(tmp_path)  # every arm picked 3e-3 at 3,000 steps
  p = dataclasses.replace(p, seeds=(0, 1, 2))
  at = lambda arm, lr, seed, bits: fake_run(conv.Point(arm, lr, seed, 24000), bits)
  fixed32, concat32 = conv.Arm(32, head_dim=conv.LENGTH), conv.Arm(32)
  # The 24,000-step sweeps: fixed_head h = 32 best at 1e-3 (not its pick), concat h = 32 at
  # its pick 3e-3; stage seeds' seeds 1 and 2 of concat h = 32 at the pick.
  runs += [at(fixed32, 1e-3, 0, 1.98), at(fixed32, 3e-3, 0, 2.03), at(fixed32, 1e-2, 0, 2.1)]
  runs += [at(concat32, 1e-3, 0, 2.04), at(concat32, 3e-3, 0, 2.00), at(concat32, 1e-2, 0, 2.2)]
  runs += [at(concat32, 3e-3, 1, 2.01), at(concat32, 3e-3, 2, 2.03)]
  text = report(runs, p)
  block = text.split('**Each arm at its best rate at 24000 steps**')[1]
  assert '| fixed_head | 32 | 128 | 256 | 0.001 | 24000 | 1 | 1.9800 |' in block
  assert '| concat | 32 | 8 | 256 | 0.003 | 24000 | 3 | 2.0133 (seeds: 2.0000' in block
  assert '- Not finished yet at these rates: fixed128-h32-D256-lr0.001-24000st-s1.' in text
  assert 'concat, h = 8, d = 32, D = 256: no rate picked, no result yet for' in block
  # One fixed_head seed: the headline is the common seed 0's difference, 1.98 - 2.00.
  assert (
      '- h = 32, fixed_head at lr 0.001 minus concat at lr 0.003: -0.0200 bits/char on the common seed 0 ('
      in text
  ), text
  runs.append(at(fixed32, 1e-3, 1, 2.00))
  text = report(runs, p)
  assert '| fixed_head | 32 | 128 | 256 | 0.001 | 24000 | 2 | 1.9900 (seeds: 1.9800, 2.0000' in text
  assert 'Not finished yet at these rates' not in text  # seed 2 is not awaited
  # Seeds 0 and 1 in common: (1.98 - 2.00 + 2.00 - 2.01) / 2.
  assert (
      '- h = 32, fixed_head at lr 0.001 minus concat at lr 0.003: -0.0150 bits/char on the common seeds 0, 1 ('
      in text
  )
  assert text.startswith('30 runs, ')  # the 21 of the 3,000-step sweep and these 9
  # The width arm at its own best rate against concat D = 256 at equal steps.
  width, concat8 = conv.WIDTH_ARM, conv.Arm(8)
  runs += [at(width, lr, 0, b) for lr, b in zip(conv.RATES, (2.05, 2.06, 2.08))]
  runs += [at(concat8, lr, 0, b) for lr, b in zip(conv.RATES, (2.01, 1.98, 2.02))]
  text = report(runs, p)
  assert (
      '- equal steps, fixed_head D = 128 at lr 0.001 minus concat D = 256 at lr 0.003: +0.0700'
      in text
  ), text
