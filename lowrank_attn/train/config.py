"""The configuration schema: every field, its default and what it means (documented once).

Task configs (`configs/lm.py`, `configs/mlm.py`, `configs/nmt.py`) start from
`base_config(task)` and change values; they cannot add fields (the ConfigDict is locked, so a
typo such as `--config.modle.emb_dim=8` fails at once). `validate(config)` checks values and
raises a `ValueError` naming the field before any data is read or any device is touched.

The training fields are documented below. The `model` fields are derived from the dataclasses
that define them and are documented there, once: `lowrank_attn.models.TransformerConfig`
(sizes, norms, dropout, ...) and `lowrank_attn.attention.AttentionSpec` (attention options);
`config.data` from `lowrank_attn.data.DataConfig`. Attention options are given once in
`model.attention` and overridden per attention type in `model.encoder_attention`,
`model.decoder_attention` and `model.cross_attention`, whose fields are None ("inherit") unless
set. So
    --config.model.attention.gated=True                       gates on all three types
    --config.model.encoder_attention.kind=collaborative       collaborative encoder only
    --config.model.encoder_attention.num_heads='(8,8,4)'      per-layer head counts
"""

from collections.abc import Mapping
import importlib.util
import os
import re
from typing import Any

import ml_collections
from ml_collections import config_dict

from lowrank_attn import data as data_lib
from lowrank_attn import models, schema, sharding
from lowrank_attn.attention import AttentionSpec
from lowrank_attn.attention.spec import SIZE_FIELDS
from lowrank_attn.train import optim, tasks

# Maxtext-style rules: logical axis -> mesh axes. 'batch' takes data and fsdp (FSDP splits the
# batch like data parallelism); parameters' 'embed' dimension is sharded by fsdp; heads, MLP
# width and vocabulary by tensor. An activation dimension whose mesh axis is already used by
# another dimension (embed when batch holds fsdp) is left unsharded.
DEFAULT_RULES = (
    ('batch', ('data', 'fsdp')),
    ('length', None),
    ('vocab', 'tensor'),
    ('embed', 'fsdp'),
    ('mlp', 'tensor'),
    ('heads', 'tensor'),
    ('kv', None),
    ('key', None),
    ('layers', None),
)


def _model_exclude(task: tasks.Task) -> tuple[str, ...]:
  """TransformerConfig fields that are not config entries: set from data, or unused by task."""
  layer_fields = ('num_encoder_layers', 'num_decoder_layers')
  return ('vocab_size', *(f'{t}_attention' for t in models.ATTENTION_TYPES),
          *(f for f in layer_fields if f not in task.layer_fields))


def _model_config_dict(task: tasks.Task) -> ml_collections.ConfigDict:
  model = schema.config_dict(models.TransformerConfig, exclude=_model_exclude(task),
                             **{field: 6 for field in task.layer_fields})  # Transformer-base
  default = models.config.DEFAULT_ATTENTION.options()
  model.attention = schema.config_dict(AttentionSpec, exclude=SIZE_FIELDS, **default)
  for attention_type in task.attention_types:
    model[f'{attention_type}_attention'] = schema.config_dict(
        AttentionSpec, exclude=SIZE_FIELDS, inherit=True)
  return model


def base_config(task: str) -> ml_collections.ConfigDict:
  """All fields with their defaults (Transformer-base sizes); locked against new keys."""
  task_record = tasks.get(task)
  c = ml_collections.ConfigDict()
  c.task = task  # 'lm' (decoder-only), 'mlm' (BERT-style encoder), 'nmt' (encoder-decoder)
  # Warm start: 'DIR' or 'DIR:STEP', another run whose parameters initialise this one (matched
  # by parameter path; not its optimizer state or step). New parameters keep their init.
  c.init_from = config_dict.placeholder(str)
  # Regular expression over parameter paths ('encoder/layers/0/self_attention/query_kernel'):
  # only matching parameters train, the others stay bitwise unchanged. None: all train.
  c.trainable = config_dict.placeholder(str)

  # ---- Run length, batches, cadence. Steps count optimizer updates.
  c.seed = 0  # parameters from key(seed); dropout key of step s: fold_in(key(seed + 1), s)
  c.num_train_steps = 100_000
  c.per_device_batch_size = 32  # global batch = this x number of devices (x grad_accum_steps)
  c.grad_accum_steps = 1  # micro-batches averaged per update (same result, less memory)
  c.log_every_steps = 50  # train metrics to TensorBoard / metrics.jsonl; NaN check
  c.progress_every_secs = 5.0  # the console progress line
  c.eval_every_steps = 2_000  # evaluation (and BLEU for nmt); 0: only at the end
  c.num_eval_steps = -1  # eval batches per evaluation; -1: the whole eval split
  c.eval_split = 'validation'  # the data split evaluated during training
  c.checkpoint_every_steps = 2_000  # also saved at the end and on SIGTERM
  c.keep_checkpoints = 3  # the last K checkpoints are kept
  c.async_checkpointing = True  # write checkpoints in the background

  # ---- Optimisation: AdamW, warmup then decay (lowrank_attn/train/optim.py).
  c.learning_rate = 1e-3  # peak learning rate, reached after warmup
  c.lr_schedule = 'inverse_sqrt'  # after warmup: 'inverse_sqrt'|'cosine'|'linear'|'constant'
  c.warmup_steps = 4_000  # linear warmup from 0
  c.end_learning_rate_factor = 0.0  # cosine/linear end at learning_rate x this
  c.weight_decay = 0.0  # AdamW decoupled decay of matrices (never of vectors)
  c.adam_b1 = 0.9
  c.adam_b2 = 0.98
  c.adam_eps = 1e-9
  c.grad_clip_norm = 1.0  # global-norm clipping; 0: off
  c.label_smoothing = 0.0  # e.g. 0.1 for translation (Vaswani et al.)
  # lambda of Voita et al. (2019): loss += lambda x (expected open gates summed over heads,
  # averaged over gated attention layers), as in their code; see models' aux['l0_penalty'].
  c.l0_penalty_weight = 0.0

  # ---- Devices and parallelism (lowrank_attn/train/sharding.py).
  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1  # data-parallel ways; -1: the devices the other axes leave
  c.mesh.fsdp = 1  # parameter/optimizer-state sharding ways (splits the batch too)
  c.mesh.tensor = 1  # tensor-parallel ways (heads, MLP width, vocabulary)
  c.logical_axis_rules = DEFAULT_RULES  # logical axis -> mesh axes (None: replicated)
  c.jax_distributed = False  # call jax.distributed.initialize() (multi-host TPU / GPU)
  # Explicit cluster for jax.distributed.initialize(); None: auto-detected (TPU, SLURM, ...).
  c.coordinator_address = config_dict.placeholder(str)  # 'host:port' of process 0
  c.num_processes = config_dict.placeholder(int)
  c.process_id = config_dict.placeholder(int)
  # Steps dispatched ahead of the host: bounds how long a SIGTERM waits for the save.
  c.max_steps_in_flight = 2
  c.peak_flops_per_device = config_dict.placeholder(float)  # for MFU; None: measure matmuls

  # ---- Data: the fields of `lowrank_attn.data.DataConfig` (documented there).
  c.data = data_lib.default_data_config(task=task)

  # ---- Model: the fields of `lowrank_attn.models.TransformerConfig` and, per attention type,
  # of `lowrank_attn.attention.AttentionSpec` (documented there; see the module docstring).
  c.model = _model_config_dict(task_record)

  # ---- Decoding and BLEU during evaluation (nmt).
  c.decode = ml_collections.ConfigDict()
  c.decode.beam_size = 4  # 1: greedy
  c.decode.length_penalty = 0.6  # alpha of Wu et al. (2016): score / ((5 + len) / 6)^alpha
  c.decode.max_length = 128  # longest translation, in tokens (<= model.max_length)
  c.decode.num_examples = 256  # eval sentences translated for BLEU; -1: all, 0: none

  c.lock()
  return c


def load(spec: str) -> ml_collections.ConfigDict:
  """The config of `'configs/nmt.py:multi30k'` (file, optional variant), as `--config=` loads it."""
  path, _, variant = spec.partition(':')
  if not os.path.isfile(path):
    raise ValueError(f'config file {path!r} (from {spec!r}) does not exist.')
  module_spec = importlib.util.spec_from_file_location(
      'lowrank_attn_config_' + os.path.basename(path).removesuffix('.py'), path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(variant) if variant else module.get_config()


# ---------------------------------------------------------------------------- validation


def _fail(field: str, value, expected: str):
  raise ValueError(f'config.{field}={value!r} is invalid: {expected}.')


def _check_int(c, field: str, minimum: int, allow: tuple = ()):
  value = _get(c, field)
  if value in allow and not isinstance(value, bool):
    return
  if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
    _fail(field, value, f'expected an integer >= {minimum}' +
          (f' or one of {allow}' if allow else ''))


def _check_float(c, field: str, low: float, high: float | None = None, *,
                 high_inclusive: bool = False):
  value = _get(c, field)
  ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= low
  if ok and high is not None:
    ok = value <= high if high_inclusive else value < high
  if not ok:
    bound = '' if high is None else f' and {"<=" if high_inclusive else "<"} {high}'
    _fail(field, value, f'expected a number >= {low}{bound}')


def _check_choice(c, field: str, choices):
  value = _get(c, field)
  if value not in choices:
    _fail(field, value, f'expected one of {tuple(choices)}')


def _get(c, field: str):
  for part in field.split('.'):
    c = c[part]
  return c


def attention_options(config, attention_type: str) -> dict[str, Any]:
  """One attention type's options: `model.attention`, overridden by its non-None fields."""
  options = schema.values_of(config.model.attention)
  overrides = schema.values_of(config.model.get(f'{attention_type}_attention'))
  options.update({k: v for k, v in overrides.items() if v is not None})
  return options


def model_config(config: ml_collections.ConfigDict, vocab_size: int) -> models.TransformerConfig:
  """The models' `TransformerConfig` of a task config; ValueError naming the config field."""
  task = tasks.get(config.task)
  schema.build(AttentionSpec, schema.values_of(config.model.attention), 'model.attention')
  values = {k: v for k, v in schema.values_of(config.model).items()
            if k != 'attention' and not k.endswith('_attention')}
  for attention_type in models.ATTENTION_TYPES:
    if attention_type in task.attention_types:
      path = f'model.{attention_type}_attention'
      values[f'{attention_type}_attention'] = schema.build(
          AttentionSpec, attention_options(config, attention_type), path)
  for field in ('num_encoder_layers', 'num_decoder_layers'):
    values.setdefault(field, 0)  # the task has no such stack
  return schema.build(models.TransformerConfig, values, 'model', vocab_size=vocab_size)


def validate(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the first invalid field; returns None if all are valid."""
  c = config
  _check_choice(c, 'task', tuple(tasks.TASKS))
  if c.data.task != c.task:
    _fail('data.task', c.data.task, f'must equal config.task={c.task!r}')
  for field in ('num_train_steps', 'per_device_batch_size', 'grad_accum_steps',
                'log_every_steps', 'checkpoint_every_steps', 'keep_checkpoints',
                'max_steps_in_flight'):
    _check_int(c, field, 1)
  _check_int(c, 'seed', 0)
  _check_int(c, 'eval_every_steps', 0)
  _check_int(c, 'num_eval_steps', 1, allow=(-1,))
  _check_float(c, 'progress_every_secs', 0.0)
  _check_float(c, 'learning_rate', 0.0)
  _check_choice(c, 'lr_schedule', optim.SCHEDULES)
  _check_int(c, 'warmup_steps', 0)
  _check_float(c, 'end_learning_rate_factor', 0.0, 1.0, high_inclusive=True)
  _check_float(c, 'weight_decay', 0.0)
  _check_float(c, 'adam_b1', 0.0, 1.0)
  _check_float(c, 'adam_b2', 0.0, 1.0)
  _check_float(c, 'adam_eps', 0.0)
  _check_float(c, 'grad_clip_norm', 0.0)
  _check_float(c, 'label_smoothing', 0.0, 1.0)
  _check_float(c, 'l0_penalty_weight', 0.0)
  if c.peak_flops_per_device is not None:
    _check_float(c, 'peak_flops_per_device', 1.0)
  if c.trainable is not None:
    try:
      re.compile(c.trainable)
    except re.error as e:
      _fail('trainable', c.trainable, f'not a regular expression ({e})')
  if c.init_from is not None and not c.init_from:
    _fail('init_from', c.init_from, "expected 'DIR' or 'DIR:STEP'")

  for axis in sharding.MESH_AXES:
    _check_int(c, f'mesh.{axis}', 1, allow=(-1,))
  if [c.mesh[a] for a in sharding.MESH_AXES].count(-1) > 1:
    _fail('mesh', c.mesh.to_dict(), 'at most one axis may be -1 ("the rest")')
  rules = sharding.validate_rules(c.logical_axis_rules)
  missing = [name for name in models.LOGICAL_AXES if name not in dict(rules)]
  if missing:
    _fail('logical_axis_rules', c.logical_axis_rules,
          f'no rule for logical axes {missing} (add e.g. ({missing[0]!r}, None))')

  data_lib.as_data_config(c.data)  # every data field: 'config.data: max_length=1 must be ...'
  model = model_config(c, vocab_size=1)  # every field and every layer's attention
  if model.positions == 'learned' and c.data.max_length > model.max_length:
    _fail('model.max_length', model.max_length,
          f'learned positions need >= data.max_length={c.data.max_length}')
  if c.task == 'nmt':
    _check_int(c, 'decode.beam_size', 1)
    _check_float(c, 'decode.length_penalty', 0.0)
    _check_int(c, 'decode.max_length', 1)
    _check_int(c, 'decode.num_examples', 0, allow=(-1,))
    if model.positions == 'learned' and c.decode.max_length > model.max_length:
      _fail('decode.max_length', c.decode.max_length,
            f'must be <= model.max_length={model.max_length} with learned positions')


def shrink(config: ml_collections.ConfigDict, *, emb_dim: int = 128, num_layers: int = 2,
           num_heads: int = 4, length: int = 128, steps: int = 100,
           batch: int = 32) -> ml_collections.ConfigDict:
  """A config's tiny variant: small model, short run, frequent logs, no dropout (in place).

  What every config's `tiny` shares; each config then sets what is specific to its task.
  """
  c = config
  c.num_train_steps = steps
  c.per_device_batch_size = batch
  c.data.max_length = length
  c.model.max_length = length
  c.model.emb_dim = emb_dim
  c.model.mlp_dim = 4 * emb_dim
  c.model.attention.num_heads = num_heads
  for field in tasks.get(c.task).layer_fields:
    c.model[field] = num_layers
  c.model.dropout_rate = 0.0
  c.label_smoothing = 0.0
  c.learning_rate = 3e-3
  c.warmup_steps = 10
  c.log_every_steps = 10
  c.eval_every_steps = 0  # only at the end
  c.checkpoint_every_steps = steps // 2
  c.num_eval_steps = 4
  return c


def to_dict(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """JSON-ready nested dict (tuples become lists)."""
  return config.to_dict()


def from_dict(values: Mapping[str, Any]) -> ml_collections.ConfigDict:
  """The config a run recorded (`to_dict`, its `config.json`), on this schema.

  Fields the run did not record (added to the schema since) keep their defaults; a field the
  schema does not have is a ValueError naming it. JSON lists come back as tuples.
  """
  if values.get('task') not in tasks.TASKS:
    raise ValueError(f"config task={values.get('task')!r} is not one of {tuple(tasks.TASKS)}.")
  config = base_config(values['task'])

  def update(node, given, path):
    for name, value in given.items():
      if name not in node:
        raise ValueError(f'config.{path}{name} is not a field of this schema (a run written by '
                         'another version of lowrank_attn?).')
      if isinstance(node[name], ml_collections.ConfigDict):
        update(node[name], value, f'{path}{name}.')
      else:
        node[name] = _tuples(value)

  update(config, values, '')
  return config


def _tuples(value):
  return tuple(_tuples(v) for v in value) if isinstance(value, list) else value
