"""experiments/collaborative/reparametrize_nmt.py: fine-tune seeds and the paired bootstrap of
each converted model against the original (no training: results and translations made up)."""

import gzip
import types

import numpy as np
import pytest
import sacrebleu

from experiments import runner
from experiments.collaborative import reparametrize_nmt as nmt

REFS = {
    'test': ['ein Hund läuft im Park .', 'zwei Kinder spielen Fußball .', 'eine Frau liest .'],
    'validation': ['ein Mann fährt Rad .', 'die Katze schläft .', 'ein Junge springt .'],
}
GOOD = {s: list(r) for s, r in REFS.items()}
BAD = {s: [r[0], 'nichts .', r[2]] for s, r in REFS.items()}


def test_fine_tune_names_keep_the_seedless_name_at_the_sources_seed():
  assert nmt.finetune_name('collaborative-k64', 0, 0) == 'collaborative-k64-ft'
  assert nmt.finetune_name('collaborative-k64', 2, 0) == 'collaborative-k64-ft-s2'


def _run(name, method, key_dim, finetuned, seed, outputs, translations):
  (translations / name).mkdir(parents=True)
  metrics = []
  for split, hyps in outputs.items():
    (translations / name / f'{split}.txt').write_text('\n'.join(hyps) + '\n')
    bleu = sacrebleu.corpus_bleu(hyps, [REFS[split]]).score
    metrics.append({'split': split, 'step': 300, 'bleu': bleu, 'loss': 1.8})
  config = {'method': method, 'key_dim': key_dim, 'finetuned': finetuned}
  return {'name': name, 'seed': seed, 'config': config, 'metrics': metrics, 'wall_time_s': 60.0}


def _references(tmp_path, monkeypatch):
  """REFS as Multi30k's references, under LOWRANK_ATTN_DATA."""
  data = tmp_path / 'data' / 'multi30k'
  data.mkdir(parents=True)
  for split, path in (('test', 'test_2016_flickr.de.gz'), ('validation', 'val.de.gz')):
    with gzip.open(data / path, 'wt', encoding='utf-8') as f:
      f.write('\n'.join(REFS[split]) + '\n')
  monkeypatch.setenv('LOWRANK_ATTN_DATA', str(tmp_path / 'data'))


def test_intervals_pair_the_control_on_common_seeds(tmp_path, monkeypatch):
  _references(tmp_path, monkeypatch)
  t = tmp_path / 'translations'
  runs = [
      _run('original', 'original', 256, False, 0, GOOD, t),
      _run('original-ft', 'original', 256, True, 0, GOOD, t),
      _run('original-ft-s1', 'original', 256, True, 1, BAD, t),
      _run('collaborative-k64', 'collaborative', 64, False, 0, BAD, t),
      _run('collaborative-k64-ft', 'collaborative', 64, True, 0, BAD, t),
      _run('collaborative-k64-ft-s1', 'collaborative', 64, True, 1, GOOD, t),
      _run('collaborative-k64-ft-s2', 'collaborative', 64, True, 2, GOOD, t),  # no control
  ]
  rows = nmt.collect_rows({'runs': runs}, {})
  assert [r['seed'] for r in rows['collaborative', 64]['after']] == [0, 1, 2]
  got = {d['when']: d for d in nmt.intervals(rows, t)}
  assert got['before']['seeds'] == 1 and got['after']['seeds'] == 2  # seed 2 has no control
  for split in REFS:
    bleu = lambda hyps: sacrebleu.corpus_bleu(hyps, [REFS[split]]).score
    assert got['before'][split]['estimate'] == pytest.approx(bleu(BAD[split]) - bleu(GOOD[split]))
    # Seeds 0 and 1 of each side: (bad + good) / 2 minus (good + bad) / 2 = 0 on every resample.
    assert got['after'][split]['estimate'] == pytest.approx(0.0, abs=1e-9)
    assert got['after'][split]['low'] == pytest.approx(0.0, abs=1e-9)
    assert got['after'][split]['high'] == pytest.approx(0.0, abs=1e-9)
  assert np.isfinite(got['before']['test']['low'])


def test_unknown_method_is_refused(monkeypatch, capsys):
  monkeypatch.setattr('sys.argv', ['reparametrize_nmt', '--methods=collaborative,cp'])
  with pytest.raises(SystemExit):
    nmt.arguments()
  assert "unknown ['cp']" in capsys.readouterr().err


def test_plot_only_redraws_from_committed_files_once_source_and_conversions_are_gone(
    tmp_path, monkeypatch
):
  _references(tmp_path, monkeypatch)
  monkeypatch.setattr(nmt, 'HERE', tmp_path)
  out = tmp_path / 'nmt'
  runs = [
      _run('original', 'original', 256, False, 0, GOOD, out / 'translations'),
      _run('collaborative-k64', 'collaborative', 64, False, 0, BAD, out / 'translations'),
  ]
  gone = tmp_path / 'gone'  # the source run and the runs directory, neither ever made
  runner.files.write_json(out / 'results.json', {'runs': runs, 'runs_dir': str(gone)})
  layers = {'encoder/layers/0/self_attention': 0.5, 'decoder/layers/0/self_attention': 0.8}
  runner.files.write_json(out / 'conversions.json', {'collaborative-k64': layers})
  (tmp_path / 'README.md').write_text('<!-- nmt -->\n<!-- /nmt -->\n')
  monkeypatch.setattr(
      'sys.argv',
      ['reparametrize_nmt', '--plot_only', f'--source={gone}', f'--runs_dir={gone}'],
  )
  nmt.main()
  table = (out / 'results.md').read_text()
  assert '| collaborative | 64 | 0.650 |' in table  # the mean of the two layers' errors
  bleu = lambda hyps: sacrebleu.corpus_bleu(hyps, [REFS['test']]).score
  (converted,) = runner.files.read_json(out / 'intervals.json')
  assert converted['test']['estimate'] == pytest.approx(bleu(BAD['test']) - bleu(GOOD['test']))
  assert '| collaborative | 64 | converted vs original |' in (tmp_path / 'README.md').read_text()
  assert not gone.exists()


def test_a_grid_keeps_each_conversions_errors_beside_its_results(tmp_path, monkeypatch):
  """What --plot_only reads: every conversion's per-layer errors in `<name>/conversions.json`,
  those made before (a conversion directory kept in the runs directory) and those this grid
  makes, on top of what the file already held."""
  monkeypatch.setattr(nmt, 'HERE', tmp_path)
  (tmp_path / 'README.md').write_text('<!-- nmt -->\n<!-- /nmt -->\n')
  source = types.SimpleNamespace(
      path=str(tmp_path / 'source'),
      config=types.SimpleNamespace(seed=0),
      model=lambda: types.SimpleNamespace(cfg=types.SimpleNamespace(emb_dim=256)),
      data_overrides=lambda: {},
  )
  monkeypatch.setattr(nmt, 'RunDir', lambda path: source)
  monkeypatch.setattr(nmt, 'convert', lambda model, method, key_dim, kinds: key_dim)
  monkeypatch.setattr(nmt, 'with_overrides', lambda config, data: config)

  def write_run(key_dim, directory, config=None):
    directory.mkdir(parents=True)
    errors = {'encoder/layers/0/self_attention': key_dim / 100}
    runner.files.write_json(
        directory / 'conversion.json', {'relative_errors': errors, 'overrides': {}}
    )

  monkeypatch.setattr(nmt, 'write_run', write_run)
  grids = []
  monkeypatch.setattr(
      nmt.runner, 'run_grid', lambda runs, out, **kw: grids.append(runs) or {'runs': []}
  )
  runs_dir = tmp_path / 'runs'
  write_run(12, runs_dir / 'converted' / 'collaborative-k32')  # made by an earlier grid
  before = {'per_head_svd-k16': {'encoder/layers/0/self_attention': 0.9}}
  (tmp_path / 'nmt').mkdir()
  runner.files.write_json(tmp_path / 'nmt' / 'conversions.json', before)
  monkeypatch.setattr(
      'sys.argv',
      [
          'reparametrize_nmt',
          f'--runs_dir={runs_dir}',
          '--key_dims=64,32',
          '--methods=collaborative',
      ],
  )
  nmt.main()
  assert len(grids) == 1
  kept = runner.files.read_json(tmp_path / 'nmt' / 'conversions.json')
  assert kept == {
      **before,
      'collaborative-k64': {'encoder/layers/0/self_attention': 0.64},
      'collaborative-k32': {'encoder/layers/0/self_attention': 0.12},
  }
