"""The GLUE task: files, encoding, metrics and loss against independent references, the
pretrained MiniLM's zero-shot STS-B score, and a fine-tune through the training loop."""

import contextlib
import csv
import json
import os
import pathlib

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
import tokenizers as hf_tokenizers

from experiments.glue import zero_shot
from lowrank_attn import data, tasks
from lowrank_attn.data.builders import glue as glue_data
from lowrank_attn.models import bert
from lowrank_attn.tasks import base, glue
from lowrank_attn.train import config as config_lib, state as state_lib, train

DATA_DIR = pathlib.Path(os.environ[data.DATA_DIR_ENV])
ONE_DEVICE = jax.devices()[:1]  # runs through the loop that are not about meshes
# Example counts of ../shared/data/README.md (MRPC's train.tsv: 3,668 lines with its header).
COUNTS = {
    'cola': (8551, 1043),
    'sst2': (67349, 872),
    'mrpc': (3667, 408),
    'rte': (2490, 277),
    'stsb': (5749, 1500),
}


@pytest.fixture(scope='module')
def tfds_dir(tmp_path_factory):
  return tmp_path_factory.mktemp('tfds')


@pytest.fixture(scope='module')
def minilm_dir():
  return state_lib.pretrained_dir('all-MiniLM-L6-v2')


@pytest.mark.parametrize('task', sorted(COUNTS))
def test_every_example_of_the_files_is_read(task, tfds_dir):
  spec = glue_data.TASKS[task]
  for split, expected in zip(('train', 'validation'), COUNTS[task]):
    source = data.load_data_source(f'glue/{task}', split, tfds_data_dir=tfds_dir)
    assert len(source) == expected
    # The last line of the raw file, split by hand, is the last example.
    name = 'train' if split == 'train' else 'dev'
    lines = (
        (DATA_DIR / 'glue' / spec.folder / f'{name}.tsv')
        .read_text(encoding='utf-8')
        .rstrip('\n')
        .split('\n')
    )
    columns = lines[-1].split('\t')
    last = source[len(source) - 1]
    assert last['sentence1'].decode() == columns[spec.sentence_columns[0]]
    if len(spec.sentence_columns) == 2:
      assert last['sentence2'].decode() == columns[spec.sentence_columns[1]]
    label = columns[spec.label_column]
    want = {'entailment': 0.0, 'not_entailment': 1.0}.get(label) if task == 'rte' else float(label)
    assert last['label'] == pytest.approx(want)


def test_a_malformed_line_is_named():
  with pytest.raises(ValueError, match=r'x.tsv: line 2 has 1 tab-separated columns'):
    glue_data.parse_tsv('index\tsentence1\tsentence2\tlabel\nbroken line\n', 'rte', where='x.tsv')
  with pytest.raises(ValueError, match=r"label 'maybe' is not one of"):
    glue_data.parse_tsv('h\th\th\th\n0\ta\tb\tmaybe\n', 'rte', where='x.tsv')


def test_pairs_encode_as_the_reference_bert_tokenizer_does(minilm_dir):
  """[CLS] a [SEP] b [SEP], token types 0 then 1, longest-first cut: HF `tokenizers`' own
  BERT post-processor and truncation are the reference."""
  vocab = str(minilm_dir / 'vocab.txt')
  ours = data.WordPieceTokenizer(vocab)
  reference = hf_tokenizers.BertWordPieceTokenizer(vocab, lowercase=True)
  a = 'A man with a hard hat is dancing in the street tonight.'
  b = 'A man wearing a hard hat is dancing.'
  for max_length in (64, 20, 12):
    reference.enable_truncation(max_length, strategy='longest_first')
    want = reference.encode(a, b)
    example = {'sentence1': a.encode(), 'sentence2': b.encode(), 'label': 3.5}
    got = glue.EncodeGlue(ours, ('sentence1', 'sentence2'), max_length, regression=True)(example)
    assert got['inputs'].tolist() == want.ids
    assert got['token_types'].tolist() == want.type_ids
    assert got['targets'].dtype == np.float32 and got['targets'] == 3.5


def _matthews(y, p):
  tp, tn = np.sum((y == 1) & (p == 1)), np.sum((y == 0) & (p == 0))
  fp, fn = np.sum((y == 0) & (p == 1)), np.sum((y == 1) & (p == 0))
  return (tp * tn - fp * fn) / np.sqrt(float((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn)))


def test_metrics_agree_with_their_textbook_formulas():
  rng = np.random.default_rng(0)
  labels = rng.integers(0, 2, 300)
  predictions = np.where(rng.random(300) < 0.8, labels, 1 - labels)
  cola = glue.glue_metrics('cola', predictions, labels)
  assert cola['matthews'] == pytest.approx(100 * _matthews(labels, predictions), rel=1e-9)
  mrpc = glue.glue_metrics('mrpc', predictions, labels)
  tp = np.sum((labels == 1) & (predictions == 1))
  precision, recall = tp / np.sum(predictions == 1), tp / np.sum(labels == 1)
  assert mrpc['f1'] == pytest.approx(100 * 2 * precision * recall / (precision + recall))
  assert mrpc['accuracy'] == pytest.approx(100 * np.mean(labels == predictions))
  assert mrpc['score'] == pytest.approx((mrpc['f1'] + mrpc['accuracy']) / 2)
  scores = np.round(rng.uniform(0, 5, 200), 1)  # ties, as in STS-B's labels
  predicted = scores + rng.normal(0, 1, 200)
  stsb = glue.glue_metrics('stsb', predicted, scores)
  assert stsb['pearson'] == pytest.approx(100 * scipy.stats.pearsonr(predicted, scores)[0])
  assert stsb['spearman'] == pytest.approx(100 * scipy.stats.spearmanr(predicted, scores)[0])
  assert glue.glue_metrics('cola', np.zeros(10), labels[:10])['matthews'] == 0.0


def test_the_constant_prediction_scores_the_best_single_answer():
  """By hand: labels 1,1,1,0. All 1: accuracy 75, F1 2*3/(4+3) = 85.71 (MRPC: their mean);
  all 0: accuracy 25, F1 0. Matthews' correlation and STS-B's correlations of a constant: 0."""
  labels = np.array([1, 1, 1, 0])
  assert glue.constant_score('mrpc', labels) == pytest.approx((75 + 600 / 7) / 2)
  assert glue.constant_score('sst2', labels) == pytest.approx(75)
  assert glue.constant_score('rte', 1 - labels) == pytest.approx(75)  # the other class
  assert glue.constant_score('cola', labels) == 0
  assert glue.constant_score('stsb', np.array([0.5, 4.0, 2.5, 3.0])) == 0


def test_losses_are_cross_entropy_and_squared_error_per_example():
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(4, 2)).astype(np.float32)
  labels = np.array([0, 1, 1, 0], np.int32)
  weights = np.array([1, 1, 1, 0], np.float32)  # the last row is padding
  sums = tasks.get('glue').loss(jnp.asarray(logits), {'targets': labels, 'weights': weights}, 0.0)
  log_p = logits - np.log(np.sum(np.exp(logits), -1, keepdims=True))
  assert float(sums['nll']) == pytest.approx(-sum(log_p[i, labels[i]] for i in range(3)), rel=1e-5)
  assert float(sums['weight']) == 3
  scores = np.array([0.5, 4.0, 2.0, 9.0], np.float32)
  predicted = np.array([1.0, 3.0, 2.5, 0.0], np.float32)
  sums = tasks.get('glue').loss(jnp.asarray(predicted), {'targets': scores, 'weights': weights}, 0)
  assert float(sums['nll']) == pytest.approx(0.25 + 1.0 + 0.25)
  assert 'correct' not in sums


def test_the_classifier_holds_the_encoder_of_bert_without_the_mlm_head(minilm_dir):
  config = config_lib.load('configs/glue.py:rte')
  model_cfg = config_lib.model_config(config, vocab_size=30522)
  model = nnx.eval_shape(
      lambda: tasks.get('glue').create_model(config, model_cfg, 101, nnx.Rngs(0))
  )
  paths = {'/'.join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  mlm = nnx.eval_shape(lambda: bert.load_pretrained(minilm_dir))
  mlm_paths = {'/'.join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(mlm, nnx.Param))}
  assert paths - mlm_paths == {'classifier/kernel', 'classifier/bias'}
  assert mlm_paths - paths == {
      'head_dense/kernel',
      'head_dense/bias',
      'head_norm/scale',
      'head_norm/bias',
      'output_bias',
  }


@pytest.mark.slow  # ~2 minutes on 2 cores (make test-all): 1,500 pairs through MiniLM
def test_minilm_zero_shot_stsb_matches_its_published_score(tfds_dir):
  """all-MiniLM-L6-v2's mean-pooled cosine similarity on STS-B dev has a Spearman of about
  86.7 (its model card's STS-B figure; ../shared/data/README.md). Read through our builder,
  tokenizer and BERT port; a wrong pooling, vocabulary or weight gives points less."""
  result = zero_shot.stsb_zero_shot(tfds_dir)
  assert result['examples'] == COUNTS['stsb'][1]
  assert result['spearman'] == pytest.approx(86.7, abs=0.5)


@pytest.mark.integration
def test_fine_tuning_runs_through_the_loop_and_reports_the_glue_metrics(tmp_path):
  config = config_lib.load('configs/glue.py:tiny')
  config.num_train_steps = 6
  config.checkpoint_every_steps = 3
  config.num_eval_steps = 2
  result = train.train_and_evaluate(config, str(tmp_path), devices=ONE_DEVICE)
  final = result['final']['validation']
  assert final['examples'] == COUNTS['rte'][1]  # every dev example, once
  assert 0 <= final['accuracy'] <= 100 and final['score'] == final['accuracy']
  assert set(result['eval']) >= {'loss', 'accuracy', 'score'}
  # Every dev example's prediction, in the file's order (its labels: RTE's dev.tsv), and the
  # final accuracy is theirs.
  written = json.loads((tmp_path / 'final_eval' / '6' / 'validation_predictions.json').read_text())
  with open(DATA_DIR / 'glue' / 'RTE' / 'dev.tsv', encoding='utf-8') as f:
    rows = list(csv.reader(f, delimiter='\t', quoting=csv.QUOTE_NONE))[1:]
  assert written['labels'] == [float(row[-1] == 'not_entailment') for row in rows]
  accuracy = 100 * np.mean(np.equal(written['predictions'], written['labels']))
  assert final['accuracy'] == pytest.approx(accuracy, rel=1e-12)


def test_a_non_glue_data_set_is_refused():
  config = config_lib.load('configs/glue.py:tiny')
  config.data.name = 'multi30k'
  with pytest.raises(ValueError, match=r"data.name='multi30k' is not a GLUE task"):
    config_lib.validate(config)


@pytest.mark.parametrize(
    'name,max_length,refused',
    [
        ('glue/rte', 4, True),
        ('glue/rte', 5, False),
        ('glue/cola', 2, True),
        ('glue/cola', 3, False),
    ],
)
def test_rows_too_short_for_the_sentences_are_refused(name, max_length, refused):
  """[CLS], and a token and [SEP] per sentence (a shorter row once cut forever)."""
  config = config_lib.load('configs/glue.py:tiny')
  config.data.name, config.data.max_length = name, max_length
  if refused:
    with pytest.raises(ValueError, match=rf'max_length={max_length} is too short'):
      config_lib.validate(config)
  else:
    config_lib.validate(config)
    encode = glue.EncodeGlue(
        FakeWordPiece(), ('sentence1', 'sentence2')[: max_length // 2], max_length, False
    )
    row = encode({'sentence1': b'a b c', 'sentence2': b'd e f', 'label': 1})
    assert len(row['inputs']) == max_length


def test_extra_test_files_are_refused():
  """Text files carry no labels to score (before: a run trained, then failed at the end)."""
  config = config_lib.load('configs/glue.py:tiny')
  config.data.extra_test_files = 'a.txt:b.txt'
  with pytest.raises(ValueError, match=r"extra_test_files='a.txt:b.txt'"):
    config_lib.validate(config)


class FakeWordPiece:
  """One id per character: enough to count what EncodeGlue keeps."""

  bos_id, eos_id = 101, 102

  def encode(self, text):
    return [1000 + ord(c) for c in text.replace(' ', '')]


class FakeSetup:
  """A run's setup whose global batch puts the rows in another order than the process gave
  them, as a mesh whose devices are not in process order does with several processes."""

  config = config_lib.load('configs/glue.py:tiny')
  graphdef = None

  def activate(self):
    return contextlib.nullcontext()

  def global_batch(self, local_batch):
    return {name: jnp.asarray(rows[::-1]) for name, rows in local_batch.items()}


class Batches:

  def __init__(self, batches):
    self.batches = batches

  def reset(self):
    pass

  def __iter__(self):
    return iter(self.batches)


def test_predictions_are_paired_with_their_own_labels():
  """A model that predicts each row's label scores 100, and the predictions file pairs each
  prediction with its label, whatever order the global batch puts the rows in."""
  context = base.EvalContext(setup=FakeSetup(), eval_step=None, tokenizer=None)
  evaluator = glue.GlueEvaluator(context)
  evaluator._predict = lambda params, batch: batch['targets']  # the perfect model
  rng = np.random.default_rng(0)
  batches = [
      {'targets': rng.integers(0, 2, 8).astype(np.int32), 'weights': np.ones(8, np.float32)}
      for _ in range(3)
  ]
  batches[-1]['weights'][5:] = 0  # the last batch's padding rows
  result = evaluator.final(None, Batches(batches), 'validation')
  assert result.metrics['accuracy'] == 100
  written = json.loads(result.files['validation_predictions.json'])
  assert len(written['labels']) == 21  # padding rows left out
  assert written['predictions'] == written['labels']


@pytest.mark.integration
def test_one_step_at_learning_rate_zero_scores_the_model_it_starts_from(tmp_path):
  """`glue_reparam.BEFORE` scores a converted model as converted: a run started from another
  with those overrides ends with the same dev loss and predictions as that run's own final
  evaluation (one step at learning rate 0 moves no parameter, weight decay included)."""
  from experiments.collaborative import glue_reparam  # pylint: disable=g-import-not-at-top

  config = config_lib.load('configs/glue.py:tiny')
  config.num_train_steps = 3
  config.num_eval_steps = 1
  first = train.train_and_evaluate(config, str(tmp_path / 'first'), devices=ONE_DEVICE)
  first = first['final']['validation']
  config = config_lib.load('configs/glue.py:tiny')
  config.num_eval_steps = 1
  config.init_from = str(tmp_path / 'first')
  for key, value in glue_reparam.BEFORE.items():
    setattr(config, key, value)
  again = train.train_and_evaluate(config, str(tmp_path / 'again'), devices=ONE_DEVICE)
  again = again['final']['validation']
  # The same parameters through the same program: equal up to float reassociation.
  assert again['loss'] == pytest.approx(first['loss'], rel=1e-6)
  read = lambda run, step: json.loads(
      (tmp_path / run / 'final_eval' / str(step) / 'validation_predictions.json').read_text()
  )
  assert read('again', 1)['predictions'] == read('first', 3)['predictions']
