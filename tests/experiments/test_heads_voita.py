"""experiments/heads/run.py --protocol=voita, without training: the run list and its overrides
(whole model trainable, gates at their own rate, one budget and schedule for every fine-tune),
the stages (each after the one it reads), the head counts K of the controls taken from the
finished L0 runs, the comparisons the report states, and the check of kept translations."""

import json
import pathlib

import pytest

from experiments import runner
from experiments.collaborative import from_scratch
from experiments.heads import run

BASE = run.Base(
    path=pathlib.Path('/runs/base'),
    config_file='/runs/heads/base_config.py',
    data={'data.tokenizer_path': '/runs/base/tok.model', 'data.tfds_data_dir': '/runs/base/tfds'},
    lr_schedule='cosine',
    end_learning_rate_factor=0.0,
)
RUNS_DIR = pathlib.Path('/runs/heads')
# What the full grid shares: the baseline's schedule, restarted.
FINETUNE = {
    'learning_rate': run.FINETUNE_LR,
    'lr_schedule': 'cosine',
    'end_learning_rate_factor': 0.0,
    'warmup_steps': 100,
    'num_train_steps': 600,
    'eval_every_steps': 100,
    'checkpoint_every_steps': 200,
    'decode.num_examples': 0,
}


def overrides_of(r: runner.Run) -> dict:
  """The `--config.<field>=<value>` overrides of a training run, as strings."""
  return dict(
      arg[len('--config.') :].split('=', 1) for arg in r.command if arg.startswith('--config.')
  )


def as_strings(d: dict) -> dict:
  return {k: str(v) for k, v in d.items()}


def flag(r: runner.Run, name: str) -> str:
  return r.command[r.command.index(name) + 1]


def test_the_budget_is_the_baselines_last_third_at_its_rate_there():
  from lowrank_attn.train import config as config_lib
  from lowrank_attn.train import optim

  base = config_lib.load(str(runner.REPO_ROOT / 'configs/nmt.py') + ':multi30k')
  assert run.FINETUNE_STEPS * 3 == base.num_train_steps
  schedule = optim.learning_rate_schedule(
      learning_rate=base.learning_rate,
      warmup_steps=base.warmup_steps,
      num_train_steps=base.num_train_steps,
      decay=base.lr_schedule,
      end_factor=base.end_learning_rate_factor,
  )
  at_start_of_tail = float(schedule(base.num_train_steps - run.FINETUNE_STEPS))
  assert run.FINETUNE_LR == pytest.approx(at_start_of_tail, rel=0.02)


def test_first_stage_trains_the_whole_model_with_gates_and_one_schedule():
  s = run.Settings(smoke=False)
  runs = run.voita_first(BASE, s)
  names = [r.name for r in runs]
  assert names == ['analyse', 'voita-finetune-nogates'] + [
      f'voita-{t}-{lam:g}' for t in ('enc', 'all') for lam in (0.01, 0.03, 0.1, 0.3)
  ]
  start = {'init_from': '/runs/base', **BASE.data}
  by_name = {r.name: r for r in runs}
  assert overrides_of(by_name['voita-finetune-nogates']) == as_strings(
      {'seed': 0, **start, **FINETUNE}
  )
  for types in ('enc', 'all'):
    for lam in (0.01, 0.03, 0.1, 0.3):
      r = by_name[f'voita-{types}-{lam:g}']
      overrides = overrides_of(r)
      assert 'trainable' not in overrides  # everything trains, not the gates alone
      assert overrides == as_strings(
          {
              'seed': 0,
              **start,
              **run.GATED[types],
              'l0_penalty_weight': lam,
              'gate_learning_rate': 0.05,
              **FINETUNE,
          }
      )
      assert (r.config['method'], r.config['types'], r.config['lambda']) == ('l0', types, lam)
  assert flag(by_name['analyse'], '--run') == '/runs/base'


def eval_result(keep: dict) -> dict:
  """What `steps evaluate --prune gates` records of the heads: keep, and the pruned sizes."""
  counts = {t: sum(map(sum, k)) for t, k in keep.items()}
  return {
      'keep': keep,
      'heads': {t: [sum(layer) for layer in k] for t, k in keep.items()},
      'encoder_heads': counts['encoder'],
      'total_heads': sum(counts.values()),
      'bleu': 30.0,
      'unpruned': {'bleu': 30.0},
  }


def keep_with(encoder_kept: int, others_kept: int) -> dict:
  """A keep mask of 3 layers x 8 heads per type: the first N heads (row-major) kept."""
  mask = lambda n: [[int(8 * layer + h < n) for h in range(8)] for layer in range(3)]
  return {'encoder': mask(encoder_kept), 'decoder': mask(24), 'cross': mask(others_kept)}


# Hand-made finished eval runs: enc λ 0.01 keeps every head, 0.03 and 0.1 keep 16 and 9
# encoder heads, 0.3 keeps 9 too; all λ 0.1 keeps 20 encoder + 24 + 10 cross heads = 54.
EVALS = {
    ('enc', 0.01): keep_with(24, 24),
    ('enc', 0.03): keep_with(16, 24),
    ('enc', 0.1): keep_with(9, 24),
    ('enc', 0.3): keep_with(9, 24),
    ('all', 0.1): keep_with(20, 10),
}


def finished_results(extra=()) -> dict:
  runs = [
      {'name': f'voita-{t}-{lam:g}-eval', 'result': eval_result(keep)}
      for (t, lam), keep in EVALS.items()
  ]
  return {'runs': runs + list(extra)}


def test_control_counts_are_each_lambdas_survivors_once():
  s = run.Settings(smoke=False)
  counts = run.surviving(finished_results(), s)
  assert counts == {
      ('enc', 0.01): {'k': 24, 'of': 24},
      ('enc', 0.03): {'k': 16, 'of': 24},
      ('enc', 0.1): {'k': 9, 'of': 24},
      ('enc', 0.3): {'k': 9, 'of': 24},
      ('all', 0.1): {'k': 54, 'of': 72},
  }
  assert run.control_counts(counts) == {'enc': [16, 9], 'all': [54]}


def test_controls_prune_to_those_counts_and_fine_tune_like_the_l0_runs():
  s = run.Settings(smoke=False)
  prunes, finetunes = run.control_runs(BASE, RUNS_DIR, s, {'enc': [16, 9], 'all': [54]})
  expected = [
      (method, types, k, seed)
      for types, ks in (('enc', (16, 9)), ('all', (54,)))
      for k in ks
      for method, seeds in (('random', (0, 1, 2)), ('importance', (None,)))
      for seed in seeds
  ]
  assert [p.name for p in prunes] == [run.prune_name(*e) for e in expected]
  assert [f.name for f in finetunes] == [run.finetune_name(*e) for e in expected]
  assert 'random-enc-k16-s2-ft' in [f.name for f in finetunes]
  assert 'importance-all-k54-ft' in [f.name for f in finetunes]
  l0 = overrides_of(run.voita_first(BASE, s)[2])
  budget = {k: v for k, v in l0.items() if k in FINETUNE}
  assert budget == as_strings(FINETUNE)
  for (method, types, k, seed), prune, finetune in zip(expected, prunes, finetunes):
    assert flag(prune, '--prune') == method and flag(prune, '--keep') == str(k)
    assert flag(prune, '--types') == {'enc': 'encoder', 'all': 'all'}[types]
    assert flag(prune, '--run') == '/runs/base' and '--prune_only' in prune.command
    if method == 'random':
      assert flag(prune, '--seed') == str(seed)
    else:
      assert flag(prune, '--importance') == '/runs/heads/analyse'
    pruned = f'/runs/heads/{prune.name}/pruned'
    assert f'--config=experiments/heads/glue_pruning.py:{pruned}' in finetune.command
    overrides = overrides_of(finetune)
    # the same budget and schedule as the L0 runs, from the pruned copy, nothing frozen
    assert overrides == as_strings({'seed': 0, 'init_from': pruned, **BASE.data, **budget})
    assert finetune.config['pruned_by'] == prune.name
    assert (finetune.config['k'], finetune.config['random_seed']) == (k, seed)


def test_l0_heads_control_prunes_the_baseline_to_each_l0_runs_own_heads():
  """One control per L0 run that closed some of its types' heads but not all: the baseline
  pruned with that run's eval mask, then the same fine-tune as the other controls."""
  s = run.Settings(smoke=False)
  counts = run.surviving(finished_results(), s)
  counts['enc', 0.3] = {'k': 0, 'of': 24}  # every encoder head closed: K = 0's control
  prunes, finetunes = run.l0_heads_runs(BASE, RUNS_DIR, s, counts)
  assert [p.name for p in prunes] == [
      'prune-l0heads-enc-0.03',
      'prune-l0heads-enc-0.1',
      'prune-l0heads-all-0.1',
  ]
  assert [f.name for f in finetunes] == [p.name.removeprefix('prune-') + '-ft' for p in prunes]
  _, others = run.control_runs(BASE, RUNS_DIR, s, {'enc': [16]})
  for prune, finetune in zip(prunes, finetunes):
    lam = finetune.config['lambda']
    types = finetune.config['types']
    assert flag(prune, '--prune') == 'mask' and '--prune_only' in prune.command
    assert flag(prune, '--mask_from') == f'/runs/heads/voita-{types}-{lam:g}-eval'
    assert flag(prune, '--run') == '/runs/base'
    pruned = f'/runs/heads/{prune.name}/pruned'
    assert overrides_of(finetune) == {**overrides_of(others[0]), 'init_from': pruned}
    assert finetune.config['k'] == counts[types, lam]['k']
    assert (finetune.config['method'], finetune.config['pruned_by']) == ('l0heads', prune.name)


def test_mask_pruning_keeps_exactly_the_heads_an_eval_run_kept(tmp_path):
  from experiments.heads import steps  # pylint: disable=g-import-not-at-top

  keep = keep_with(16, 10)
  (tmp_path / steps.RESULT_FILE).write_text(json.dumps({'keep': keep}))
  args = type('Args', (), {'prune': 'mask', 'mask_from': str(tmp_path)})()
  got = steps.keep_mask(args, model=None)
  assert set(got) == set(keep)
  for t, mask in keep.items():
    assert got[t].dtype == bool and got[t].tolist() == [[bool(h) for h in layer] for layer in mask]


def test_each_stage_starts_after_the_one_it_reads(monkeypatch):
  """A fake run_grid finishes whatever it is given: four calls, each adding one stage."""
  s = run.Settings(smoke=False)
  s.voita_lambdas = {'enc': (0.03, 0.1)}
  calls = []

  def fake_grid(runs, out, **kwargs):
    del out, kwargs
    calls.append([r.name for r in runs])
    entries = []
    for r in runs:
      key = (r.config.get('types'), r.config.get('lambda'))
      result = eval_result(EVALS[key]) if r.config.get('method') == 'l0-eval' else {}
      entries.append({'name': r.name, 'result': result})
    return {'runs': entries, 'failed': []}

  monkeypatch.setattr(run.runner, 'run_grid', fake_grid)
  args = runner.arg_parser(None, 'heads').parse_args([])  # the grid flags' defaults
  run.voita_grid(BASE, RUNS_DIR, pathlib.Path('/out'), s, args)
  first = ['analyse', 'voita-finetune-nogates', 'voita-enc-0.03', 'voita-enc-0.1']
  evals = ['voita-enc-0.03-eval', 'voita-enc-0.1-eval']
  ks = [(16,), (9,)]
  prunes = [
      n
      for (k,) in ks
      for n in [f'prune-random-enc-k{k}-s{i}' for i in (0, 1, 2)] + [f'prune-importance-enc-k{k}']
  ]
  prunes += ['prune-l0heads-enc-0.03', 'prune-l0heads-enc-0.1']
  finetunes = [n.removeprefix('prune-') + '-ft' for n in prunes]
  assert calls == [first, first + evals, first + evals + prunes, first + evals + prunes + finetunes]


def test_no_stage_starts_before_the_last_one_finished(monkeypatch):
  s = run.Settings(smoke=False)
  calls = []

  def fake_grid(runs, out, **kwargs):
    del out, kwargs
    calls.append(len(runs))
    return {'runs': [{'name': r.name} for r in runs if r.name != 'voita-all-0.3'], 'failed': []}

  monkeypatch.setattr(run.runner, 'run_grid', fake_grid)
  args = runner.arg_parser(None, 'heads').parse_args([])  # the grid flags' defaults
  run.voita_grid(BASE, RUNS_DIR, pathlib.Path('/out'), s, args)
  assert calls == [10]


def row(name, method, types=None, lam=None, k=None, seed=None, val=30.0, test=29.0):
  return {
      'name': name,
      'method': method,
      'types': types,
      'lambda': lam,
      'k': k,
      'random_seed': seed,
      'bleu_validation': val,
      'bleu_test': test,
  }


ROWS = [
    row('base', 'baseline'),
    row('voita-finetune-nogates', 'nogates'),
    row('voita-enc-0.01', 'l0', 'enc', 0.01, 24),
    row('voita-enc-0.1', 'l0', 'enc', 0.1, 9),
    row('voita-all-0.1', 'l0', 'all', 0.1, 54),
    *[row(f'random-enc-k9-s{i}-ft', 'random', 'enc', k=9, seed=i) for i in (0, 1, 2)],
    row('importance-enc-k9-ft', 'importance', 'enc', k=9),
    *[row(f'random-all-k54-s{i}-ft', 'random', 'all', k=54, seed=i) for i in (0, 1, 2)],
    row('importance-all-k54-ft', 'importance', 'all', k=54),
    row('random-enc-k16-s0-ft', 'random', 'enc', k=16, seed=0),  # another lambda's K
    row('l0heads-all-0.1-ft', 'l0heads', 'all', 0.1, 54),
    row('l0heads-enc-0.3-ft', 'l0heads', 'enc', 0.3, 9),  # another lambda at the same K
]


def test_comparisons_are_against_the_no_gates_fine_tune_and_at_matched_counts():
  pairs = run.comparison_pairs(ROWS)
  stated = {
      (p['kind'], p['method'], p['types'], p['lambda'], p['k']): (p['a'], p['b']) for p in pairs
  }
  assert len(stated) == len(pairs)
  nogates = ['voita-finetune-nogates']
  random_enc = [f'random-enc-k9-s{i}-ft' for i in (0, 1, 2)]
  random_all = [f'random-all-k54-s{i}-ft' for i in (0, 1, 2)]
  assert stated == {
      ('minus_baseline', 'nogates', None, None, None): (['base'], nogates),
      ('minus_nogates', 'l0', 'enc', 0.01, 24): (nogates, ['voita-enc-0.01']),
      ('minus_nogates', 'l0', 'enc', 0.1, 9): (nogates, ['voita-enc-0.1']),
      ('minus_nogates', 'l0', 'all', 0.1, 54): (nogates, ['voita-all-0.1']),
      ('minus_nogates', 'random', 'enc', None, 9): (nogates, random_enc),
      ('minus_nogates', 'importance', 'enc', None, 9): (nogates, ['importance-enc-k9-ft']),
      ('minus_nogates', 'random', 'enc', None, 16): (nogates, ['random-enc-k16-s0-ft']),
      ('minus_nogates', 'random', 'all', None, 54): (nogates, random_all),
      ('minus_nogates', 'importance', 'all', None, 54): (nogates, ['importance-all-k54-ft']),
      ('minus_nogates', 'l0heads', 'all', 0.1, 54): (nogates, ['l0heads-all-0.1-ft']),
      ('minus_nogates', 'l0heads', 'enc', 0.3, 9): (nogates, ['l0heads-enc-0.3-ft']),
      # L0 against the controls at its own K (lambda 0.01 kept every head: no control)
      ('l0_minus_random', 'l0', 'enc', 0.1, 9): (random_enc, ['voita-enc-0.1']),
      ('l0_minus_importance', 'l0', 'enc', 0.1, 9): (['importance-enc-k9-ft'], ['voita-enc-0.1']),
      ('l0_minus_random', 'l0', 'all', 0.1, 54): (random_all, ['voita-all-0.1']),
      ('l0_minus_importance', 'l0', 'all', 0.1, 54): (
          ['importance-all-k54-ft'],
          ['voita-all-0.1'],
      ),
      # and against its own heads pruned first: only the same lambda's (not enc 0.3's at K 9)
      ('l0_minus_l0heads', 'l0', 'all', 0.1, 54): (['l0heads-all-0.1-ft'], ['voita-all-0.1']),
  }


def test_l0_rows_take_k_from_their_eval_run():
  extra = [
      {
          'name': 'voita-enc-0.1',
          'config': {'method': 'l0', 'types': 'enc', 'lambda': 0.1},
          'metrics': [
              {'split': 'test', 'step': 600, 'bleu': 33.0},
              {'split': 'validation', 'step': 600, 'bleu': 34.0},
          ],
      },
      {
          'name': 'voita-all-0.1',
          'config': {'method': 'l0', 'types': 'all', 'lambda': 0.1},
          'metrics': [
              {'split': 'test', 'step': 600, 'bleu': 32.0},
              {'split': 'validation', 'step': 600, 'bleu': 33.5},
          ],
      },
  ]
  rows = {r['name']: r for r in run.voita_rows(finished_results(extra))}
  assert set(rows) == {'voita-enc-0.1', 'voita-all-0.1'}  # eval runs are no rows
  assert (rows['voita-enc-0.1']['k'], rows['voita-all-0.1']['k']) == (9, 54)
  assert rows['voita-enc-0.1']['bleu_test'] == 33.0
  assert rows['voita-all-0.1']['bleu_validation'] == 33.5
  assert rows['voita-all-0.1']['heads']['cross'] == [8, 2, 0]


def test_kept_translations_must_score_what_was_recorded(tmp_path):
  references = ['ein Hund läuft im Park .', 'zwei Kinder spielen Fußball .']
  (tmp_path / 'x').mkdir()
  (tmp_path / 'x' / 'test.txt').write_text('ein Hund läuft im Park .\nzwei Kinder spielen .\n')
  from experiments import stats

  bleu = stats.corpus_bleu(references, ['ein Hund läuft im Park .', 'zwei Kinder spielen .'])
  good = {'name': 'x', 'bleu_test': bleu}
  assert len(from_scratch.checked_translations(good, 'test', references, tmp_path)) == 2
  with pytest.raises(ValueError, match='disagree'):
    from_scratch.checked_translations(
        {**good, 'bleu_test': bleu + 0.5}, 'test', references, tmp_path
    )


def test_at_k_0_one_control_stands_for_random_and_importance():
  """Pruning every encoder head leaves the same copy whatever the order: one prune and one
  fine-tune, not four identical ones; both of an L0 run's comparisons at K = 0 use it."""
  s = run.Settings(smoke=False)
  prunes, finetunes = run.control_runs(BASE, RUNS_DIR, s, {'enc': [7, 0]})
  assert [f.name for f in finetunes] == [
      'random-enc-k7-s0-ft',
      'random-enc-k7-s1-ft',
      'random-enc-k7-s2-ft',
      'importance-enc-k7-ft',
      'random-enc-k0-s0-ft',
  ]
  assert flag(prunes[-1], '--keep') == '0' and flag(prunes[-1], '--prune') == 'random'
  rows = [
      {
          'name': 'voita-finetune-nogates',
          'method': 'nogates',
          'types': None,
          'lambda': None,
          'k': None,
      },
      {'name': 'voita-enc-0.3', 'method': 'l0', 'types': 'enc', 'lambda': 0.3, 'k': 0},
      {'name': 'random-enc-k0-s0-ft', 'method': 'random', 'types': 'enc', 'lambda': None, 'k': 0},
  ]
  against = {p['kind']: p['a'] for p in run.comparison_pairs(rows) if p['b'] == ['voita-enc-0.3']}
  assert against == {
      'minus_nogates': ['voita-finetune-nogates'],
      'l0_minus_random': ['random-enc-k0-s0-ft'],
      'l0_minus_importance': ['random-enc-k0-s0-ft'],
  }


@pytest.mark.parametrize('has_run', [True, False])
def test_plot_only_reads_the_baseline_row_from_base_when_it_is_there(
    tmp_path, monkeypatch, has_run
):
  """--plot_only trains nothing, but the report's baseline row needs the baseline's final
  evaluation: from --base when that run exists, else (None) the record in baseline.json."""
  base = tmp_path / 'base'
  base.mkdir()
  if has_run:
    (base / 'config.json').write_text('{}')
  seen = {}
  monkeypatch.setattr(run.runner, 'load_results', lambda out: {'runs': [], 'failed': []})
  monkeypatch.setattr(
      run, 'voita_report', lambda results, b, out, s, images: seen.setdefault('base', b)
  )
  args = type('Args', (), {'plot_only': True, 'smoke': False, 'base': str(base)})()
  run.voita_main(args, run.Settings(smoke=False), tmp_path / 'runs')
  assert seen['base'] == (base.resolve() if has_run else None)


def test_the_encoder_heads_table_reads_the_kept_roles_once_the_run_directory_is_gone(tmp_path):
  """`--plot_only` on a machine without the `roles-base` run directory: the table of the
  committed importances and L0 path stays, with the roles from the copy in the experiment
  folder, or without a roles column (and a word why) where there is none."""
  importance = [[0.1, 0.4], [0.3, 0.2]]  # 2 layers x 2 heads: head 0.1 most important
  results = {
      'runs': [
          {
              'name': 'analyse',
              'result': {
                  'importance_normalized': {'encoder': importance},
                  'confidence': {'encoder': [[0.5, 0.6], [0.7, 0.8]]},
              },
          },
          {'name': 'l0-enc-0.1-eval', 'result': {'keep': {'encoder': [[0, 1], [1, 0]]}}},
      ]
  }
  runs_dir, out = tmp_path / 'runs', tmp_path / 'out'
  out.mkdir()
  without = run.roles_table(results, [0.1], out)
  assert 'roles' not in without.splitlines()[0] and 'roles.json' in without
  rows = [line.split('|')[1].strip() for line in without.splitlines()[2:6]]
  assert rows == ['0.1', '1.0', '1.1', '0.0']  # kept by L0 first, then by importance
  assert '| 0.1 | 0.400 | 0.600 | ✓ |' in without

  roles = [{'layer': layer, 'head': head, 'roles': []} for layer in (0, 1) for head in (0, 1)]
  roles[1]['roles'] = ['positional (prev)']
  (runs_dir / 'roles-base').mkdir(parents=True)
  (runs_dir / 'roles-base' / 'roles.json').write_text(json.dumps(roles))
  run.keep_roles(runs_dir, out)  # as the report does
  (runs_dir / 'roles-base' / 'roles.json').unlink()  # gone: the copy the report kept serves
  kept = run.roles_table(results, [0.1], out)
  assert '| 0.1 | 0.400 | 0.600 | positional (prev) | ✓ |' in kept
  assert '| 1.1 | 0.200 | 0.800 | - | · |' in kept
