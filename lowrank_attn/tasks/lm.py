"""Next-token language modelling on a decoder (`models.DecoderLM`).

Batch keys, all `[batch, max_length]` (weights float32, the rest int32): inputs ([bos] + text),
targets (text + [eos]), weights (1 on real tokens), segment_ids, positions. With data.packing,
documents are concatenated and cut into full rows (they may straddle rows; segment ids keep
them apart); without, one document per row, cut to max_length.
"""

import numpy as np

from lowrank_attn import models
from lowrank_attn.data import ArraySpec, RowFormat, transforms
from lowrank_attn.data import format as format_lib
from lowrank_attn.tasks import base


class EncodeLM:
  """Document -> {'inputs': [bos, t1..tn], 'targets': [t1..tn, eos]}, truncated if unpacked."""

  def __init__(self, tokenizer, field: str, truncate_to: int | None):
    self.tokenizer, self.field, self.truncate_to = tokenizer, field, truncate_to

  def __call__(self, example):
    ids = self.tokenizer.encode(example[self.field].decode('utf-8'))
    tokens = np.asarray([self.tokenizer.bos_id, *ids, self.tokenizer.eos_id], np.int32)
    inputs, targets = tokens[:-1], tokens[1:]
    if self.truncate_to is not None:
      inputs, targets = inputs[: self.truncate_to], targets[: self.truncate_to]
    return {'inputs': inputs, 'targets': targets}


class AddTokenWeights:
  """Loss weight 1 on every token of a segment."""

  def __call__(self, row):
    return {
        'inputs': row['inputs'],
        'targets': row['targets'],
        'weights': (row['segment_ids'] > 0).astype(np.float32),
        'segment_ids': row['segment_ids'],
        'positions': row['positions'],
    }


class LMFormat(RowFormat):
  name = 'lm'

  def encoder(self, tokenizer, fields, config, *, truncate):
    del truncate  # unpacked rows are always cut; packed rows never need it
    return EncodeLM(tokenizer, fields[0], None if config.packing else config.max_length)

  def packed(self, config, *, train):
    return config.packing

  def rows(self, ds, config, *, batch_size, train):
    if config.packing:
      ds = transforms.concat_then_split(
          ds, {'inputs': config.max_length, 'targets': config.max_length}, 'inputs'
      )
    else:
      ds = ds.map(transforms.PadDocument(config.max_length, 'inputs'))
    return ds.map(AddTokenWeights())

  def row_spec(self, config, *, train):
    shape = (config.max_length,)
    return {
        key: ArraySpec(shape, np.dtype(np.float32 if key == 'weights' else np.int32))
        for key in ('inputs', 'targets', 'weights', 'segment_ids', 'positions')
    }

  def num_rows(self, examples, encode, config):
    if not config.packing:
      return len(examples)
    return format_lib.concat_rows(examples, encode, 'inputs', config.max_length)


TASK = base.Task(
    name='lm',
    attention_types=('decoder',),
    data_format=LMFormat(),
    create_model=lambda config, model_cfg, bos_id, rngs: models.DecoderLM(model_cfg, rngs=rngs),
    forward=base.sequence_forward,
    flops=base.sequence_flops,
    real_tokens=base.segment_tokens,
    model_class=models.DecoderLM,
)
