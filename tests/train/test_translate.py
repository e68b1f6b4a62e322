"""The end of training's evaluation, `python -m lowrank_attn.translate`, and the learning curve.

One tiny translation run (configs/nmt.py:tiny, 60 steps on one of the tests' CPU devices, beam
2, translations cut at 24 tokens, two extra test files) is trained once for the module; the
tests read what it wrote.
"""

import gzip
import json
import math
import os
import re
import subprocess
import sys
import types

import jax
import pytest
import sacrebleu

from lowrank_attn import translate
from lowrank_attn.train import checkpoints, metrics, train

from experiments.multi30k import plot_curve

STEPS, EVAL_EVERY, BEAM = 60, 20, 2
# The run is not about meshes (tests/train/test_state.py is): one device, a third faster than 8.
ONE_DEVICE = jax.devices()[:1]


def raw_lines(path):
  opener = gzip.open if path.endswith('.gz') else open
  with opener(path, 'rt', encoding='utf-8') as f:
    return f.read().removesuffix('\n').split('\n')


def multi30k_file(name):
  return os.path.join(os.environ['LOWRANK_ATTN_DATA'], 'multi30k', name)


def write_lines(path, lines):
  with open(path, 'w', encoding='utf-8') as f:
    f.writelines(line + '\n' for line in lines)
  return str(path)


def read_jsonl(workdir):
  with open(os.path.join(workdir, metrics.METRICS_FILE)) as f:
    return [json.loads(line) for line in f]


@pytest.fixture(scope='module')
def run(helpers, tfds_dir, tmp_path_factory):
  files = tmp_path_factory.mktemp('extra')
  english = raw_lines(multi30k_file('test_2016_flickr.en.gz'))
  german = raw_lines(multi30k_file('test_2016_flickr.de.gz'))
  # 'mini': 40 test sentences; 'odd': an empty source line and one far over data.max_length.
  extra = {
      'mini': (english[:40], german[:40]),
      'odd': (
          [english[50], '', ' '.join(english[51:56]), english[56]],
          [german[50], german[51], ' '.join(german[51:56]), german[56]],
      ),
  }
  paths = {
      name: (write_lines(files / f'{name}.en', en), write_lines(files / f'{name}.de', de))
      for name, (en, de) in extra.items()
  }
  workdir = str(tmp_path_factory.mktemp('nmt_run'))
  config = helpers.load_config('nmt', 'tiny')
  helpers.override(
      config,
      {
          'data.tfds_data_dir': tfds_dir,
          'num_train_steps': STEPS,
          'eval_every_steps': EVAL_EVERY,
          'decode.beam_size': BEAM,
          # (40 in the config: a model 60 steps old often repeats itself to the limit, and the
          # final evaluation's 2,014 sentences took 40% longer)
          'decode.max_length': 24,
          'decode.num_examples': 16,
          'data.extra_test_files': ','.join(f'{en}:{de}' for en, de in paths.values()),
      },
  )
  scored = []  # the strings each BLEU of the periodic evaluations was computed on
  corpus_bleu = sacrebleu.corpus_bleu

  def recording_corpus_bleu(hypotheses, references, **kwargs):
    scored.append((list(hypotheses), [list(r) for r in references]))
    return corpus_bleu(hypotheses, references, **kwargs)

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(sacrebleu, 'corpus_bleu', recording_corpus_bleu)
    result = train.train_and_evaluate(config, workdir, devices=ONE_DEVICE)
  return types.SimpleNamespace(
      workdir=workdir,
      config=config,
      result=result,
      paths=paths,
      references={name: de for name, (_, de) in extra.items()},
      scored=scored,
  )


def test_the_model_learns_and_the_periodic_bleu_scores_its_translations(run, helpers):
  helpers.assert_learned(run.config, run.result, run.workdir)
  final = run.result['eval']
  # One BLEU per periodic evaluation, of decode.num_examples translations against German
  # sentences of the validation split in their order, read here from the raw file (cut where
  # the targets were truncated to data.max_length tokens)...
  assert len(run.scored) == STEPS // EVAL_EVERY
  german = raw_lines(multi30k_file('val.de.gz'))
  hypotheses, (references,) = run.scored[-1]
  assert len(hypotheses) == len(references) == 16
  rows, start = [], 0
  for r in references:
    rows.append(next(j for j in range(start, len(german)) if r and german[j].startswith(r)))
    start = rows[-1] + 1
  # ... each translation that of its own sentence: the final evaluation (the same parameters)
  # translated those sentences much as the periodic one did.
  final_texts = raw_lines(
      os.path.join(run.workdir, train.FINAL_EVAL_DIR, str(STEPS), 'validation.txt')
  )
  own = [final_texts[j] for j in rows]
  chrf = lambda refs: sacrebleu.metrics.CHRF().corpus_score(hypotheses, [refs]).score
  # A permutation test, no margin to tune: the sentences in their own order score above every
  # other rotation of them (by chance 1 in 16 were the two evaluations unrelated).
  rotations = [own[k:] + own[:k] for k in range(1, len(own))]
  assert chrf(own) > max(map(chrf, rotations)), (chrf(own), hypotheses, own)
  # The reported score is corpus BLEU of those strings, recomputed here.
  bleu = sacrebleu.metrics.BLEU().corpus_score(hypotheses, [references]).score
  assert final['bleu'] == pytest.approx(bleu, abs=1e-9)


def test_final_evaluation_reports_every_split_under_its_name(run):
  final = run.result['final']
  assert list(final) == ['validation', 'test', 'mini', 'odd']
  references = {
      'validation': raw_lines(multi30k_file('val.de.gz')),
      'test': raw_lines(multi30k_file('test_2016_flickr.de.gz')),
      **run.references,
  }
  lines = [l for l in read_jsonl(run.workdir) if l['step'] == STEPS]
  for name, expected in references.items():
    reported = final[name]
    (line,) = [l for l in lines if l['split'] == name]
    for key in ('loss', 'perplexity', 'accuracy', 'bleu', 'chrf', 'sentences'):
      assert line[key] == pytest.approx(reported[key], abs=1e-12), (name, key)
    assert reported['sentences'] == len(expected)
    assert reported['beam_size'] == BEAM
    assert reported['bleu_signature'].startswith('nrefs:1|case:mixed|eff:no|tok:13a|')
    assert reported['chrf_signature'].startswith('nrefs:1|case:mixed|')
    # The scores are sacreBLEU's on the translations the run wrote, against the raw reference
    # text (read here from the files, not through the tokenizer).
    written = raw_lines(os.path.join(run.workdir, train.FINAL_EVAL_DIR, str(STEPS), f'{name}.txt'))
    assert len(written) == len(expected)
    bleu = sacrebleu.metrics.BLEU().corpus_score(written, [expected]).score
    chrf = sacrebleu.metrics.CHRF().corpus_score(written, [expected]).score
    assert reported['bleu'] == pytest.approx(bleu, abs=1e-9), name
    assert reported['chrf'] == pytest.approx(chrf, abs=1e-9), name
    assert reported['bleu'] > 0 and reported['chrf'] > 5  # it translates, a little
    if len(expected) > 100:  # each translation is its own sentence's, in input order
      # A sign test over sentences, no margin to tune: against its own reference each
      # translation scores above the next sentence's reference far more often than chance
      # (z > 3.1: p < 0.001 were the pairing arbitrary, as when translations land on the wrong
      # rows of their batch).
      metric = sacrebleu.metrics.CHRF()
      sentence = lambda h, r: metric.sentence_score(h, [r]).score
      own = [sentence(h, r) for h, r in zip(written, expected)]
      other = [sentence(h, r) for h, r in zip(written, expected[1:] + expected[:1])]
      wins = sum(a > b for a, b in zip(own, other))
      trials = sum(a != b for a, b in zip(own, other))
      assert (wins - trials / 2) / math.sqrt(trials / 4) > 3.1, (name, wins, trials)
  odd = raw_lines(os.path.join(run.workdir, train.FINAL_EVAL_DIR, str(STEPS), 'odd.txt'))
  assert odd[1] == '' and all(odd[i] for i in (0, 2, 3))
  assert final['odd']['truncated_sources'] == 1
  # Evaluations during training are unchanged: eval_split, decode.num_examples sentences.
  evals = [l for l in read_jsonl(run.workdir) if l['split'] == 'eval']
  assert [l['step'] for l in evals] == [20, 40, 60]
  assert all(l['decoded_examples'] == 16 for l in evals)


def test_rerunning_the_finished_run_returns_its_final_evaluation(run):
  again = train.train_and_evaluate(run.config, run.workdir, devices=ONE_DEVICE)
  assert again['step'] == STEPS and again['final'] == run.result['final']
  # Read back, not evaluated again: one line per split at the last step.
  names = [l['split'] for l in read_jsonl(run.workdir) if l['step'] == STEPS]
  assert sorted(n for n in names if n in again['final']) == sorted(again['final'])


def cli(*args, timeout=600):
  return subprocess.run(
      [sys.executable, '-m', 'lowrank_attn.translate', *args],
      capture_output=True,
      text=True,
      timeout=timeout,
      cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
  )


def test_translate_reproduces_the_bleu_training_reported(run, tmp_path):
  out = tmp_path / 'test.de'
  done = cli(
      f'--workdir={run.workdir}',
      f'--input={multi30k_file("test_2016_flickr.en.gz")}',
      f'--reference={multi30k_file("test_2016_flickr.de.gz")}',
      f'--output={out}',
      f'--beam_size={BEAM}',
      '--compilation_cache=',
  )
  assert done.returncode == 0, done.stderr[-3000:]
  reported = run.result['final']['test']
  bleu = float(re.search(r'^BLEU (\S+)', done.stderr, re.M).group(1))
  chrf = float(re.search(r'^chrF2 (\S+)', done.stderr, re.M).group(1))
  assert bleu == pytest.approx(reported['bleu'], abs=1e-6)
  assert chrf == pytest.approx(reported['chrf'], abs=1e-6)
  assert reported['bleu_signature'] in done.stderr
  # Not only the score: the very same translations, in input order.
  written = os.path.join(run.workdir, train.FINAL_EVAL_DIR, str(STEPS), 'test.txt')
  assert out.read_text(encoding='utf-8') == open(written, encoding='utf-8').read()
  assert re.search(r'sentences/s; jitted search .* outside it', done.stderr)


def test_empty_line_gives_empty_line_and_overlong_line_is_cut_with_a_warning(run, tmp_path, capsys):
  english = raw_lines(multi30k_file('test_2016_flickr.en.gz'))
  long_line = ' '.join(english[:8])  # far over data.max_length (32 tokens)
  source = write_lines(tmp_path / 'in.en', [english[100], '', long_line, english[101]])
  out = tmp_path / 'out.de'
  result = translate.translate_file(
      run.workdir, input_path=source, output_path=str(out), compilation_cache=''
  )
  translations = out.read_text(encoding='utf-8').split('\n')
  assert len(translations) == 5 and translations[-1] == ''  # four lines, each ended by \n
  assert translations[1] == '' and all(translations[i] for i in (0, 2, 3))
  assert result['truncated'] == [2]
  err = capsys.readouterr().err
  assert re.search(r'warning: line 3 is longer than the 32 tokens', err), err
  assert not re.search(r'line [124] is longer', err)
  assert result['step'] == STEPS and result['beam_size'] == BEAM  # the run's defaults


@pytest.mark.parametrize('case', ['missing workdir', 'no checkpoints', 'unknown step'])
def test_a_bad_run_directory_is_one_line_and_exit_status_2(run, tmp_path, case):
  if case == 'missing workdir':
    args, says = [f'--workdir={tmp_path / "nowhere"}'], 'no such directory'
  elif case == 'no checkpoints':
    empty = tmp_path / 'fresh'
    empty.mkdir()
    (empty / checkpoints.CONFIG_FILE).write_text(
        open(os.path.join(run.workdir, checkpoints.CONFIG_FILE)).read()
    )
    args, says = [f'--workdir={empty}'], 'has no checkpoint in'
  else:
    args, says = [f'--workdir={run.workdir}', '--step=7'], 'has no checkpoint of that step; it has'
  done = cli(*args, '--input=/dev/null', timeout=120)
  assert done.returncode == 2, done.stderr
  assert done.stderr.startswith('translate: ') and says in done.stderr, done.stderr
  assert done.stderr.count('\n') == 1 and 'Traceback' not in done.stderr


def test_translate_checks_a_run_without_importing_jax():
  # A wrong --workdir must fail at once: the checks read the directory, not JAX or Orbax.
  code = (
      'import sys\nfrom lowrank_attn import translate\n'
      'try:\n  translate.check_run("/nonexistent", None)\n'
      'except translate.UsageError as e:\n  print(e)\n'
      'print("jax" in sys.modules, "orbax" in sys.modules)'
  )
  done = subprocess.run(
      [sys.executable, '-c', code], capture_output=True, text=True, timeout=120, check=True
  )
  said, loaded = done.stdout.splitlines()
  assert said == '--workdir=/nonexistent: no such directory.'
  assert loaded == 'False False'


def test_a_missing_extra_test_file_fails_before_training(run, helpers, tfds_dir, tmp_path):
  config = helpers.load_config('nmt', 'tiny')
  (tokenizer,) = os.listdir(os.path.join(run.workdir, 'tokenizers'))
  helpers.override(
      config,
      {
          'data.tfds_data_dir': tfds_dir,
          'data.tokenizer_path': os.path.join(run.workdir, 'tokenizers', tokenizer),
          'data.extra_test_files': f'{run.paths["mini"][0]}:{run.paths["mini"][1]},'
          f'{tmp_path}/gone.en:{tmp_path}/gone.de',
      },
  )
  with pytest.raises(FileNotFoundError, match='gone.en'):
    train.train_and_evaluate(config, str(tmp_path / 'run'))
  assert not os.path.exists(tmp_path / 'run' / checkpoints.CHECKPOINT_DIR)


def test_plot_curve_on_the_run(run, tmp_path, capsys):
  out = tmp_path / 'curve.png'
  rows = plot_curve.main([f'--workdir={run.workdir}', f'--out={out}'])
  assert [r['step'] for r in rows] == [20, 40, 60]
  minutes = [r['minutes'] for r in rows]
  assert 0 < minutes[0] < minutes[1] < minutes[2]
  train_secs = {
      l['step']: l['train_secs'] for l in read_jsonl(run.workdir) if l['split'] == 'train'
  }
  assert minutes == pytest.approx([train_secs[s] / 60 for s in (20, 40, 60)])
  evals = {l['step']: l for l in read_jsonl(run.workdir) if l['split'] == 'eval'}
  assert [r['loss'] for r in rows] == [evals[s]['loss'] for s in (20, 40, 60)]
  assert [r['bleu'] for r in rows] == [evals[s]['bleu'] for s in (20, 40, 60)]
  assert out.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  table = capsys.readouterr().out
  assert '| step | minutes | eval loss | BLEU |' in table
  assert f'| 60 | {minutes[2]:.1f} | {evals[60]["loss"]:.3f} | {evals[60]["bleu"]:.2f} |' in table
  assert f'BLEU {run.result["final"]["test"]["bleu"]:.2f}' in table


def test_plot_curve_adds_the_time_before_a_resume():
  lines = [
      {'split': 'train', 'step': s, 'train_secs': t}
      for s, t in [(1, 1.0), (10, 10.0), (20, 20.0), (30, 30.0)]
  ]
  # Killed after step 30, resumed from the checkpoint of step 20: a new clock from step 21.
  lines += [{'split': 'train', 'step': s, 'train_secs': t} for s, t in [(21, 2.0), (30, 11.0)]]
  lines += [{'split': 'eval', 'step': 30, 'loss': 1.0, 'bleu': 2.0}]
  seconds = plot_curve.training_seconds(lines)
  assert seconds == {1: 1.0, 10: 10.0, 20: 20.0, 21: 21.0, 30: 30.0}
  assert plot_curve.curve(lines) == [{'step': 30, 'minutes': 0.5, 'loss': 1.0, 'bleu': 2.0}]


@pytest.mark.parametrize(
    'mesh', [{'data': 2, 'fsdp': 2, 'tensor': 2}, {'data': 1, 'fsdp': 1, 'tensor': 8}]
)
def test_translations_do_not_depend_on_the_mesh(run, mesh):
  """The parameters restored onto another mesh (sharded by fsdp and tensor) translate the 40
  'mini' sentences as the end of training did on 8-way data parallelism."""
  config = translate.run_config(run.workdir)
  config.mesh.update(mesh)
  opened = translate.open_run(run.workdir, config)
  params = opened.run.restore_params(STEPS, opened.abstract_params)
  translator = opened.translator(params, beam_size=BEAM)
  texts = translator.translate(raw_lines(run.paths['mini'][0])).texts
  written = raw_lines(os.path.join(run.workdir, train.FINAL_EVAL_DIR, str(STEPS), 'mini.txt'))
  assert texts == written


def test_a_mesh_that_does_not_fit_falls_back_to_data_parallel(run, tmp_path, capsys):
  import shutil

  workdir = tmp_path / 'run'
  shutil.copytree(run.workdir, workdir)
  config = json.loads((workdir / checkpoints.CONFIG_FILE).read_text())
  config['mesh'] = {'data': 1, 'fsdp': 1, 'tensor': 16}  # the tests have 8 devices
  (workdir / checkpoints.CONFIG_FILE).write_text(json.dumps(config))
  out = tmp_path / 'mini.de'
  translate.translate_file(
      str(workdir), input_path=run.paths['mini'][0], output_path=str(out), compilation_cache=''
  )
  assert 'does not fit here' in capsys.readouterr().err
  written = os.path.join(run.workdir, train.FINAL_EVAL_DIR, str(STEPS), 'mini.txt')
  assert out.read_text(encoding='utf-8') == open(written, encoding='utf-8').read()
