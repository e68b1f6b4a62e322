"""BERT-style masked language modelling on an encoder (`models.EncoderMLM`).

Batch keys (int32 but weights): `[batch, max_length]` inputs (with [MASK]s), segment_ids,
positions; `[batch, P]` with P = `transforms.max_predictions` (BERT's max_predictions_per_seq)
masked_positions, targets (the original tokens there) and weights (float32, 1 on the predicted
tokens, 0 on unused slots). The model's output layer runs at the masked positions only: the
`[tokens, vocab]` logits of every other token were a third of a TPU step's memory traffic
(`tpu/compile_table.md`). Rows hold [bos] text [eos] documents (BERT's [CLS] ... [SEP]), concatenated and cut with
data.packing, one per row without; the corruption is drawn per batch (`finish_batch`) from
the pipeline's position, so a resumed run masks the same tokens.
"""

import numpy as np

from lowrank_attn import models
from lowrank_attn.data import ArraySpec, RowFormat, transforms
from lowrank_attn.data import format as format_lib
from lowrank_attn.tasks import base


class EncodeMLM:
  """Document -> {'tokens': [bos, t1..tn, eos]} (BERT's [CLS] ... [SEP]), truncated if unpacked."""

  def __init__(self, tokenizer, field: str, truncate_to: int | None):
    self.tokenizer, self.field, self.truncate_to = tokenizer, field, truncate_to

  def __call__(self, example):
    ids = self.tokenizer.encode(example[self.field].decode('utf-8'))
    if self.truncate_to is not None:
      ids = ids[: self.truncate_to - 2]
    return {'tokens': np.asarray([self.tokenizer.bos_id, *ids, self.tokenizer.eos_id], np.int32)}


class MLMFormat(RowFormat):
  name = 'mlm'
  token_keys = {'inputs': 'tokens'}

  def encoder(self, tokenizer, fields, config, *, truncate):
    del truncate
    return EncodeMLM(tokenizer, fields[0], None if config.packing else config.max_length)

  def packed(self, config, *, train):
    return config.packing

  def rows(self, ds, config, *, batch_size, train):
    if config.packing:
      return transforms.concat_then_split(ds, {'tokens': config.max_length}, 'tokens')
    return ds.map(transforms.PadDocument(config.max_length, 'tokens'))

  def row_spec(self, config, *, train):
    shape = (config.max_length,)
    return {
        key: ArraySpec(shape, np.dtype(np.int32)) for key in ('tokens', 'segment_ids', 'positions')
    }

  def element_spec(self, config, *, batch_size, train):
    rows = (batch_size, config.max_length)
    slots = (batch_size, transforms.max_predictions(config.max_length, config.mlm_probability))
    return {
        **{
            key: ArraySpec(rows, np.dtype(np.int32))
            for key in ('inputs', 'segment_ids', 'positions')
        },
        'masked_positions': ArraySpec(slots, np.dtype(np.int32)),
        'targets': ArraySpec(slots, np.dtype(np.int32)),
        'weights': ArraySpec(slots, np.dtype(np.float32)),
    }

  def finish_batch(self, batch, *, tokenizer, config, rng):
    tokens = batch.pop('tokens')
    return {
        **batch,
        **transforms.mask_tokens(
            tokens, batch['segment_ids'], tokenizer, config.mlm_probability, rng
        ),
    }

  def num_rows(self, examples, encode, config):
    if not config.packing:
      return len(examples)
    return format_lib.concat_rows(examples, encode, 'tokens', config.max_length)


def _forward(model, batch, **options):
  """Logits `[batch, P, vocab]` at the masked positions."""
  return model(
      batch['inputs'],
      positions=batch.get('positions'),
      segment_ids=batch.get('segment_ids'),
      output_positions=batch['masked_positions'],
      **options,
  )


def _flops(model, shapes) -> int:
  return model.flops(*shapes['inputs'][:2], predictions=shapes['masked_positions'][1])


TASK = base.Task(
    name='mlm',
    attention_types=('encoder',),
    data_format=MLMFormat(),
    create_model=lambda config, model_cfg, bos_id, rngs: models.EncoderMLM(model_cfg, rngs=rngs),
    forward=_forward,
    flops=_flops,
    real_tokens=base.segment_tokens,
    model_class=models.EncoderMLM,
)
