"""The in-process parts of experiments/heads/glue_pruning.py: dev predictions with head masks
equal the physically pruned model's, the pruning levels remove round(10% k) heads in increasing
importance, random orders are seeded, the importance draw counts exactly N examples, and the
roles shares count what they say."""

import itertools

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.heads import glue_pruning as gp
from lowrank_attn import models
from lowrank_attn.pruning import prune_heads
from lowrank_attn.tasks import glue

V, D, H, LAYERS, LENGTH = 30, 16, 4, 2, 8


def classifier(num_outputs: int):
  spec = models.AttentionSpec(num_heads=H)
  cfg = models.TransformerConfig(
      vocab_size=V,
      emb_dim=D,
      mlp_dim=32,
      num_encoder_layers=LAYERS,
      num_decoder_layers=0,
      encoder_attention=spec,
      max_length=16,
      dropout_rate=0.0,
      type_vocab_size=2,
      norm='post',
  )
  model = glue.SentenceClassifier(
      cfg, num_outputs=num_outputs, pooling='mean', classifier_dropout=0.0, rngs=nnx.Rngs(0)
  )
  rng = np.random.default_rng(1)  # every weight random: no head is trivially silent
  nnx.update(
      model,
      jax.tree.map(
          lambda x: x + 0.5 * jnp.asarray(rng.standard_normal(x.shape), x.dtype),
          nnx.state(model, nnx.Param),
      ),
  )
  return model


def glue_batches(num_outputs: int, rows=(4, 4), real=(4, 2), seed=0):
  """Batches as the GLUE pipeline yields them; the last rows of a batch may be padding."""
  rng = np.random.default_rng(seed)
  batches = []
  for n, m in zip(rows, real):
    lengths = rng.integers(3, LENGTH + 1, n)
    inputs = rng.integers(3, V, (n, LENGTH)).astype(np.int32)
    inputs[np.arange(LENGTH)[None, :] >= lengths[:, None]] = 0
    segment_ids = (inputs != 0).astype(np.int32)
    batches.append(
        {
            'inputs': inputs,
            'segment_ids': segment_ids,
            'positions': np.where(segment_ids > 0, np.arange(LENGTH)[None, :], 0).astype(np.int32),
            'token_types': ((np.arange(LENGTH)[None, :] >= 2) * segment_ids).astype(np.int32),
            'targets': (
                rng.random(n).astype(np.float32) * 5
                if num_outputs == 1
                else rng.integers(0, num_outputs, n).astype(np.int32)
            ),
            'weights': (np.arange(n) < m).astype(np.float32),
        }
    )
  return batches


@pytest.mark.heavy  # three XLA compiles: over the fast tier's budget on the 2-core machine
@pytest.mark.parametrize('num_outputs', [1, 3], ids=['regression', 'classification'])
def test_masked_predictions_equal_the_pruned_models(num_outputs):
  model, batches = classifier(num_outputs), glue_batches(num_outputs)
  keep = np.array([[1, 0, 1, 1], [0, 0, 0, 0]], bool)  # the second layer loses every head
  masked, labels = gp.dev_predictions(model, batches, keep)
  pruned, pruned_labels = gp.dev_predictions(prune_heads(model, {'encoder': keep}), batches)
  full, _ = gp.dev_predictions(model, batches)
  assert len(masked) == 6  # padding rows left out
  np.testing.assert_array_equal(
      labels, np.concatenate([b['targets'][:m] for b, m in zip(batches, (4, 2))])
  )
  np.testing.assert_array_equal(pruned_labels, labels)
  if num_outputs == 1:
    np.testing.assert_allclose(masked, pruned, atol=1e-5)
    assert np.abs(masked - full).max() > 1e-3  # the masks do change the scores
  else:
    np.testing.assert_array_equal(masked, pruned)
    assert (masked != full).any()  # (seeded: the masks change some classes)


def test_levels_remove_round_tenths_of_the_heads_in_increasing_importance():
  importance = np.random.default_rng(0).random((6, 12))
  keeps = gp.level_keeps(gp.importance_order(importance), gp.LEVELS, (6, 12))
  removed = [int((~k).sum()) for k in keeps]
  assert removed == [round(0.1 * k * 72) for k in range(10)]
  assert removed == [0, 7, 14, 22, 29, 36, 43, 50, 58, 65]
  for keep in keeps[1:]:
    assert importance[~keep].max() < importance[keep].min()  # the least important go first
  for earlier, later in zip(keeps, keeps[1:]):
    assert not (later & ~earlier).any()  # a removed head stays removed


def test_random_orders_are_seeded_and_keep_the_count():
  draws = [gp.level_keeps(gp.random_order(seed, (6, 12)), gp.LEVELS, (6, 12)) for seed in (0, 0, 1)]
  for a, b in zip(draws[0], draws[1]):
    np.testing.assert_array_equal(a, b)
  assert any((a != b).any() for a, b in zip(draws[0], draws[2]))
  for keeps in draws:
    assert [int(k.sum()) for k in keeps] == [72 - round(0.1 * k * 72) for k in range(10)]


def test_the_importance_draw_counts_exactly_the_examples_asked_for():
  batches = glue_batches(1, rows=(4, 4, 4, 4), real=(4, 3, 4, 4))
  taken = gp.first_examples(iter(batches), 6)
  assert len(taken) == 2 and sum(float(b['weights'].sum()) for b in taken) == 6
  np.testing.assert_array_equal(taken[1]['weights'], [1, 1, 0, 0])
  np.testing.assert_array_equal(batches[1]['weights'], [1, 1, 1, 0])  # the input is not changed


def test_role_shares_count_the_survivors_with_roles():
  roles = {
      (0, 0): ['positional (prev)'],
      (0, 1): ['syntactic (nsubj ->)', 'rare'],
      (1, 0): [],
      (1, 1): ['rare'],
      (2, 0): [],
      (2, 1): [],
  }
  keep = np.array([[1, 0], [1, 1], [0, 0]], bool)
  shares = gp.role_shares(keep, roles)
  assert shares['kept'] == 3
  assert (shares['any']['kept'], shares['any']['role_heads']) == (2, 3)
  assert shares['any']['share_kept'] == pytest.approx(2 / 3)
  assert shares['any']['share_all'] == pytest.approx(3 / 6)
  assert (shares['rare']['kept'], shares['rare']['role_heads']) == (1, 2)
  assert (shares['syntactic']['kept'], shares['positional']['kept']) == (0, 1)
  # P(at least 2 of the 3 role heads among 3 random survivors of 6), by enumeration.
  draws = list(itertools.combinations(roles, 3))
  marked = {h for h, labels in roles.items() if labels}
  expected = sum(len(marked & set(d)) >= 2 for d in draws) / len(draws)
  assert shares['any']['p_at_least'] == pytest.approx(expected)
  at_most = sum(len(marked & set(d)) <= 2 for d in draws) / len(draws)
  assert shares['any']['p_at_most'] == pytest.approx(at_most)


def test_kept_predictions_must_give_the_recorded_score(tmp_path):
  """A run's predictions and an analysis point's (a key in the same file) are read only when
  they give the row's recorded score (plain accuracy here); a missing key is None."""
  import argparse  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top

  labels = [1, 0, 1, 1, 0, 0, 1, 0]
  run_predictions = [1, 0, 1, 0, 0, 0, 1, 1]  # 6 of 8
  level = [0, 0, 1, 0, 1, 0, 1, 1]  # 4 of 8
  (tmp_path / 'predictions').mkdir()
  kept = {'predictions': run_predictions, 'labels': labels, 'level-0.3': level}
  (tmp_path / 'predictions' / 'rte-ft.json').write_text(json.dumps(kept))
  args = argparse.Namespace(out=tmp_path)
  row = lambda key, score: {'task': 'rte', 'score': score, 'source': ('rte-ft', key)}
  assert gp._predictions(args, row(None, 75.0)) == (run_predictions, labels)
  assert gp._predictions(args, row('level-0.3', 50.0)) == (level, labels)
  assert gp._predictions(args, row('level-0.5', 50.0)) is None
  with pytest.raises(ValueError, match=r'rte-ft \(level-0.3\): its kept predictions score'):
    gp._predictions(args, row('level-0.3', 62.5))
  with pytest.raises(ValueError, match='rte-ft: its kept predictions score 75.0000'):
    gp._predictions(args, row(None, 50.0))


def test_a_lost_run_that_runs_still_to_do_start_from_is_needed_again(tmp_path):
  """results.json stands for a finished run whose directory is gone, except where a run still
  to do starts from it: the fine-tuned original while the analysis, an L0 run, the control or
  a pruned fine-tune is not recorded; the analysis while a pruned fine-tune is not."""
  import json  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top

  args = types.SimpleNamespace(
      out=tmp_path, lambdas=[0.01, 0.1], l0_epochs=None, random_finetune_seeds=[0]
  )
  original, analyse = 'mrpc-original-s0', 'mrpc-analyse-s0'
  second = ['mrpc-original-again-s0', 'mrpc-l0-0.01-s0', 'mrpc-l0-0.1-s0']
  tuned = ['mrpc-michel-p0.5-ft-s0', 'mrpc-random0-p0.5-ft-s0']

  def needed(*names):
    (tmp_path / 'results.json').write_text(json.dumps({'runs': [{'name': n} for n in names]}))
    return gp.needed_runs('mrpc', 0, args)

  assert gp.needed_runs('mrpc', 0, args) == {original, analyse}  # nothing recorded yet
  assert needed(original, analyse, *second) == {original, analyse}  # the fine-tunes unnamed
  record = {'finetune': {'michel-p0.5': {}, 'random0-p0.5': {}}}
  (tmp_path / gp.ANALYSIS_FILE).write_text(json.dumps({'mrpc-s0': record}))
  assert needed(original, analyse, *second, tuned[0]) == {original, analyse}
  assert needed(original, analyse, *second[:2], *tuned) == {original}
  assert needed(original, *second, *tuned) == {original}  # the analysis starts from it
  assert needed(original, analyse, *second, *tuned) == set()
  assert gp.needed_runs('stsb', 0, args) == {'stsb-original-s0', 'stsb-analyse-s0'}


def test_a_prune_run_and_its_fine_tunes_are_needed_like_the_analysis(tmp_path):
  """Random orders fine-tuned beyond the analysis's own (order 0) come from prune runs: one is
  needed until its pruned models' fine-tunes are recorded, and the original with it."""
  import json  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top

  args = types.SimpleNamespace(
      out=tmp_path, lambdas=[], l0_epochs=None, random_finetune_seeds=[0, 2]
  )
  original, analyse, prune = 'mrpc-original-s0', 'mrpc-analyse-s0', 'mrpc-prune-random2-s0'
  tuned = ['mrpc-random0-p0.5-ft-s0']
  (tmp_path / gp.ANALYSIS_FILE).write_text(
      json.dumps({'mrpc-s0': {'finetune': {'random0-p0.5': {}}}})
  )

  def needed(*names):
    (tmp_path / 'results.json').write_text(json.dumps({'runs': [{'name': n} for n in names]}))
    return gp.needed_runs('mrpc', 0, args)

  assert needed(original, analyse, *tuned) == {original, prune}  # the prune run not recorded
  assert needed(original, analyse, *tuned, prune) == {original, prune}  # its fine-tunes unnamed
  (tmp_path / gp.PRUNED_FILE).write_text(json.dumps({prune: {'random2-p0.5': {'dir': 'x'}}}))
  assert needed(original, analyse, *tuned, prune) == {original, prune}
  done = [original, analyse, 'mrpc-original-again-s0', *tuned, prune]
  assert needed(*done, 'mrpc-random2-p0.5-ft-s0') == set()
  assert gp.to_finetune('mrpc', 0, args) == {'random0-p0.5': {}, 'random2-p0.5': {'dir': 'x'}}


def test_prune_writes_the_random_orders_pruned_models(tmp_path, monkeypatch):
  """`prune`: random order 2 of the 6 x 12 heads, drawn here with numpy, its first round(72 x
  level) heads removed at each level, each pruned model written as a run under out/pruned/."""
  import json  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top

  from lowrank_attn import pruning, runs  # pylint: disable=g-import-not-at-top

  written = {}

  def prune_run(source, keep, directory, step):
    written[directory.name] = (source, np.asarray(keep['encoder']), step)
    return {'init_from': str(directory)}

  config = types.SimpleNamespace(
      model=types.SimpleNamespace(
          num_encoder_layers=6, attention=types.SimpleNamespace(num_heads=12)
      )
  )
  fake = lambda path: types.SimpleNamespace(path=path, config=config, check_step=lambda: 7)
  monkeypatch.setattr(pruning, 'prune_run', prune_run)
  monkeypatch.setattr(runs, 'RunDir', fake)
  gp.prune(['--run=SRC', f'--out={tmp_path}', '--random_seed=2', '--levels=0.3,0.5'])
  order = np.random.default_rng(2).permutation(72)
  record = json.loads((tmp_path / gp.PRUNED_FILE).read_text())
  assert sorted(record) == sorted(written) == ['random2-p30', 'random2-p50']
  for name, removed in (('random2-p30', 22), ('random2-p50', 36)):
    source, keep, step = written[name]
    expected = np.ones(72, bool)
    expected[order[:removed]] = False
    assert (source, step) == ('SRC', 7)
    np.testing.assert_array_equal(keep, expected.reshape(6, 12))
    assert record[name]['heads_kept'] == 72 - removed and record[name]['seed'] == 2
    assert record[name]['dir'] == str(tmp_path / 'pruned' / name)


def test_the_grid_prunes_further_random_orders_in_runs_of_their_own(tmp_path, monkeypatch):
  """With --random_finetune_seeds=0,1: the analysis's command is the one recorded runs have
  (order 0 only), order 1 gets a prune run, and the fine-tunes start from both's models."""
  import json  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top

  planned, commands = [], {}

  def grid(runs, args, needed):
    planned.append([r.name for r in runs])
    commands.update({r.name: r.command for r in runs})
    return {'runs': [{'name': r.name} for r in runs], 'runs_dir': str(tmp_path)}

  for name in ('keep_analyses', 'keep_gates', 'report'):
    monkeypatch.setattr(gp, name, lambda *args: None)
  monkeypatch.setattr(gp, 'grid', grid)
  monkeypatch.setattr(gp, 'OUT', tmp_path)
  (tmp_path / gp.ANALYSIS_FILE).write_text(
      json.dumps(
          {
              'mrpc-s0': {
                  'finetune': {
                      'random0-p0.5': {
                          'dir': 'A',
                          'method': 'random',
                          'seed': 0,
                          'level': 0.5,
                          'heads_kept': 36,
                      }
                  }
              }
          }
      )
  )
  (tmp_path / gp.PRUNED_FILE).write_text(
      json.dumps(
          {
              'mrpc-prune-random1-s0': {
                  'random1-p0.5': {
                      'dir': 'B',
                      'method': 'random',
                      'seed': 1,
                      'level': 0.5,
                      'heads_kept': 36,
                  }
              }
          }
      )
  )
  argv = [
      'glue_pruning',
      f'--runs_dir={tmp_path}',
      '--tasks=mrpc',
      '--lambdas=',
      '--finetune_levels=0.5',
      '--random_finetune_seeds=0,1',
  ]
  monkeypatch.setattr(sys, 'argv', argv)
  gp.main()
  assert planned[1] == ['mrpc-original-s0', 'mrpc-analyse-s0', 'mrpc-prune-random1-s0']
  assert '--random_finetune_seeds=0' in commands['mrpc-analyse-s0']
  assert '--random_seed=1' in commands['mrpc-prune-random1-s0']
  assert {'mrpc-random0-p0.5-ft-s0', 'mrpc-random1-p0.5-ft-s0'} <= set(planned[2])
  ft = ' '.join(commands['mrpc-random1-p0.5-ft-s0'])
  assert '--config.init_from=B' in ft


@pytest.mark.parametrize('script', ['glue_pruning', 'glue_reparam'])
def test_the_grids_run_again_the_needed_runs_of_their_own(tmp_path, monkeypatch, script):
  """Both GLUE scripts hand the runner, of the needed runs, those in the grid it runs (the
  first grid holds the originals only)."""
  from experiments import runner  # pylint: disable=g-import-not-at-top
  from experiments.collaborative import glue_reparam  # pylint: disable=g-import-not-at-top

  module = gp if script == 'glue_pruning' else glue_reparam
  seen = {}

  def run_grid(runs, out, runs_dir, rerun_lost, **options):
    seen['rerun_lost'] = rerun_lost
    return {'runs': [], 'runs_dir': str(runs_dir)}

  monkeypatch.setattr(runner, 'run_grid', run_grid)
  args = runner.arg_parser(None, script).parse_args([f'--runs_dir={tmp_path}'])
  args.out = tmp_path
  runs = [runner.Run('mrpc-original-s0', ['true'])]
  module.grid(runs, args, {'mrpc-original-s0', 'mrpc-analyse-s0'})
  assert seen['rerun_lost'] == {'mrpc-original-s0'}


def test_plot_only_keeps_what_the_run_directories_hold_before_the_report(tmp_path, monkeypatch):
  """After a grid stopped midway, --plot_only reports its finished runs: their predictions,
  analyses and gates are kept first (the full command would start the others)."""
  import json  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top

  (tmp_path / 'results.json').write_text(json.dumps({'runs': [], 'runs_dir': str(tmp_path)}))
  calls = []
  for name in ('keep_predictions', 'keep_analyses', 'keep_gates', 'report'):
    monkeypatch.setattr(gp, name, lambda *args, name=name: calls.append(name))
  monkeypatch.setattr(gp, 'OUT', tmp_path)
  monkeypatch.setattr(sys, 'argv', ['glue_pruning', f'--runs_dir={tmp_path}', '--plot_only'])
  gp.main()
  assert calls == ['keep_predictions', 'keep_analyses', 'keep_gates', 'report']


def test_glue_reparam_plot_only_keeps_the_predictions_its_run_directories_hold(tmp_path):
  import argparse  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top

  from experiments.collaborative import glue_reparam  # pylint: disable=g-import-not-at-top

  runs_dir, out = tmp_path / 'runs', tmp_path / 'out'
  for step in (9, 10):  # the last step's, not the last name's
    found = runs_dir / 'rte-original-s0' / 'final_eval' / str(step)
    found.mkdir(parents=True)
    (found / glue_reparam.PREDICTIONS).write_text(json.dumps({'step': step}))
  line = {'split': 'validation', 'step': 10, 'score': 57.4}  # the run its entry records
  (runs_dir / 'rte-original-s0' / 'metrics.jsonl').write_text(json.dumps(line) + '\n')
  out.mkdir()
  entry = {'name': 'rte-original-s0', 'metrics': [line]}
  recorded = {'runs': [entry], 'runs_dir': str(runs_dir)}
  (out / 'results.json').write_text(json.dumps(recorded))
  args = argparse.Namespace(out=out, plot_only=True)
  assert glue_reparam.grid([], args, set()) == recorded
  kept = json.loads((out / 'predictions' / 'rte-original-s0.json').read_text())
  assert kept == {'step': 10}


def _keep_predictions(out, answers, labels) -> None:
  """Each answer list kept as `out/predictions/<name>.json`, as the grids keep a run's."""
  import json  # pylint: disable=g-import-not-at-top

  (out / 'predictions').mkdir()
  for name, predictions in answers.items():
    found = {'predictions': predictions, 'labels': labels}
    (out / 'predictions' / f'{name}.json').write_text(json.dumps(found))


def test_the_report_sets_each_l0_run_against_the_fine_tune_without_gates(tmp_path):
  """Voita's control: the L0 run against the same second fine-tune without gates (not only
  against the model both start from), with its paired interval; and the floor of a constant
  prediction. Accuracy on SST-2-like labels, so the scores are fractions of 8 by hand."""
  import argparse  # pylint: disable=g-import-not-at-top

  labels = [1, 1, 1, 1, 1, 0, 0, 0]
  answers = {  # right on 4, 6 and 7 of the 8
      'unpruned': [1, 1, 1, 1, 0, 1, 1, 1],
      'again': [1, 1, 1, 1, 1, 1, 0, 1],
      'l0': [1, 1, 1, 1, 1, 1, 0, 0],
  }
  _keep_predictions(tmp_path, answers, labels)
  row = lambda name, method, score, **extra: {
      'task': 'sst2',
      'seed': 0,
      'score': score,
      'method': method,
      'source': (name, None),
      **extra,
  }
  rows = [
      row('unpruned', 'unpruned', 50.0, heads_kept=72, level=0.0),
      row('again', 'fine-tuned again', 75.0, heads_kept=72, level=0.0),
      row('l0', 'L0 gates', 87.5, heads_kept=40, keep=[[1] * 12] * 6, **{'lambda': 0.03}),
  ]
  args = argparse.Namespace(out=tmp_path, finetune_levels=[0.3])
  table, _, entry = gp.task_report('sst2', rows, None, args)
  l0 = next(e for e in entry['rows'] if e['method'] == 'L0 gates')
  assert l0['minus_again']['estimate'] == pytest.approx(12.5)
  assert l0['minus_unpruned']['estimate'] == pytest.approx(37.5)
  assert entry['constant'] == pytest.approx(62.5)  # five of eight are 1
  assert 'L0 − fine-tuned again' in table and '+12.50' in table


def test_the_report_sets_random_order_against_michels_at_each_finetuned_level(tmp_path):
  """Does the order matter? At a level with fine-tunes, random pruning (its orders averaged) is
  set against Michel's at the same level, without and with the fine-tune, each against its
  own kind; levels without fine-tunes get no comparison. Accuracy on 8 labels by hand."""
  import argparse  # pylint: disable=g-import-not-at-top

  labels = [1, 1, 1, 1, 1, 0, 0, 0]
  answers = {  # right on: 5, 6, 4, 3, 8, 3, 7, 5 and 5 of the 8
      'unpruned': [1, 1, 1, 1, 1, 1, 1, 1],
      'michel': [1, 1, 1, 1, 1, 1, 1, 0],
      'random0': [1, 1, 1, 1, 0, 1, 1, 1],
      'random1': [1, 1, 0, 0, 1, 1, 1, 1],
      'michel_ft': [1, 1, 1, 1, 1, 0, 0, 0],
      'random0_ft': [1, 1, 0, 0, 0, 0, 1, 1],
      'random1_ft': [1, 1, 1, 1, 1, 0, 0, 1],
      'michel_40': [1, 1, 1, 1, 1, 1, 1, 1],
      'random_40': [1, 1, 1, 1, 1, 1, 1, 1],
  }
  _keep_predictions(tmp_path, answers, labels)
  right = lambda name: 100 * np.mean(np.equal(answers[name], labels))
  row = lambda name, method, level, seed=0: {
      'task': 'sst2',
      'seed': 0,
      'random_seed': seed,
      'score': right(name),
      'method': method,
      'level': level,
      'heads_kept': round(72 * (1 - level)),
      'source': (name, None),
  }
  rows = [
      row('unpruned', 'unpruned', 0.0),
      row('michel', 'Michel', 0.3),
      row('random0', 'random', 0.3),
      row('random1', 'random', 0.3, seed=1),
      row('michel_ft', 'Michel+ft', 0.3),
      row('random0_ft', 'random+ft', 0.3),
      row('random1_ft', 'random+ft', 0.3, seed=1),
      row('michel_40', 'Michel', 0.4),
      row('random_40', 'random', 0.4),
  ]
  args = argparse.Namespace(out=tmp_path, finetune_levels=[0.3])
  table, _, entry = gp.task_report('sst2', rows, None, args)
  got = {(e['method'], e.get('level')): e for e in entry['rows']}
  random_mean = (right('random0') + right('random1')) / 2
  assert got['random', 0.3]['minus_michel']['estimate'] == pytest.approx(
      random_mean - right('michel')
  )
  ft_mean = (right('random0_ft') + right('random1_ft')) / 2
  assert got['random+ft', 0.3]['minus_michel']['estimate'] == pytest.approx(
      ft_mean - right('michel_ft')
  )
  assert 'minus_michel' not in got['random', 0.4]  # no fine-tunes at 40%: no comparisons
  assert 'minus_michel' not in got['Michel', 0.3] and 'minus_michel' not in got['Michel+ft', 0.3]
  assert 'random − Michel, same pruning' in table
  assert f'{ft_mean - right("michel_ft"):+.2f}' in table


def test_the_report_pairs_rows_on_the_task_seeds_both_have(tmp_path):
  """A grid still running (a second task seed whose L0 runs have not finished): each row's
  score is the mean of its own runs, but a difference sets the L0 run against the unpruned
  model of its own seed only, not against the mean over seeds it lacks. Accuracy on 8 labels
  by hand."""
  import argparse  # pylint: disable=g-import-not-at-top

  labels = [1, 1, 1, 1, 1, 0, 0, 0]
  answers = {  # right on 4, 8, 6 and 7 of the 8
      'unpruned_s0': [1, 1, 1, 1, 0, 1, 1, 1],
      'unpruned_s1': [1, 1, 1, 1, 1, 0, 0, 0],
      'again_s0': [1, 1, 1, 1, 1, 1, 0, 1],
      'l0_s0': [1, 1, 1, 1, 1, 1, 0, 0],
  }
  _keep_predictions(tmp_path, answers, labels)
  right = lambda name: 100 * np.mean(np.equal(answers[name], labels))
  row = lambda name, method, seed, **extra: {
      'task': 'sst2',
      'seed': seed,
      'score': right(name),
      'method': method,
      'source': (name, None),
      **extra,
  }
  rows = [
      row('unpruned_s0', 'unpruned', 0, heads_kept=72, level=0.0),
      row('unpruned_s1', 'unpruned', 1, heads_kept=72, level=0.0),
      row('again_s0', 'fine-tuned again', 0, heads_kept=72, level=0.0),
      row('l0_s0', 'L0 gates', 0, heads_kept=40, keep=[[1] * 12] * 6, **{'lambda': 0.03}),
  ]
  args = argparse.Namespace(out=tmp_path, finetune_levels=[0.3])
  table, _, entry = gp.task_report('sst2', rows, None, args)
  got = {e['method']: e for e in entry['rows']}
  assert got['unpruned']['score'] == pytest.approx(
      (right('unpruned_s0') + right('unpruned_s1')) / 2
  )
  assert got['unpruned']['seeds'] == [0, 1] and got['L0 gates']['seeds'] == [0]
  assert got['L0 gates']['minus_unpruned']['estimate'] == pytest.approx(
      right('l0_s0') - right('unpruned_s0')  # 25.0; against both seeds' mean it would be 0.0
  )
  assert got['fine-tuned again (L0 control)']['minus_unpruned']['estimate'] == pytest.approx(
      right('again_s0') - right('unpruned_s0')
  )
  assert '| 0,1 |' in table and '+25.00' in table


def test_kept_scores_are_float32s_shortest_decimals_and_classes_stay():
  scores = np.array([4.749688148498535, 0.26093870401382446], np.float32)
  assert gp.stored(scores) == [4.749688, 0.2609387]
  assert np.array_equal(np.float32(gp.stored(scores)), scores)  # the same float32s
  assert gp.stored(np.array([1, 0, 1])) == [1, 0, 1]
