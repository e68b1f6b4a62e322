"""GLUE fine-tuning (Wang et al. 2019): sentence and sentence-pair classification and
regression on an encoder (`models.EncoderMLM` without its MLM head, plus a pooled head).

Data: `glue/<task>` (`lowrank_attn.data.builders.glue`: cola, sst2, mrpc, rte, stsb), read
with a WordPiece vocabulary. Rows are BERT's `[CLS] a [SEP] b [SEP]` (token types 0 then 1),
cut longest-first to data.max_length. Batch keys: inputs, token_types, segment_ids, positions
`[batch, max_length]` int32; targets `[batch]` (the class, int32, or the STS-B score, float32);
weights `[batch]` (1 per real example, 0 on padding rows).

Loss: cross entropy over the classes, or the squared error of the score (STS-B). Metrics on
the whole split (`GlueEvaluator`), x100 as GLUE reports them: Matthews correlation (CoLA),
accuracy (SST-2, RTE), F1 and accuracy (MRPC), Pearson and Spearman correlation (STS-B);
`score` is the task's GLUE score (the mean where it has two).
"""

import dataclasses
import json

from flax import nnx
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np

from lowrank_attn import models
from lowrank_attn.sharding import logical_metadata as logical
from lowrank_attn.data import ArraySpec, RowFormat, transforms
from lowrank_attn.data.builders import glue as glue_data
from lowrank_attn.tasks import base

POOLING = ('mean', 'cls')


@dataclasses.dataclass(frozen=True)
class GlueConfig:
  """The classifier on top of the encoder (`config.glue`)."""

  pooling: str = 'mean'  # 'mean' over real tokens (all-MiniLM-L6-v2's) | 'cls' ([CLS] state)
  classifier_dropout: float = 0.1  # on the pooled vector, before the output layer

  def __post_init__(self):
    if self.pooling not in POOLING:
      raise ValueError(f'pooling={self.pooling!r} is not one of {POOLING}.')
    rate = self.classifier_dropout
    if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not 0 <= rate < 1:
      raise ValueError(f'classifier_dropout={rate!r} must be a number in [0, 1).')


def glue_task(data_name: str) -> tuple[str, glue_data.GlueTask]:
  """('cola', its spec) of data.name 'glue/cola'; ValueError for other names."""
  task = data_name.removeprefix('glue/')
  if not data_name.startswith('glue/') or task not in glue_data.TASKS:
    raise ValueError(
        f'data.name={data_name!r} is not a GLUE task; valid: '
        f'{sorted("glue/" + t for t in glue_data.TASKS)}.'
    )
  return task, glue_data.TASKS[task]


def _is_regression(data_name: str) -> bool:
  return glue_task(data_name)[1].num_classes == 1


# ------------------------------------------------------------------------------------- data


class EncodeGlue:
  """Example -> inputs `[CLS] a [SEP] (b [SEP])`, token_types, the label (longest-first cut)."""

  def __init__(self, tokenizer, fields: tuple[str, ...], max_length: int, regression: bool):
    self.tokenizer, self.fields, self.max_length = tokenizer, fields, max_length
    self.regression = regression

  def __call__(self, example):
    parts = [self.tokenizer.encode(example[f].decode('utf-8')) for f in self.fields]
    budget = self.max_length - 1 - len(parts)  # [CLS] and one [SEP] per sentence
    while sum(len(p) for p in parts) > budget:  # longest first; of two equal, the second
      longest = max(reversed(range(len(parts))), key=lambda i: len(parts[i]))
      parts[longest] = parts[longest][:-1]
    ids, types = [self.tokenizer.bos_id], [0]
    for i, part in enumerate(parts):
      ids += [*part, self.tokenizer.eos_id]
      types += [i] * (len(part) + 1)
    label = example['label']
    return {
        'inputs': np.asarray(ids, np.int32),
        'token_types': np.asarray(types, np.int32),
        'targets': np.asarray(label, np.float32 if self.regression else np.int32),
    }


class PadExample:

  def __init__(self, max_length: int):
    self.max_length = max_length

  def __call__(self, example):
    n = len(example['inputs'])
    return {
        'inputs': transforms.pad(example['inputs'], self.max_length),
        'token_types': transforms.pad(example['token_types'], self.max_length),
        'segment_ids': transforms.pad(np.ones(n, np.int32), self.max_length),
        'positions': transforms.pad(np.arange(n, dtype=np.int32), self.max_length),
        'targets': example['targets'],
        'weights': np.float32(1.0),
    }


class GlueFormat(RowFormat):
  name = 'glue'

  def check_config(self, config):
    task, spec = glue_task(config.name)
    if config.tokenizer != 'wordpiece':
      raise ValueError(
          f"tokenizer={config.tokenizer!r}: GLUE rows are BERT's [CLS] a [SEP] b "
          "[SEP]; use tokenizer='wordpiece'."
      )
    sentences = len(spec.sentence_columns)
    if config.max_length < 1 + 2 * sentences:
      raise ValueError(
          f'max_length={config.max_length} is too short for {task}: a row needs [CLS] and, '
          f'for each of its {sentences} sentence(s), a token and [SEP] '
          f'(max_length >= {1 + 2 * sentences}).'
      )
    if config.extra_test_files:
      raise ValueError(
          f'extra_test_files={config.extra_test_files!r}: GLUE is scored against labels, '
          'which text files do not carry; evaluate other sets as GLUE tasks of their own.'
      )

  def file_features(self, config, text_feature):
    _, spec = glue_task(config.name)
    return ('sentence1', 'sentence2')[: len(spec.sentence_columns)]

  def encoder(self, tokenizer, fields, config, *, truncate):
    del truncate  # always cut: every example is kept, in training too
    return EncodeGlue(tokenizer, fields, config.max_length, _is_regression(config.name))

  def rows(self, ds, config, *, batch_size, train):
    return ds.map(PadExample(config.max_length))

  def row_spec(self, config, *, train):
    row = ArraySpec((config.max_length,), np.dtype(np.int32))
    target = np.float32 if _is_regression(config.name) else np.int32
    return {
        'inputs': row,
        'token_types': row,
        'segment_ids': row,
        'positions': row,
        'targets': ArraySpec((), np.dtype(target)),
        'weights': ArraySpec((), np.dtype(np.float32)),
    }


# ------------------------------------------------------------------------------------ model


class SentenceClassifier(models.EncoderMLM):
  """An encoder with a pooled classification (or regression) head instead of the MLM head.

  Its encoder parameters have the paths of `EncoderMLM`'s, so a pretrained BERT (or a trained
  mlm run) warm-starts it by `config.init_from`; the head starts from scratch.
  """

  def __init__(
      self,
      cfg: models.TransformerConfig,
      *,
      num_outputs: int,
      pooling: str,
      classifier_dropout: float,
      rngs: nnx.Rngs,
  ):
    super().__init__(cfg, rngs=rngs)
    del self.head_dense, self.head_norm, self.output_bias, self.activation  # the MLM head
    if self.output is not None:
      del self.output
    self.num_outputs, self.pooling = num_outputs, pooling
    self.classifier_dropout = nnx.Dropout(classifier_dropout)
    self.classifier = nnx.Linear(
        cfg.emb_dim,
        num_outputs,
        dtype=jnp.float32,
        param_dtype=cfg.parameter_dtype,
        kernel_init=nnx.initializers.normal(0.02),
        rngs=rngs,
        kernel_metadata=logical('embed', None),
        bias_metadata=logical(None),
    )

  def constructor_kwargs(self) -> dict:
    """The arguments besides the config that build this model again (e.g. re-parametrized)."""
    return {
        'num_outputs': self.num_outputs,
        'pooling': self.pooling,
        'classifier_dropout': self.classifier_dropout.rate,
    }

  def __call__(
      self,
      inputs,
      *,
      positions=None,
      segment_ids=None,
      token_types=None,
      deterministic: bool = True,
      rngs: nnx.Rngs | None = None,
      head_masks=None,
      return_weights: bool = False,
      return_logits: bool = False,
  ):
    """inputs `[batch, length]` -> (logits `[batch, classes]` or scores `[batch]`, aux)."""
    hidden, extras = self.encode(
        inputs,
        positions=positions,
        segment_ids=segment_ids,
        token_types=token_types,
        deterministic=deterministic,
        rngs=rngs,
        head_masks=head_masks,
        return_weights=return_weights,
        return_logits=return_logits,
    )
    hidden = hidden.astype(jnp.float32)
    if self.pooling == 'cls':
      pooled = hidden[:, 0]
    else:
      real = ((inputs != 0) if segment_ids is None else (segment_ids > 0))[..., None]
      pooled = jnp.sum(hidden * real, axis=1) / jnp.maximum(jnp.sum(real, axis=1), 1)
    pooled = self.classifier_dropout(pooled, deterministic=deterministic, rngs=rngs)
    outputs = self.classifier(pooled)
    if self.num_outputs == 1:
      outputs = outputs[:, 0]
    return outputs, self._aux(extras)

  def flops(self, batch_size: int, length: int) -> int:
    return self.encoder.flops(batch_size, length) + 2 * batch_size * self.cfg.emb_dim * (
        self.num_outputs
    )


def _create_model(config, model_cfg, bos_id, rngs):
  del bos_id
  _, spec = glue_task(config.data.name)
  return SentenceClassifier(
      model_cfg,
      num_outputs=spec.num_classes,
      pooling=config.glue.pooling,
      classifier_dropout=config.glue.classifier_dropout,
      rngs=rngs,
  )


def _forward(model, batch, **options):
  return model(
      batch['inputs'],
      positions=batch['positions'],
      segment_ids=batch['segment_ids'],
      token_types=batch['token_types'],
      **options,
  )


def _loss(outputs, batch, label_smoothing):
  if outputs.ndim == 1:  # regression: squared error of the score
    weights = batch['weights'].astype(jnp.float32)
    error = jnp.sum(jnp.square(outputs - batch['targets']) * weights)
    return {'nll': error, 'objective': error, 'weight': jnp.sum(weights)}
  return base.cross_entropy(outputs, batch['targets'], batch['weights'], label_smoothing)


def _summarize(totals):
  """Mean loss per example (accuracy and the rest come from `GlueEvaluator`, x100)."""
  return {'loss': totals['nll'] / max(totals['weight'], 1.0), 'examples': totals['weight']}


# ---------------------------------------------------------------------------------- metrics


def _ranks(x: np.ndarray) -> np.ndarray:
  """Ranks 1..n, ties sharing their mean rank (Spearman's convention)."""
  order = np.argsort(x, kind='stable')
  ranks = np.empty(len(x), np.float64)
  ranks[order] = np.arange(1, len(x) + 1)
  values, inverse = np.unique(x, return_inverse=True)
  sums = np.bincount(inverse, weights=ranks)
  counts = np.bincount(inverse)
  return (sums / counts)[inverse]


def _pearson(x, y) -> float:
  x, y = x - x.mean(), y - y.mean()
  denominator = np.sqrt(np.sum(x * x) * np.sum(y * y))
  return float(np.sum(x * y) / denominator) if denominator > 0 else 0.0


def glue_metrics(task: str, predictions: np.ndarray, labels: np.ndarray) -> dict[str, float]:
  """The GLUE metrics of `task` (x100) and its `score`; predictions are classes or scores."""
  predictions, labels = np.asarray(predictions, np.float64), np.asarray(labels, np.float64)
  if task == 'stsb':
    out = {
        'pearson': 100 * _pearson(predictions, labels),
        'spearman': 100 * _pearson(_ranks(predictions), _ranks(labels)),
    }
    return {**out, 'score': (out['pearson'] + out['spearman']) / 2}
  accuracy = 100 * float(np.mean(predictions == labels))
  if task == 'cola':  # Matthews correlation of the binary confusion matrix
    # For two classes Matthews' correlation is Pearson's of the 0/1 vectors (the phi
    # coefficient); 0 when either is constant, as in sklearn.
    matthews = 100 * _pearson(predictions, labels)
    return {'matthews': matthews, 'score': matthews}
  if task == 'mrpc':
    tp = np.sum((predictions == 1) & (labels == 1))
    f1 = 100 * 2 * tp / max(np.sum(predictions == 1) + np.sum(labels == 1), 1)
    return {'f1': float(f1), 'accuracy': accuracy, 'score': (float(f1) + accuracy) / 2}
  return {'accuracy': accuracy, 'score': accuracy}


def constant_score(task: str, labels) -> float:
  """The best dev score of a model that ignores its input: one class for every example (for
  accuracy the majority class, for MRPC's mean of F1 and accuracy the better of the two), or
  one similarity (STS-B: no correlation, 0). A model near it has lost the task."""
  labels = np.asarray(labels)
  if task == 'stsb':
    return glue_metrics(task, np.zeros(labels.shape), labels)['score']
  return max(
      glue_metrics(task, np.full(labels.shape, c), labels)['score'] for c in np.unique(labels)
  )


class GlueEvaluator(base.Evaluator):
  """Predicts every example of the split and scores it with `glue_metrics`."""

  def __init__(self, context):
    super().__init__(context)
    s = context.setup

    def predict(params, batch):
      model = nnx.merge(s.graphdef, params)
      outputs, _ = _forward(model, batch, deterministic=True)
      return outputs if outputs.ndim == 1 else jnp.argmax(outputs, axis=-1)

    self._predict = jax.jit(predict)

  def evaluate(self, params, pipeline, num_batches):
    predictions, labels = self._predict_split(params, pipeline, num_batches)
    if not len(labels):
      return {}
    return glue_metrics(glue_task(self.context.setup.config.data.name)[0], predictions, labels)

  def final(self, params, pipeline, name):
    """The metrics, and `<name>_predictions.json` (every example's prediction and label, in
    the split's order when one process evaluates; with several, in the global batches' row
    order) for paired comparisons of runs (e.g. bootstrap intervals)."""
    predictions, labels = self._predict_split(params, pipeline, -1)
    metrics = (
        glue_metrics(glue_task(self.context.setup.config.data.name)[0], predictions, labels)
        if len(labels)
        else {}
    )
    text = json.dumps({'predictions': predictions.tolist(), 'labels': labels.tolist()})
    return base.FinalResult(metrics, files={f'{name}_predictions.json': text + '\n'})

  def _predict_split(self, params, pipeline, num_batches):
    """(predictions, labels) of the split's real examples, in order."""
    s = self.context.setup
    predictions, labels = [], []
    for batch in self.context.batches(pipeline, num_batches):
      global_batch = s.global_batch(batch)
      with s.activate():
        out = self._predict(params, global_batch)
      # Labels from the same global arrays as the predictions: with several processes, the
      # mesh's device order (not the process order) sets the global batch's row order.
      out, targets, weights = (
          np.asarray(multihost_utils.process_allgather(x, tiled=True))
          for x in (out, global_batch['targets'], global_batch['weights'])
      )
      keep = weights > 0
      predictions.append(out[keep])
      labels.append(targets[keep])
    if not predictions:
      return np.zeros(0), np.zeros(0)
    return np.concatenate(predictions), np.concatenate(labels)


def _check_config(config):
  glue_task(config.data.name)


TASK = base.Task(
    name='glue',
    attention_types=('encoder',),
    data_format=GlueFormat(),
    create_model=_create_model,
    forward=_forward,
    flops=base.sequence_flops,
    real_tokens=base.segment_tokens,
    loss=_loss,
    summarize=_summarize,
    evaluators=lambda context: [base.LossEvaluator(context, _summarize), GlueEvaluator(context)],
    final_splits=lambda config: {'validation': 'validation'},
    settings={'glue': GlueConfig},
    check_config=_check_config,
    model_class=SentenceClassifier,
)
