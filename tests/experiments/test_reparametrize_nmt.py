"""experiments/collaborative/reparametrize_nmt.py: fine-tune seeds and the paired bootstrap of
each converted model against the original (no training: results and translations made up)."""

import gzip

import numpy as np
import pytest
import sacrebleu

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
  return {'name': name, 'seed': seed, 'config': config, 'metrics': metrics}


def test_intervals_pair_the_control_on_common_seeds(tmp_path, monkeypatch):
  data = tmp_path / 'data' / 'multi30k'
  data.mkdir(parents=True)
  for split, path in (('test', 'test_2016_flickr.de.gz'), ('validation', 'val.de.gz')):
    with gzip.open(data / path, 'wt', encoding='utf-8') as f:
      f.write('\n'.join(REFS[split]) + '\n')
  monkeypatch.setenv('LOWRANK_ATTN_DATA', str(tmp_path / 'data'))
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
