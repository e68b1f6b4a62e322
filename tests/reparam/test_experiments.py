"""The collaborative experiments' own logic: the retrieval metric on a hand-built case, the
caption files' checks, and the from-scratch grid's configs (concat heads keep frozen mixing)."""

import functools
import gzip
import json
import types

import numpy as np
import pytest

from experiments.collaborative import from_scratch, reparametrize_minilm
from lowrank_attn.runs import with_overrides
from lowrank_attn.train import config as config_lib, state as state_lib


def test_retrieval_metrics_on_three_images():
  """Files 0-3 describe image i by e_i; file 4 swaps the captions of images 0 and 1.

  Between files 0-3 (12 ordered pairs) every query ranks first. From or to file 4 (8 pairs)
  images 0 and 1 rank second (one wrong caption scores 1 > 0; the tie with image 2's caption
  at 0 does not count against them), image 2 first: recall 1/3, MRR (1/2 + 1/2 + 1) / 3.
  """
  identity = np.eye(3)
  files = [identity] * 4 + [identity[[1, 0, 2]]]
  metrics = reparametrize_minilm.retrieval_metrics(files)
  assert metrics['recall_at_1'] == pytest.approx((12 + 8 / 3) / 20)
  assert metrics['mrr'] == pytest.approx((12 + 8 * 2 / 3) / 20)


def write_captions(directory, lengths):
  paths = []
  for i, length in enumerate(lengths):
    path = directory / f'captions.{i}.en.gz'
    with gzip.open(path, 'wt') as f:
      f.writelines(f'caption {j} of file {i}\n' for j in range(length))
    paths.append(str(path))
  return paths


def test_caption_files_are_checked(tmp_path):
  captions = reparametrize_minilm.read_captions(write_captions(tmp_path, [3] * 5))
  assert captions[4][2] == 'caption 2 of file 4'
  with pytest.raises(ValueError, match='needs 5 files.*got 4'):
    reparametrize_minilm.read_captions(write_captions(tmp_path, [3] * 4))
  with pytest.raises(ValueError, match=r'the same number each; got .*: 2'):
    reparametrize_minilm.read_captions(write_captions(tmp_path, [3, 3, 2, 3, 3]))


def minilm_entry(method, key_dim, finetuned, recall):
  return {
      'method': method,
      'key_dim': key_dim,
      'finetuned': finetuned,
      'recall_at_1': recall,
      'mrr': recall + 0.1,
      'mean_relative_error': 0.25,
      'attention_params': 1000,
      'attention_mflops': 1.5,
  }


def every_minilm_entry(key_dim):
  """What a finished run at one key width holds: the original and each method before and
  after its fine-tune."""
  methods = reparametrize_minilm.METHODS
  return [minilm_entry('original', 384, False, 0.9)] + [
      minilm_entry(m, key_dim, f, 0.5 + 0.1 * f) for m in methods for f in (False, True)
  ]


def refuse(*args, **kwargs):
  raise AssertionError('nothing should be loaded or computed here')


def test_minilm_plot_only_draws_from_results_alone(tmp_path, monkeypatch):
  monkeypatch.setattr(reparametrize_minilm.bert, 'load_pretrained', refuse)
  monkeypatch.setattr(reparametrize_minilm, 'data_file', refuse)
  (tmp_path / 'results.json').write_text(json.dumps(every_minilm_entry(64)))
  reparametrize_minilm.main(['--plot_only', f'--out={tmp_path}'])
  table = (tmp_path / 'results.md').read_text()
  assert '| original | 384 |  | 0.900 | 1.000 | 0.250 | 1,000 | 1.5 |' in table
  assert '| per_head_svd | 64 | yes | 0.600 | 0.700 |' in table
  assert (tmp_path / 'recall_at_1.png').exists()
  with pytest.raises(SystemExit, match='holds no results'):
    reparametrize_minilm.main(['--plot_only', f'--out={tmp_path / "empty"}'])


def test_minilm_rerun_with_every_entry_done_reads_no_fine_tune_data(tmp_path, monkeypatch):
  """A rerun of a finished width computes nothing: the distillation targets (the original's
  embeddings of the fine-tune sentences) are made only when a fine-tune is left to run."""
  original = types.SimpleNamespace(cfg=types.SimpleNamespace(emb_dim=384))
  monkeypatch.setattr(reparametrize_minilm.bert, 'load_pretrained', lambda _: original)
  monkeypatch.setattr(reparametrize_minilm, 'data_file', refuse)
  monkeypatch.setattr(reparametrize_minilm.bert, 'embed_sentences', refuse)
  out = tmp_path / 'out'
  out.mkdir()
  (out / 'results.json').write_text(json.dumps(every_minilm_entry(64)))
  captions = ','.join(write_captions(tmp_path, [3] * 5))
  reparametrize_minilm.main([f'--captions={captions}', '--key_dims=64', f'--out={out}'])
  assert json.loads((out / 'results.json').read_text()) == every_minilm_entry(64)
  assert '| collaborative | 64 | yes | 0.600 |' in (out / 'results.md').read_text()


def test_from_scratch_configs():
  base = from_scratch.load_config('configs/nmt.py:multi30k')
  concat = from_scratch.training_fields('concat', 256, 256, 600)
  assert not any(k.startswith('model.attention') for k in concat)  # the baseline layer
  narrow = {
      kind: with_overrides(base, from_scratch.training_fields(kind, 64, 256, 600))
      for kind in from_scratch.KINDS
  }
  for kind, config in narrow.items():
    config_lib.validate(config)
    spec = config_lib.model_config(config, 100).attention('cross', 0)
    assert (spec.kind, spec.key_dim, spec.head_dim) == ('collaborative', 64, 32)
    assert spec.logit_scale == pytest.approx(1 / np.sqrt(64 / 8))
  assert narrow['concat'].model.attention.mixing_init == 'concatenate'
  assert narrow['collaborative'].model.attention.mixing_init == 'random'
  # Concat heads: only the mixing is frozen.
  params = {
      'encoder': {'layers': {0: {'self_attention': {'mixing': 0, 'query_kernel': 0}}}},
      'tokens': {'embed': {'embedding': 0}},
  }
  labels = state_lib.trainable_labels(params, narrow['concat'].trainable)
  assert labels['encoder']['layers'][0]['self_attention'] == {
      'mixing': 'frozen',
      'query_kernel': 'train',
  }
  assert labels['tokens']['embed']['embedding'] == 'train'
  assert narrow['collaborative'].trainable is None


def test_from_scratch_controls_of_the_full_width_lead():
  """At D~k = D: collaborative with trained mixing from block one-hot (concat at step 0) and
  from all-ones, and fixed head size 64 (rank 64 per head; concat's heads have 32)."""
  base = from_scratch.load_config('configs/nmt.py:multi30k')
  specs = {}
  for kind in from_scratch.CONTROLS:
    width = from_scratch.key_width_of(kind, base)
    config = with_overrides(base, from_scratch.training_fields(kind, width, 256, 600))
    config_lib.validate(config)
    assert config.trainable is None  # everything trains, the mixing included
    specs[kind] = config_lib.model_config(config, 100).attention('encoder', 0)
  for kind, init, scale in [
      ('collaborative_concat_init', 'concatenate', 1 / np.sqrt(32)),
      ('collaborative_ones_init', 'all_ones', 1 / np.sqrt(32)),
      ('collaborative_ones_init_scaled', 'all_ones', 1 / np.sqrt(256)),
  ]:
    spec = specs[kind]
    assert (spec.kind, spec.key_dim, spec.head_dim, spec.mixing_init) == (
        'collaborative',
        256,
        32,
        init,
    )
    assert spec.logit_scale == pytest.approx(scale)
  fixed = specs['fixed_head_64']
  assert (fixed.kind, fixed.head_dim, fixed.num_heads) == ('fixed_head', 64, 8)
  assert from_scratch.key_width_of('fixed_head_64', base) == 8 * 64
  assert fixed.logit_scale == pytest.approx(1 / 8)


def test_scaled_all_ones_mixing_gives_a_concat_heads_logit_variance():
  """What the scaled control is for: at step 0, with unit-variance queries and keys, an
  all-ones head's logits under the default scale have 8x the variance of a concat head's (a
  sum of 256 products, not 32, under the same 1/sqrt(32)); under the scaled control's logit
  scale they have the same. Concat head: numpy, 32 columns, 1/sqrt(32)."""
  from lowrank_attn.attention import kernels  # pylint: disable=g-import-not-at-top
  from lowrank_attn.attention import spec as spec_lib  # pylint: disable=g-import-not-at-top

  base = from_scratch.load_config('configs/nmt.py:multi30k')
  rng = np.random.default_rng(0)
  q, k = rng.standard_normal((2, 512, 256)).astype(np.float32)
  concat = (q[:, :32] @ k[:, :32].T) / np.sqrt(32)
  ones = spec_lib.init_mixing('all_ones', None, 8, 256, np.float32)
  for kind, ratio in [('collaborative_ones_init', 8.0), ('collaborative_ones_init_scaled', 1.0)]:
    config = with_overrides(base, from_scratch.training_fields(kind, 256, 256, 600))
    spec = config_lib.model_config(config, 100).attention('encoder', 0)
    logits = np.asarray(kernels.collaborative_logits(q, k, ones, spec.logit_scale))[0]
    # 512^2 logits each: the variance ratio's sampling error is a few percent.
    assert logits.var() / concat.var() == pytest.approx(ratio, rel=0.1)


def test_from_scratch_report_bootstraps_kept_translations_against_concat(tmp_path, monkeypatch):
  """Two seeds of concat and of a control at D~k = D, translations written by hand from the
  real references (test and validation): the report's interval is sacreBLEU's difference of the
  seed means, a run whose recorded BLEU its kept translations do not give is refused, and a
  budget other than 600 steps is tabled apart, without a concat partner, so without interval."""
  import argparse  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top

  import sacrebleu  # pylint: disable=g-import-not-at-top

  data = os.environ['LOWRANK_ATTN_DATA']
  refs = {
      split: from_scratch.read_lines(os.path.join(data, path))
      for split, path in from_scratch.REFERENCES.items()
  }
  rng = np.random.default_rng(0)

  def drop(sentence, p):
    return ' '.join(w for w in sentence.split() if rng.random() > p) or 'ein'

  translations = tmp_path / 'out' / 'translations'
  runs, bleu = [], {}
  for kind, p, steps in [
      ('concat', 0.3, 600),
      ('collaborative_concat_init', 0.2, 600),
      ('concat', 0.1, 1800),
  ]:
    for seed in (0, 1):
      name = f'{kind}-k256-s{seed}' + ('' if steps == 600 else f'-n{steps}')
      metrics = []
      for split, references in refs.items():
        hyps = [drop(r, p) for r in references]
        (translations / name).mkdir(parents=True, exist_ok=True)
        (translations / name / f'{split}.txt').write_text(''.join(h + '\n' for h in hyps))
        bleu[name, split] = sacrebleu.corpus_bleu(hyps, [references]).score
        metrics.append({'split': split, 'step': steps, 'bleu': bleu[name, split]})
      config = {'kind': kind, 'key_width': 256, 'steps': steps}
      runs.append(
          {'name': name, 'seed': seed, 'config': config, 'wall_time_s': 1.0, 'metrics': metrics}
      )
  results = {'runs_dir': str(tmp_path / 'runs'), 'runs': runs}
  args = argparse.Namespace(out=tmp_path / 'out', smoke=True)
  base = from_scratch.load_config('configs/nmt.py:multi30k')
  from_scratch.report(results, base, args)

  (entry,) = json.loads((tmp_path / 'out' / 'intervals.json').read_text())
  assert (entry['kind'], entry['key_width'], entry['steps'], entry['seeds']) == (
      'collaborative_concat_init',
      256,
      600,
      2,
  )
  for split in refs:
    mean = lambda kind: np.mean([bleu[f'{kind}-k256-s{s}', split] for s in (0, 1)])
    expected = mean('collaborative_concat_init') - mean('concat')
    assert entry[split]['estimate'] == pytest.approx(expected, abs=1e-9)
    assert entry[split]['low'] < expected < entry[split]['high']
  table = (tmp_path / 'out' / 'results.md').read_text()
  assert '| 1,800 | concat | 256 | 2 |' in table

  runs[0]['metrics'][0]['bleu'] += 0.5  # a recorded score its translations do not give
  with pytest.raises(ValueError, match='concat-k256-s0: test BLEU .* recorded'):
    from_scratch.report(results, base, args)


def test_narrowing_contrasts_the_lead_at_a_narrow_width_with_the_lead_at_full_width(tmp_path):
  """(collaborative - concat at D~k) - (collaborative - concat at D) from kept translations of
  the real references: sacreBLEU's scores combined, seeds averaged; a width without all four
  cells (here 64: no collaborative) gets no row, and the controls are not in it."""
  import os  # pylint: disable=g-import-not-at-top

  import sacrebleu  # pylint: disable=g-import-not-at-top

  data = os.environ['LOWRANK_ATTN_DATA']
  refs = {
      split: from_scratch.read_lines(os.path.join(data, path))
      for split, path in from_scratch.REFERENCES.items()
  }
  rng = np.random.default_rng(1)
  drop = lambda sentence, p: ' '.join(w for w in sentence.split() if rng.random() > p) or 'ein'
  translations = tmp_path / 'translations'
  rows, bleu = [], {}
  cells = [
      ('concat', 256, 0.3),
      ('collaborative', 256, 0.25),
      ('concat', 32, 0.4),
      ('collaborative', 32, 0.2),
      ('concat', 64, 0.35),
      ('collaborative_concat_init', 256, 0.1),
  ]
  for kind, width, p in cells:
    for seed in (0, 1):
      name = f'{kind}-k{width}-s{seed}'
      row = {'name': name, 'kind': kind, 'key_width': width, 'seed': seed, 'steps': 600}
      for split, references in refs.items():
        hyps = [drop(r, p) for r in references]
        (translations / name).mkdir(parents=True, exist_ok=True)
        (translations / name / f'{split}.txt').write_text(''.join(h + '\n' for h in hyps))
        bleu[kind, width, seed, split] = sacrebleu.corpus_bleu(hyps, [references]).score
        row[f'bleu_{split}'] = bleu[kind, width, seed, split]
      rows.append(row)
  (entry,) = from_scratch.narrowing(rows, 256, translations)
  assert (entry['key_width'], entry['steps'], entry['seeds']) == (32, 600, 2)
  for split in refs:
    mean = lambda kind, width: np.mean([bleu[kind, width, s, split] for s in (0, 1)])
    lead = lambda width: mean('collaborative', width) - mean('concat', width)
    assert entry[split]['estimate'] == pytest.approx(lead(32) - lead(256), abs=1e-9)
    assert entry[split]['low'] < entry[split]['estimate'] < entry[split]['high']


def test_a_run_trained_again_replaces_its_kept_translations(tmp_path):
  """A run whose directory holds final translations wrote the entry results.json has, so its
  translations replace kept ones (a --rerun_lost run); a run whose directory is gone keeps
  what was kept, and a run without final translations gets nothing."""
  runs, kept = tmp_path / 'runs', tmp_path / 'translations'
  for name, text in [('rerun', 'old'), ('lost', 'kept')]:
    (kept / name).mkdir(parents=True)
    for split in from_scratch.REFERENCES:
      (kept / name / f'{split}.txt').write_text(f'{text} {split}\n')
  for step, text in [(300, 'middle'), (600, 'new')]:  # the last step's are the final ones
    (runs / 'rerun' / 'final_eval' / str(step)).mkdir(parents=True)
    for split in from_scratch.REFERENCES:
      (runs / 'rerun' / 'final_eval' / str(step) / f'{split}.txt').write_text(f'{text} {split}\n')
  (runs / 'untranslated').mkdir(parents=True)
  results = {
      'runs_dir': str(runs),
      'runs': [{'name': 'rerun'}, {'name': 'lost'}, {'name': 'untranslated'}],
  }
  from_scratch.keep_translations(results, kept)
  for split in from_scratch.REFERENCES:
    assert (kept / 'rerun' / f'{split}.txt').read_text() == f'new {split}\n'
    assert (kept / 'lost' / f'{split}.txt').read_text() == f'kept {split}\n'
  assert not (kept / 'untranslated').exists()


def test_a_glue_run_trained_again_replaces_its_kept_predictions(tmp_path):
  """As for translations: the run directory's last final evaluation wins over kept
  predictions when the directory holds the run the entry records; a run whose directory is
  gone keeps its kept ones, and so does one whose directory holds a run of the same name
  trained since by another experiment (other metrics than the entry's)."""
  import argparse  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top

  from experiments.collaborative import glue_reparam  # pylint: disable=g-import-not-at-top

  runs, out = tmp_path / 'runs', tmp_path / 'out'
  (out / 'predictions').mkdir(parents=True)
  for name in ('rerun', 'lost', 'other'):
    (out / 'predictions' / f'{name}.json').write_text('"kept"')
  line = lambda score: {'split': 'validation', 'step': 10, 'score': score}
  for name, score in [('rerun', float('nan')), ('other', 81.0)]:  # NaN: a diverged eval
    for step, text in [(9, '"middle"'), (10, '"new"')]:  # step 10 is the last (not '9' > '10')
      (runs / name / 'final_eval' / str(step)).mkdir(parents=True)
      (runs / name / 'final_eval' / str(step) / glue_reparam.PREDICTIONS).write_text(text)
    hparams = {'split': 'hparams', 'step': 0}
    lines = [json.dumps(hparams), json.dumps(line(score))]
    (runs / name / 'metrics.jsonl').write_text('\n'.join(lines) + '\n')
  results = {
      'runs_dir': str(runs),
      'runs': [
          {'name': 'rerun', 'metrics': [line(float('nan'))]},
          {'name': 'lost', 'metrics': [line(79.0)]},
          {'name': 'other', 'metrics': [line(80.5)]},  # its directory: a later run's
      ],
  }
  glue_reparam.keep_predictions(results, argparse.Namespace(out=out))
  assert (out / 'predictions' / 'rerun.json').read_text() == '"new"'
  assert (out / 'predictions' / 'lost.json').read_text() == '"kept"'
  assert (out / 'predictions' / 'other.json').read_text() == '"kept"'


def _glue_row(
    predictions_dir, name, task, method, key_dim, stage, seed, predictions, labels, score
):
  """A finished GLUE run as `glue_table` reads it: its results row, its dev predictions kept."""
  import json  # pylint: disable=g-import-not-at-top

  kept = {'predictions': predictions.tolist(), 'labels': labels.tolist()}
  (predictions_dir / f'{name}.json').write_text(json.dumps(kept))
  return {
      'name': name,
      'task': task,
      'method': method,
      'key_dim': key_dim,
      'stage': stage,
      'seed': seed,
      'score': score,
  }


def test_glue_table_averages_tasks_and_bootstraps_against_the_control(tmp_path, monkeypatch):
  """Two tasks, the control (the original fine-tuned again) and one method, two seeds each,
  predictions made by hand: each cell is the mean of the recorded scores, the average is over
  the tasks, the interval's estimate is the difference of those averages computed with plain
  numpy formulas (accuracy; the mean of Pearson and Spearman), and predictions that do not
  score what a run recorded are refused."""

  from experiments import stats  # pylint: disable=g-import-not-at-top
  from experiments.collaborative import glue_reparam  # pylint: disable=g-import-not-at-top

  # 200 resamples, not 2,000: what is checked is which predictions are paired and averaged (the
  # estimate, and that the interval holds it), not the interval's ends (70 s -> a few).
  glue_difference = functools.partial(stats.glue_difference, samples=200)
  monkeypatch.setattr(stats, 'glue_difference', glue_difference)
  rng = np.random.default_rng(0)
  labels = {'rte': rng.integers(0, 2, 60), 'stsb': rng.uniform(0, 5, 80)}

  def ranks(x):
    return np.argsort(np.argsort(x)).astype(float)  # no ties among these floats

  def score(task, p):
    y = labels[task]
    if task in ('rte', 'sst2'):
      return 100 * np.mean(p == y)
    pearson = np.corrcoef(p, y)[0, 1]
    return 100 * (pearson + np.corrcoef(ranks(p), ranks(y))[0, 1]) / 2

  def predict(task, noise):
    y = labels[task]
    if task in ('rte', 'sst2'):
      return np.where(rng.random(len(y)) < noise, 1 - y, y)
    return y + rng.normal(0, 5 * noise, len(y))

  predictions_dir = tmp_path / 'predictions'
  predictions_dir.mkdir()
  rows, scores = [], {}

  def run(task, method, key_dim, stage, seed, noise):
    """A finished run's row, its predictions kept and its score noted in `scores`."""
    name = f'{task}-{method}-{key_dim}-st{stage}-s{seed}'
    p = predict(task, noise)
    scores[name] = score(task, p)
    row = (name, task, method, key_dim, stage, seed, p, labels[task], scores[name])
    return _glue_row(predictions_dir, *row)

  systems = [('original', None, 1, 0.3), ('original', None, 2, 0.3), ('collaborative', 96, 2, 0.2)]
  for method, key_dim, stage, noise in systems:
    for task in labels:
      for seed in ((0,) if stage == 1 else (0, 1)):
        rows.append(run(task, method, key_dim, stage, seed, noise))
  _, summary = glue_reparam.glue_table(rows, predictions_dir, errors={})
  by = {(e['method'], e['key_dim']): e for e in summary}
  mean = lambda method, key_dim, stage, task: np.mean(
      [scores[f'{task}-{method}-{key_dim}-st{stage}-s{s}'] for s in (0, 1)]
  )
  collaborative = by['collaborative', 96]
  for task in labels:
    assert collaborative[task] == pytest.approx(mean('collaborative', 96, 2, task), abs=1e-9)
  expected = np.mean(
      [mean('collaborative', 96, 2, t) - mean('original', None, 2, t) for t in labels]
  )
  assert collaborative['average'] == pytest.approx(
      np.mean([mean('collaborative', 96, 2, t) for t in labels]), abs=1e-9
  )
  assert collaborative['difference']['estimate'] == pytest.approx(expected, abs=1e-6)
  assert collaborative['difference']['low'] < expected < collaborative['difference']['high']
  assert 'difference' not in by['original, fine-tuned again', None]  # the control itself
  for task in labels:  # each task alone
    alone = collaborative['task_differences'][task]
    expected = mean('collaborative', 96, 2, task) - mean('original', None, 2, task)
    assert alone['estimate'] == pytest.approx(expected, abs=1e-6)
    assert alone['low'] < expected < alone['high']
  # A row of a slice without every task: no average, but its tasks' differences.
  slice_rows = [r for r in rows if not (r['method'] == 'collaborative' and r['task'] == 'stsb')]
  _, summary = glue_reparam.glue_table(slice_rows, predictions_dir, errors={})
  partial = {(e['method'], e['key_dim']): e for e in summary}['collaborative', 96]
  assert partial['average'] is None and 'difference' not in partial
  assert set(partial['task_differences']) == {'rte'}
  # A task outside the average (SST-2: one seed, at one width): its columns and differences
  # stay, the averages and their differences leave it out, and the header says so.
  labels['sst2'] = rng.integers(0, 2, 70)
  outside = list(rows)
  for method, key_dim, stage, noise in [*systems, ('per_head_svd', 96, 2, 0.25)]:
    for task in ('rte', 'stsb', 'sst2') if method == 'per_head_svd' else ('sst2',):
      for seed in (0,) if task == 'sst2' else (0, 1):
        outside.append(run(task, method, key_dim, stage, seed, noise))
  table, summary = glue_reparam.glue_table(outside, predictions_dir, errors={})
  by = {(e['method'], e['key_dim']): e for e in summary}
  collaborative, svd = by['collaborative', 96], by['per_head_svd', 96]
  assert collaborative['sst2'] == scores['sst2-collaborative-96-st2-s0']
  assert collaborative['average'] == pytest.approx(
      np.mean([mean('collaborative', 96, 2, t) for t in ('rte', 'stsb')]), abs=1e-9
  )
  expected = np.mean(
      [mean('collaborative', 96, 2, t) - mean('original', None, 2, t) for t in ('rte', 'stsb')]
  )
  assert collaborative['difference']['estimate'] == pytest.approx(expected, abs=1e-6)
  sst2 = scores['sst2-collaborative-96-st2-s0'] - scores['sst2-original-None-st2-s0']
  assert collaborative['task_differences']['sst2']['estimate'] == pytest.approx(sst2, abs=1e-6)
  expected = np.mean(
      [mean('per_head_svd', 96, 2, t) - mean('collaborative', 96, 2, t) for t in ('rte', 'stsb')]
  )
  assert svd['reference_difference']['estimate'] == pytest.approx(expected, abs=1e-6)
  assert set(svd['reference_differences']) == {'rte', 'stsb', 'sst2'}
  assert '| rte | stsb | sst2 | average of rte/stsb | average of rte/stsb - original, fine' in table
  # The floor's SST-2 cell, while the control has not run SST-2 yet: from another row's labels.
  ahead = [r for r in outside if r['name'] != 'sst2-original-None-st2-s0']
  _, summary = glue_reparam.glue_table(ahead, predictions_dir, errors={})
  floor = {(e['method'], e['key_dim']): e for e in summary}[glue_reparam.CONSTANT, None]
  majority = 100 * max(np.mean(labels['sst2']), 1 - np.mean(labels['sst2']))
  assert floor['sst2'] == pytest.approx(majority, abs=1e-9)
  del labels['sst2']
  # Tasks with different seeds (a seed that ran on some tasks only): each cell is the mean over
  # its own task's seeds, and the seeds column says which seeds each task's cells cover.
  uneven = [r for r in rows if r['name'] != 'stsb-collaborative-96-st2-s1']
  table, summary = glue_reparam.glue_table(uneven, predictions_dir, errors={})
  partial = {(e['method'], e['key_dim']): e for e in summary}['collaborative', 96]
  assert partial['stsb'] == pytest.approx(scores['stsb-collaborative-96-st2-s0'], abs=1e-9)
  assert partial['task_seeds'] == {'rte': [0, 1], 'stsb': [0]}
  assert '| rte 0,1; stsb 0 |' in table
  assert '| 0,1 |' in table  # the control's tasks cover the same seeds: one list
  # ... and its STS-B difference pairs it with the control's seed 0 alone.
  alone = partial['task_differences']['stsb']['estimate']
  seed0 = scores['stsb-collaborative-96-st2-s0'] - scores['stsb-original-None-st2-s0']
  assert alone == pytest.approx(seed0, abs=1e-6)
  # The other way round, a seed the control has not finished: the row's runs of that seed
  # stay in its cell but out of its comparison.
  ahead = [r for r in rows if r['name'] != 'stsb-original-None-st2-s1']
  _, summary = glue_reparam.glue_table(ahead, predictions_dir, errors={})
  row = {(e['method'], e['key_dim']): e for e in summary}['collaborative', 96]
  assert row['stsb'] == pytest.approx(mean('collaborative', 96, 2, 'stsb'), abs=1e-9)
  alone = row['task_differences']['stsb']['estimate']
  assert alone == pytest.approx(seed0, abs=1e-6)

  # The conversions' error: the mean over the runs conversions.json records, and a row says
  # when that is only some of them.
  collaborative_names = [r['name'] for r in rows if r['method'] == 'collaborative']
  errors = {
      collaborative_names[0]: {'layer0': 0.2, 'layer1': 0.4},
      collaborative_names[1]: {'layer0': 0.5, 'layer1': 0.7},
  }
  table, summary = glue_reparam.glue_table(rows, predictions_dir, errors=errors)
  collaborative = {(e['method'], e['key_dim']): e for e in summary}['collaborative', 96]
  assert collaborative['mean_error'] == pytest.approx(0.45)
  assert collaborative['error_runs'] == [2, 4]
  assert '| collaborative | 96 | 0.45 (2 of 4 runs) |' in table
  every = {n: {'layer0': 0.3} for n in collaborative_names}
  table, _ = glue_reparam.glue_table(rows, predictions_dir, errors=every)
  assert '| collaborative | 96 | 0.30 |' in table
  # The floor: one answer for every example (RTE: the majority class; STS-B: no correlation).
  floor = {(e['method'], e['key_dim']): e for e in summary}[glue_reparam.CONSTANT, None]
  majority = 100 * max(np.mean(labels['rte']), 1 - np.mean(labels['rte']))
  assert floor['rte'] == pytest.approx(majority, abs=1e-9) and floor['stsb'] == 0
  assert floor['average'] == pytest.approx(majority / 2, abs=1e-9)
  assert f'| {glue_reparam.CONSTANT} |  |  | {majority:.2f} | 0.00 |' in table

  rows[-1]['score'] += 0.5  # a recorded score its kept predictions do not give
  with pytest.raises(ValueError, match=f'{rows[-1]["name"]}: its kept predictions'):
    glue_reparam.glue_table(rows, predictions_dir, errors={})


def test_glue_table_compares_each_method_with_cp_at_its_width(tmp_path):
  """Per-head SVD and rescaled CP against CP at the same width, on the seeds both rows have:
  each task's estimate is the difference of mean accuracies (plain numpy) over those seeds, the
  average is over the small tasks (RTE; SST-2 stays outside it), a width without a CP row gets
  no comparison, and CP itself none."""

  from experiments.collaborative import glue_reparam  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(2)
  labels = {'rte': rng.integers(0, 2, 70), 'sst2': rng.integers(0, 2, 90)}  # accuracy, both
  predictions_dir = tmp_path / 'predictions'
  predictions_dir.mkdir()
  rows, accuracy = [], {}
  systems = [
      ('original', None, 2, (0, 1), 0.2),
      ('collaborative', 96, 2, (0, 1), 0.3),
      ('per_head_svd', 96, 2, (0, 1, 2), 0.45),  # seed 2: no CP run to pair it with
      ('per_head_svd', 48, 2, (0,), 0.4),  # no CP row at 48
  ]
  for method, key_dim, stage, seeds, flip in systems:
    for task, y in labels.items():
      for seed in seeds:
        name = f'{task}-{method}-{key_dim}-s{seed}'
        p = np.where(rng.random(len(y)) < flip, 1 - y, y)
        accuracy[name] = 100 * np.mean(p == y)
        row = (name, task, method, key_dim, stage, seed, p, y, accuracy[name])
        rows.append(_glue_row(predictions_dir, *row))
  table, summary = glue_reparam.glue_table(rows, predictions_dir, errors={})
  by = {(e['method'], e['key_dim']): e for e in summary}
  mean = lambda task, method, seeds: np.mean([accuracy[f'{task}-{method}-96-s{s}'] for s in seeds])
  svd = by['per_head_svd', 96]
  assert svd['rte'] == pytest.approx(mean('rte', 'per_head_svd', (0, 1, 2)), abs=1e-9)
  expected = {t: mean(t, 'per_head_svd', (0, 1)) - mean(t, 'collaborative', (0, 1)) for t in labels}
  for task, value in expected.items():
    got = svd['reference_differences'][task]
    assert got['estimate'] == pytest.approx(value, abs=1e-6)
    assert got['low'] < value < got['high']
  average = svd['reference_difference']
  assert average['estimate'] == pytest.approx(expected['rte'], abs=1e-6)  # SST-2 outside it
  assert 'reference_differences' not in by['collaborative', 96]
  assert 'reference_differences' not in by['per_head_svd', 48]
  assert 'reference_differences' not in by['original, fine-tuned again', None]
  compared = table.split('Each other method minus collaborative')[1]
  line = next(l for l in compared.splitlines() if l.startswith('| per_head_svd | 96 | '))
  assert line.split('|')[-2].strip().startswith(f'{average["estimate"]:+.2f} [')
  assert '| per_head_svd | 48 |' not in compared


def test_glue_report_tables_the_conversions_before_the_fine_tune_apart(tmp_path, monkeypatch):
  """The runs scored before the second fine-tune (stage 0) stay out of the main table and get
  their own, against the first fine-tune (the model they were converted from); the main table
  keeps its control, the original fine-tuned again."""
  import argparse  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top

  from experiments.collaborative import glue_reparam  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(1)
  labels = rng.integers(0, 2, 50)
  out = tmp_path / 'glue'
  (out / 'predictions').mkdir(parents=True)
  rows = []
  for name, method, key_dim, stage, flip in (
      ('rte-original-s0', 'original', None, 1, 0.2),
      ('rte-original-again-s0', 'original', None, 2, 0.25),
      ('rte-collaborative-k96-s0', 'collaborative', 96, 2, 0.3),
      ('rte-collaborative-k96-s0-before', 'collaborative', 96, 0, 0.5),
  ):
    p = np.where(rng.random(50) < flip, 1 - labels, labels)
    kept = {'predictions': p.tolist(), 'labels': labels.tolist()}
    (out / 'predictions' / f'{name}.json').write_text(json.dumps(kept))
    score = 100 * float(np.mean(p == labels))
    rows.append(
        {
            'name': name,
            'task': 'rte',
            'method': method,
            'key_dim': key_dim,
            'stage': stage,
            'seed': 0,
            'score': score,
        }
    )
  monkeypatch.setattr(glue_reparam.runner, 'final', lambda results, split: rows)
  glue_reparam.report({}, {}, argparse.Namespace(out=out, smoke=True))
  main = {(e['method'], e['key_dim']): e for e in json.loads((out / 'table.json').read_text())}
  before = json.loads((out / 'table_before.json').read_text())
  assert set(main) == {
      ('original', None),
      ('original, fine-tuned again', None),
      ('collaborative', 96),
      (glue_reparam.CONSTANT, None),  # the floor
  }
  assert main['collaborative', 96]['rte'] == rows[2]['score']  # the fine-tuned one, not stage 0
  by = {(e['method'], e['key_dim']): e for e in before}
  assert set(by) == {('original', None), ('collaborative', 96), (glue_reparam.CONSTANT, None)}
  assert by['collaborative', 96]['rte'] == rows[3]['score']
  expected = rows[3]['score'] - rows[0]['score']  # against the first fine-tune
  assert by['collaborative', 96]['difference']['estimate'] == pytest.approx(expected, abs=1e-9)
  assert 'Before the second fine-tune' in (out / 'results.md').read_text()


@pytest.mark.parametrize('decompose', ['finetuned', 'pretrained'])
@pytest.mark.parametrize('variant', [[], ['--second_epochs=10', '--second_learning_rate=2e-5']])
def test_glue_reparam_plans_each_protocol_with_the_first_fine_tune_as_its_start_or_control(
    tmp_path, monkeypatch, decompose, variant
):
  """Both protocols plan the same first fine-tune of the pretrained encoder (one command, so a
  finished one serves both): `finetuned` converts it, then fine-tunes each conversion and the
  original again, and scores each conversion as converted; `pretrained` converts the
  pretrained encoder, fine-tunes each conversion once and keeps the first fine-tune as the
  control (no second fine-tune of the original, no before runs: no task head to score).
  Another budget for the fine-tune after the conversion (10 epochs of STS-B's 5,749 examples
  at batch 32: 1,797 steps) gives that fine-tune and its control their own names; the first
  fine-tune a conversion starts from and the before runs stay the shared ones."""
  import json  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top

  from experiments.collaborative import glue_reparam  # pylint: disable=g-import-not-at-top

  planned, sources, needed = [], [], []

  def grid(runs, args, rerun):
    planned.append(list(runs))
    needed.append(set(rerun))
    return {'runs': [{'name': r.name} for r in runs]}

  def converted(source, task, seed, method, key_dim, args, runs_dir):
    sources.append(source)
    directory = tmp_path / 'converted' / f'{method}-k{key_dim}'
    directory.mkdir(parents=True, exist_ok=True)
    conversion = {'overrides': {'model.encoder_attention.key_dim': key_dim}, 'relative_errors': {}}
    (directory / 'conversion.json').write_text(json.dumps(conversion))
    return directory

  monkeypatch.setattr(glue_reparam, 'grid', grid)
  monkeypatch.setattr(glue_reparam, 'converted', converted)
  monkeypatch.setattr(glue_reparam, 'report', lambda *args: None)
  monkeypatch.setattr(glue_reparam, 'OUT', tmp_path / 'out')  # nothing recorded yet
  runs = tmp_path / 'runs'

  def plan(*extra):
    planned.clear()
    sources.clear()
    needed.clear()
    monkeypatch.setattr(
        sys,
        'argv',
        [
            'glue_reparam',
            f'--runs_dir={runs}',
            '--tasks=stsb',
            '--key_dims=96',
            '--methods=collaborative',
            f'--decompose={decompose}',
            *extra,
        ],
    )
    glue_reparam.main()
    return planned[0], {r.name: r for r in planned[-1]}

  first, by_name = plan(*variant)
  _, default = plan()  # the recipe's budget, as a reference
  suffix = '-e10-lr2e-05' if variant else ''
  budget = ['--config.num_train_steps=1797', '--config.learning_rate=2e-05']
  if decompose == 'finetuned' or not variant:
    assert [r.name for r in first] == ['stsb-original-s0']
    assert not any('init_from' in arg for arg in first[0].command)  # from the pretrained encoder
    assert by_name['stsb-original-s0'].command == first[0].command
  if decompose == 'finetuned':
    conversion = f'stsb-collaborative-k96{suffix}-s0'
    control = f'stsb-original-again{suffix}-s0'
    assert sources == [runs.resolve() / 'stsb-original-s0']
    before = 'stsb-collaborative-k96-s0-before'
    assert by_name[before].command == default[before].command  # shared by every budget
    expected = {'stsb-original-s0', control, conversion, before}
    assert f'--config.init_from={runs.resolve() / "stsb-original-s0"}' in by_name[control].command
  else:  # its own names: the protocols share --runs_dir
    conversion = f'stsb-pretrained-collaborative-k96{suffix}-s0'
    control = f'stsb-original{suffix}-s0'
    assert sources == [glue_reparam.PRETRAINED]
    assert not any('init_from' in arg for arg in by_name[control].command)
    expected = {control, conversion}
  assert set(by_name) == expected
  init = f'--config.init_from={tmp_path / "converted" / "collaborative-k96"}'
  assert init in by_name[conversion].command
  for name in (control, conversion):
    assert all((arg in by_name[name].command) == bool(variant) for arg in budget), name

  # The first fine-tune, recorded in results.json with its directory gone (a new machine), runs
  # again while a run still to do starts from it, and not once they all are recorded.
  out = tmp_path / 'out' / ('' if decompose == 'finetuned' else 'pretrained') / suffix[1:]
  assert conversion in json.loads((out / 'conversions.json').read_text())  # for --plot_only
  if decompose == 'pretrained':  # the conversions start from the pretrained encoder
    assert needed[0] == set()
    return
  assert needed[0] == {'stsb-original-s0'}
  for pending in (control, None):
    recorded = [{'name': name} for name in sorted(expected - {pending})]
    (out / 'results.json').write_text(json.dumps({'runs': recorded}))
    plan(*variant)
    assert needed[0] == ({'stsb-original-s0'} if pending else set()), pending


def test_glue_reparam_plot_only_needs_no_run_directory(tmp_path, monkeypatch):
  """--plot_only on a fresh machine: the report from results.json and the conversions'
  errors kept in conversions.json; nothing converted, nothing run."""
  import json  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top

  from experiments.collaborative import glue_reparam  # pylint: disable=g-import-not-at-top

  out = tmp_path / 'out'
  out.mkdir()
  recorded = {'runs': [], 'runs_dir': str(tmp_path / 'gone')}
  (out / 'results.json').write_text(json.dumps(recorded))
  errors = {'rte-collaborative-k96-s0': {'layer0': 0.25}}
  (out / 'conversions.json').write_text(json.dumps(errors))
  reported = []

  def refuse(*args):
    raise AssertionError('--plot_only converted or ran something')

  monkeypatch.setattr(glue_reparam, 'OUT', out)
  monkeypatch.setattr(glue_reparam, 'converted', refuse)
  monkeypatch.setattr(glue_reparam.runner, 'run_grid', refuse)
  monkeypatch.setattr(glue_reparam, 'report', lambda results, e, args: reported.append(e))
  argv = ['glue_reparam', f'--runs_dir={tmp_path / "gone"}', '--tasks=rte', '--plot_only']
  monkeypatch.setattr(sys, 'argv', argv)
  glue_reparam.main()
  assert reported == [errors]


def test_glue_width_plot_draws_each_difference_at_its_key_reduction(tmp_path):
  """The plot's series: our rows at D / D~k = 384 / D~k with the table's estimates and
  intervals, the control and the floor left out; the paper's at 768 / D~k, its rows minus
  its unconverted BERT-base, typed here from Table 3 (RTE 63.2 unconverted, 65.3 at 384, 60.7
  at 128; STS-B Pearson/Spearman 88.8/88.7 unconverted, 88.3/88.0 at 384, 89.2/88.9 at 768; RTE 65.3 at 768).
  """
  from experiments.collaborative import glue_reparam  # pylint: disable=g-import-not-at-top

  interval = lambda e: {'estimate': e, 'low': e - 1, 'high': e + 2, 'level': 0.95}
  summary = [
      {'method': 'original, fine-tuned again', 'key_dim': None},
      {'method': 'original', 'key_dim': None, 'difference': interval(-1.0)},  # not a width
      {
          'method': 'collaborative',
          'key_dim': 48,
          'difference': interval(-9.0),
          'task_differences': {'rte': interval(-7.0), 'stsb': interval(-11.0)},
      },
      {
          'method': 'collaborative',
          'key_dim': 96,
          'difference': interval(-3.0),
          'task_differences': {'rte': interval(-2.0), 'stsb': interval(-4.0)},
      },
      {'method': glue_reparam.CONSTANT, 'key_dim': None},
  ]
  panels = glue_reparam.plot_widths(summary, ['rte', 'stsb'], tmp_path / 'w.png', 'test')
  assert (tmp_path / 'w.png').stat().st_size > 0
  assert list(panels) == ['average', 'rte', 'stsb']
  ours = panels['average']['collaborative']
  assert ours == {'x': [4.0, 8.0], 'y': [-3.0, -9.0], 'low': [-4.0, -10.0], 'high': [-1.0, -7.0]}
  assert panels['stsb']['collaborative']['y'] == [-4.0, -11.0]
  assert set(panels['rte']) == {'collaborative', 'BERT-base (paper, Table 3)'}
  paper = {
      p: dict(zip(l['BERT-base (paper, Table 3)']['x'], l['BERT-base (paper, Table 3)']['y']))
      for p, l in panels.items()
  }
  assert paper['rte'][6.0] == pytest.approx(60.7 - 63.2)
  assert paper['stsb'][2.0] == pytest.approx((88.3 + 88.0) / 2 - (88.8 + 88.7) / 2)
  assert paper['average'][2.0] == pytest.approx(
      ((65.3 - 63.2) + ((88.3 + 88.0) / 2 - (88.8 + 88.7) / 2)) / 2
  )
  assert paper['average'][1.0] == pytest.approx(  # D~k = 768: the paper's exact conversion
      np.mean([65.3 - 63.2, (89.2 + 88.9) / 2 - 88.75])
  )


def test_a_task_outside_the_average_is_left_out_of_the_papers_average_too(tmp_path):
  """With SST-2 outside the average, the paper's BERT-base average (table and plot) is over
  RTE alone, as ours is: 63.2 unconverted, 60.7 at 128 (Table 3, typed here; SST-2 91.7
  unconverted), and the SST-2 columns stay."""
  from experiments.collaborative import glue_reparam  # pylint: disable=g-import-not-at-top

  table = glue_reparam.paper_table(['rte', 'sst2'], ['rte'])
  header, _, base = table.splitlines()[:3]
  assert [c.strip() for c in header.split('|')[1:-1]] == ['D~k', 'rte', 'sst2', 'average of rte']
  assert [c.strip() for c in base.split('|')[1:-1]] == ['BERT-base', '63.20', '91.70', '63.20']
  panels = glue_reparam.width_series([], ['rte', 'sst2'], ['rte'])
  paper = panels['average']['BERT-base (paper, Table 3)']
  assert dict(zip(paper['x'], paper['y']))[6.0] == pytest.approx(60.7 - 63.2)
