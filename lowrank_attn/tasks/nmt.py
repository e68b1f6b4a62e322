"""Translation on an encoder-decoder (`models.EncoderDecoder`), scored by BLEU.

Batch keys, all `[batch, max_length]` (weights float32, the rest int32): inputs (source +
[eos]), targets (target + [eos]), weights (1 on real target tokens). Training rows with
data.packing hold several pairs (first fit, by the pipeline: `data.FirstFitPacking`) and add
inputs_segment_ids, inputs_positions, targets_segment_ids, targets_positions; evaluation keeps
one pair per row (beam search decodes one sentence per row) and cuts sides to max_length
instead of dropping.

Evaluation adds BLEU: during training on `decode.num_examples` sentences of the eval split
(detokenized ids against detokenized references), at the end on whole splits against the raw
reference text (`train.decode.Translator`, sacreBLEU; the translations are written as files).
"""

import dataclasses

import jax.numpy as jnp
import numpy as np

from lowrank_attn import models
from lowrank_attn.data import ArraySpec, FirstFitPacking, RowFormat, transforms
from lowrank_attn.tasks import base

KEYS = ('inputs', 'targets', 'weights')
PACKED_KEYS = KEYS + (
    'inputs_segment_ids',
    'inputs_positions',
    'targets_segment_ids',
    'targets_positions',
)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """Decoding and BLEU during evaluation (`config.decode`)."""

  beam_size: int = 4  # 1: greedy
  length_penalty: float = 0.6  # alpha of Wu et al. (2016): score / ((5 + len) / 6)^alpha
  max_length: int = 128  # longest translation, in tokens (<= model.max_length)
  num_examples: int = 256  # eval sentences translated for BLEU; -1: all, 0: none

  def __post_init__(self):
    def bad(name, expected):
      raise ValueError(f'{name}={getattr(self, name)!r} is invalid: expected {expected}.')

    for name, minimum in (('beam_size', 1), ('max_length', 1)):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        bad(name, f'an integer >= {minimum}')
    n = self.num_examples
    if not isinstance(n, int) or isinstance(n, bool) or (n < 0 and n != -1):
      bad('num_examples', 'an integer >= 0 or -1')
    alpha = self.length_penalty
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha < 0:
      bad('length_penalty', 'a number >= 0')


class EncodeNMT:
  """Pair -> {'inputs': source + [eos], 'targets': target + [eos]}; truncated when evaluating."""

  def __init__(self, tokenizer, fields: tuple[str, str], max_length: int, truncate: bool):
    self.tokenizer, self.fields = tokenizer, fields
    self.max_length, self.truncate = max_length, truncate

  def __call__(self, example):
    out = {}
    for key, field in zip(('inputs', 'targets'), self.fields):
      ids = self.tokenizer.encode(example[field].decode('utf-8'))
      if self.truncate:
        ids = ids[: self.max_length - 1]
      out[key] = np.asarray([*ids, self.tokenizer.eos_id], np.int32)
    return out


class PadPair:

  def __init__(self, max_length: int):
    self.max_length = max_length

  def __call__(self, pair):
    targets = transforms.pad(pair['targets'], self.max_length)
    return {
        'inputs': transforms.pad(pair['inputs'], self.max_length),
        'targets': targets,
        'weights': (targets != 0).astype(np.float32),
    }


class FinishPackedPair:
  """Rows of first-fit packed pairs -> the packed batch keys."""

  def __call__(self, packed):
    return {
        'inputs': packed['inputs'],
        'targets': packed['targets'],
        'weights': (packed['targets_segment_ids'] > 0).astype(np.float32),
        **{k: packed[k].astype(np.int32) for k in PACKED_KEYS[3:]},
    }


class NMTFormat(RowFormat):
  name = 'nmt'
  token_keys = {'inputs': 'inputs', 'targets': 'targets'}

  def check_config(self, config):
    if config.source_lang == config.target_lang:
      raise ValueError(
          f'source_lang and target_lang are both {config.source_lang!r}; nmt needs two sides.'
      )

  def file_features(self, config, text_feature):
    return (config.source_lang, config.target_lang)

  def encoder(self, tokenizer, fields, config, *, truncate):
    return EncodeNMT(tokenizer, fields, config.max_length, truncate=truncate)

  def train_filter(self, config):
    return transforms.FitsLength(config.max_length)

  def packed(self, config, *, train):
    # Evaluation keeps one pair per row: beam search decodes one sentence per row.
    return config.packing and train

  def first_fit_packing(self, config, *, train):
    if self.packed(config, train=train):
      return FirstFitPacking(('inputs', 'targets'), FinishPackedPair())
    return None

  def rows(self, ds, config, *, batch_size, train):
    return ds.map(PadPair(config.max_length))

  def row_spec(self, config, *, train):
    keys = PACKED_KEYS if self.packed(config, train=train) else KEYS
    return {
        key: ArraySpec((config.max_length,), np.dtype(np.float32 if key == 'weights' else np.int32))
        for key in keys
    }


def _forward(model, batch, **options):
  packed = {k: batch[k] for k in PACKED_KEYS[3:] if k in batch}
  return model(batch['inputs'], batch['targets'], **packed, **options)


def _flops(model, shapes) -> int:
  batch, source_length = shapes['inputs'][:2]
  return model.flops(batch, source_length, shapes['targets'][1])


def _real_tokens(batch):
  """Source and target tokens that are not padding."""
  return jnp.sum(batch['inputs'] != 0) + jnp.sum(batch['targets'] != 0)


class BleuEvaluator(base.Evaluator):
  """BLEU and chrF of beam-search translations (`config.decode`)."""

  def __init__(self, context):
    super().__init__(context)
    self._translator = None

  def evaluate(self, params, pipeline, num_batches):
    from lowrank_attn.train import decode  # pylint: disable=g-import-not-at-top

    s = self.context.setup
    if s.config.decode.num_examples == 0:
      return {}
    return decode.bleu(
        s, params, self.context.batches(pipeline), self.context.tokenizer, s.config.decode
    )

  def final(self, params, pipeline, name):
    from lowrank_attn.train import decode  # pylint: disable=g-import-not-at-top
    from lowrank_attn.train import metrics as metrics_lib  # pylint: disable=g-import-not-at-top

    s = self.context.setup
    config = s.config
    if self._translator is None:  # one per run: its compiled searches serve every split
      self._translator = decode.Translator(
          s,
          params,
          self.context.tokenizer,
          beam_size=config.decode.beam_size,
          length_penalty=config.decode.length_penalty,
          max_length=config.decode.max_length,
          batch_size=decode.default_batch_size(s),
          source_max_length=config.data.max_length,
      )
    translator = self._translator
    translator.params = params
    source, target = config.data.source_lang, config.data.target_lang
    examples = [pipeline.data_source[i] for i in range(len(pipeline.data_source))]
    sources = [e[source].decode('utf-8') for e in examples]
    references = [e[target].decode('utf-8') for e in examples]
    self.context.check_stop()
    translations = translator.translate(sources, progress=self.context.check_stop)
    scores = decode.score(translations.texts, references)
    bleu_key = 'bleu' if config.decode.beam_size > 1 else 'bleu_greedy'
    metrics = {
        bleu_key: scores['bleu'],
        'chrf': scores['chrf'],
        'sentences': scores['sentences'],
        'beam_size': float(config.decode.beam_size),
        'truncated_sources': float(len(translations.truncated)),
    }
    where = name if name == pipeline.split else f'{name} ({pipeline.split})'
    metrics_lib.say(
        f'{where}: {scores["bleu_summary"]}  {scores["bleu_signature"]}; '
        f'chrF2 {scores["chrf"]:.2f} {scores["chrf_signature"]}; '
        f'{len(references)} sentences, beam {config.decode.beam_size}'
        + (
            f', {len(translations.truncated)} sources cut to data.max_length='
            f'{config.data.max_length} tokens'
            if translations.truncated
            else ''
        )
    )
    return base.FinalResult(
        metrics,
        strings={k: scores[k] for k in ('bleu_signature', 'chrf_signature')},
        files={f'{name}.txt': ''.join(t + '\n' for t in translations.texts)},
    )

  def finish(self):
    if self._translator is None:
      return None
    return f'final translation: {self._translator.timing.describe()}'


def _check_config(config):
  if config.model.positions == 'learned' and config.decode.max_length > config.model.max_length:
    raise ValueError(
        f'config.decode.max_length={config.decode.max_length!r} is invalid: must be '
        f'<= model.max_length={config.model.max_length} with learned positions.'
    )


TASK = base.Task(
    name='nmt',
    attention_types=('encoder', 'decoder', 'cross'),
    data_format=NMTFormat(),
    create_model=lambda config, model_cfg, bos_id, rngs: models.EncoderDecoder(
        model_cfg, bos_id=bos_id, rngs=rngs
    ),
    forward=_forward,
    flops=_flops,
    real_tokens=_real_tokens,
    evaluators=lambda context: [
        base.LossEvaluator(context, base.token_summary),
        BleuEvaluator(context),
    ],
    final_splits=lambda config: {'validation': 'validation', 'test': 'test'},
    settings={'decode': DecodeConfig},
    check_config=_check_config,
    model_class=models.EncoderDecoder,
)
