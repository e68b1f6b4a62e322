"""The configuration schema: every field, its default and what it means (documented once).

Task configs (`configs/lm.py`, `configs/mlm.py`, `configs/nmt.py`) start from
`base_config(task)` and change values; they cannot add fields (the ConfigDict is locked, so a
typo such as `--config.modle.emb_dim=8` fails at once). `validate(config)` checks values and
raises a `ValueError` naming the field before any data is read or any device is touched.

The training fields are those of `TrainConfig` below (`MeshConfig` for `config.mesh`) and
are documented there. The `model` fields are derived from the dataclasses
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
import dataclasses
import importlib.util
import os
import re
from typing import Any

import ml_collections

from lowrank_attn import data as data_lib
from lowrank_attn import tasks
from lowrank_attn import models, schema, sharding
from lowrank_attn.attention import AttentionSpec
from lowrank_attn.attention.spec import SIZE_FIELDS
from lowrank_attn.train import optim

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


# ---------------------------------------------------------------------------- training fields


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """`config.mesh`: the ways of each mesh axis (`lowrank_attn.sharding.MESH_AXES`)."""

  data: int = -1  # data-parallel ways; -1: the devices the other axes leave
  fsdp: int = 1  # parameter/optimizer-state sharding ways (splits the batch too)
  tensor: int = 1  # tensor-parallel ways (heads, MLP width, vocabulary)

  def __post_init__(self):
    for field in dataclasses.fields(self):
      _require_int(f'mesh.{field.name}', getattr(self, field.name), 1, allow=(-1,))
    if dataclasses.astuple(self).count(-1) > 1:
      _fail('mesh', dataclasses.asdict(self), 'at most one axis may be -1 ("the rest")')


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """The top-level training fields of the config: warm start, run length and cadence,
  optimisation, devices.

  Declared once, here: `base_config` derives the config's entries (these defaults) and
  `validate` builds one (`train_config`). A bad value is a ValueError naming the config field
  and its value: 'config.num_train_steps=0 is invalid: expected an integer >= 1.'
  """

  # Warm start: 'DIR' or 'DIR:STEP', another run whose parameters initialise this one (matched
  # by parameter path; not its optimizer state or step). New parameters keep their init.
  init_from: str | None = None
  # Regular expression over parameter paths ('encoder/layers/0/self_attention/query_kernel'):
  # only matching parameters train, the others stay bitwise unchanged. None: all train.
  trainable: str | None = None

  # ---- Run length, batches, cadence. Steps count optimizer updates.
  seed: int = 0  # parameters from key(seed); dropout key of step s: fold_in(key(seed + 1), s)
  num_train_steps: int = 100_000
  per_device_batch_size: int = 32  # global batch = this x number of devices (x grad_accum_steps)
  grad_accum_steps: int = 1  # micro-batches averaged per update (same result, less memory)
  log_every_steps: int = 50  # train metrics to TensorBoard / metrics.jsonl; NaN check
  progress_every_secs: float = 5.0  # the console progress line
  eval_every_steps: int = 2_000  # evaluation (the task's evaluators); 0: only at the end
  num_eval_steps: int = -1  # eval batches per evaluation; -1: the whole eval split
  eval_split: str = 'validation'  # the data split evaluated during training
  checkpoint_every_steps: int = 2_000  # also saved at the end and on SIGTERM
  keep_checkpoints: int = 3  # the last K checkpoints are kept
  async_checkpointing: bool = True  # write checkpoints in the background

  # ---- Optimisation: AdamW, warmup then decay (lowrank_attn/train/optim.py).
  learning_rate: float = 1e-3  # peak learning rate, reached after warmup
  # Peak learning rate of head gates (Voita et al.), same schedule; None: learning_rate. A
  # fine-tune's rate (e.g. 5e-5) moves a gate's log-alpha too little for any gate to close.
  gate_learning_rate: float | None = None
  lr_schedule: str = 'inverse_sqrt'  # after warmup: 'inverse_sqrt'|'cosine'|'linear'|'constant'
  warmup_steps: int = 4_000  # linear warmup from 0
  end_learning_rate_factor: float = 0.0  # cosine/linear end at learning_rate x this
  # AdamW decoupled decay of kernels and embeddings; never of biases, norms, gates or head
  # mixing (`optim.PARAMETER_ROLES`).
  weight_decay: float = 0.0
  adam_b1: float = 0.9
  adam_b2: float = 0.98
  adam_eps: float = 1e-9
  grad_clip_norm: float = 1.0  # global-norm clipping; 0: off
  label_smoothing: float = 0.0  # e.g. 0.1 for translation (Vaswani et al.)
  # lambda of Voita et al. (2019): loss += lambda x (expected open gates summed over heads,
  # averaged over gated attention layers), as in their code; see models' aux['l0_penalty'].
  l0_penalty_weight: float = 0.0

  # ---- Devices and parallelism (lowrank_attn/sharding.py).
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)  # also a mapping of axes
  logical_axis_rules: sharding.Rules = DEFAULT_RULES  # logical axis -> mesh axes (None: replicated)
  jax_distributed: bool = False  # call jax.distributed.initialize() (multi-host TPU / GPU)
  # Explicit cluster for jax.distributed.initialize(); None: auto-detected (TPU, SLURM, ...).
  coordinator_address: str | None = None  # 'host:port' of process 0
  num_processes: int | None = None
  process_id: int | None = None
  # Steps dispatched ahead of the host: bounds how long a SIGTERM waits for the save.
  max_steps_in_flight: int = 2
  peak_flops_per_device: float | None = None  # for MFU; None: the published peak (CPU: no MFU)

  def __post_init__(self):
    if self.init_from is not None and (not isinstance(self.init_from, str) or not self.init_from):
      _fail('init_from', self.init_from, "expected 'DIR' or 'DIR:STEP'")
    if self.trainable is not None:
      try:
        re.compile(self.trainable)
      except (re.error, TypeError) as e:
        _fail('trainable', self.trainable, f'not a regular expression ({e})')
    for name in (
        'num_train_steps',
        'per_device_batch_size',
        'grad_accum_steps',
        'log_every_steps',
        'checkpoint_every_steps',
        'keep_checkpoints',
        'max_steps_in_flight',
    ):
      _require_int(name, getattr(self, name), 1)
    _require_int('seed', self.seed, 0)
    _require_int('eval_every_steps', self.eval_every_steps, 0)
    _require_int('num_eval_steps', self.num_eval_steps, 1, allow=(-1,))
    _require_number('progress_every_secs', self.progress_every_secs, 0.0)
    if not isinstance(self.eval_split, str) or not self.eval_split:
      _fail('eval_split', self.eval_split, "expected a split name such as 'validation'")
    for name in ('async_checkpointing', 'jax_distributed'):
      if not isinstance(getattr(self, name), bool):
        _fail(name, getattr(self, name), 'expected True or False')

    _require_number('learning_rate', self.learning_rate, 0.0)
    if self.gate_learning_rate is not None:
      _require_number('gate_learning_rate', self.gate_learning_rate, 0.0)
      if not self.learning_rate > 0:
        _fail(
            'gate_learning_rate',
            self.gate_learning_rate,
            'needs learning_rate > 0 (it scales the updates learning_rate gives)',
        )
    if self.lr_schedule not in optim.SCHEDULES:
      _fail('lr_schedule', self.lr_schedule, f'expected one of {optim.SCHEDULES}')
    _require_int('warmup_steps', self.warmup_steps, 0)
    _require_number(
        'end_learning_rate_factor', self.end_learning_rate_factor, 0.0, 1.0, high_inclusive=True
    )
    _require_number('weight_decay', self.weight_decay, 0.0)
    _require_number('adam_b1', self.adam_b1, 0.0, 1.0)
    _require_number('adam_b2', self.adam_b2, 0.0, 1.0)
    _require_number('adam_eps', self.adam_eps, 0.0)
    _require_number('grad_clip_norm', self.grad_clip_norm, 0.0)
    _require_number('label_smoothing', self.label_smoothing, 0.0, 1.0)
    _require_number('l0_penalty_weight', self.l0_penalty_weight, 0.0)

    if isinstance(self.mesh, Mapping):
      unknown = sorted(set(self.mesh) - {f.name for f in dataclasses.fields(MeshConfig)})
      if unknown:
        _fail('mesh', dict(self.mesh), f'unknown axes {unknown}; valid: {sharding.MESH_AXES}')
      object.__setattr__(self, 'mesh', MeshConfig(**self.mesh))
    if not isinstance(self.mesh, MeshConfig):
      _fail('mesh', self.mesh, 'expected a MeshConfig or a mapping of mesh axes to ways')
    rules = sharding.validate_rules(self.logical_axis_rules)
    missing = [name for name in models.LOGICAL_AXES if name not in dict(rules)]
    if missing:
      _fail(
          'logical_axis_rules',
          self.logical_axis_rules,
          f'no rule for logical axes {missing} (add e.g. ({missing[0]!r}, None))',
      )
    if self.coordinator_address is not None and (
        not isinstance(self.coordinator_address, str) or not self.coordinator_address
    ):
      _fail('coordinator_address', self.coordinator_address, "expected 'host:port' or None")
    if self.num_processes is not None:
      _require_int('num_processes', self.num_processes, 1)
    if self.process_id is not None:
      _require_int('process_id', self.process_id, 0)
      if self.num_processes is not None and self.process_id >= self.num_processes:
        _fail(
            'process_id', self.process_id, f'expected < config.num_processes={self.num_processes}'
        )
    if self.peak_flops_per_device is not None:
      _require_number('peak_flops_per_device', self.peak_flops_per_device, 1.0)


def train_config(config: ml_collections.ConfigDict) -> TrainConfig:
  """The `TrainConfig` of a config's top-level fields; a ValueError names the first bad one."""
  values = {field.name: config[field.name] for field in dataclasses.fields(TrainConfig)}
  return TrainConfig(**{**values, 'mesh': schema.values_of(config.mesh)})


def _model_exclude(task: tasks.Task) -> tuple[str, ...]:
  """TransformerConfig fields that are not config entries: set from data, or unused by task."""
  layer_fields = ('num_encoder_layers', 'num_decoder_layers')
  return (
      'vocab_size',
      *(f'{t}_attention' for t in models.ATTENTION_TYPES),
      *(f for f in layer_fields if f not in task.layer_fields),
  )


def _model_config_dict(task: tasks.Task) -> ml_collections.ConfigDict:
  model = schema.config_dict(
      models.TransformerConfig,
      exclude=_model_exclude(task),
      **{field: 6 for field in task.layer_fields},
  )  # Transformer-base
  default = models.config.DEFAULT_ATTENTION.options()
  model.attention = schema.config_dict(AttentionSpec, exclude=SIZE_FIELDS, **default)
  for attention_type in task.attention_types:
    model[f'{attention_type}_attention'] = schema.config_dict(
        AttentionSpec, exclude=SIZE_FIELDS, inherit=True
    )
  return model


def base_config(task: str) -> ml_collections.ConfigDict:
  """All fields with their defaults (Transformer-base sizes); locked against new keys."""
  task_record = tasks.get(task)
  c = schema.config_dict(TrainConfig)  # the training fields (documented in TrainConfig)
  # A module of lowrank_attn/tasks/: 'lm' (decoder-only), 'mlm' (BERT-style encoder), 'nmt'
  # (encoder-decoder), 'glue' (encoder + classifier).
  c.task = task

  # ---- Data: the fields of `lowrank_attn.data.DataConfig` (documented there).
  c.data = data_lib.default_data_config(task=task)

  # ---- Model: the fields of `lowrank_attn.models.TransformerConfig` and, per attention type,
  # of `lowrank_attn.attention.AttentionSpec` (documented there; see the module docstring).
  c.model = _model_config_dict(task_record)

  # ---- The task's own groups (`Task.settings`, documented in its module): `decode` for
  # nmt (beam search and BLEU), `glue` for glue (the classifier).
  for name, settings in task_record.settings.items():
    c[name] = schema.config_dict(settings)

  c.lock()
  return c


def load(spec: str) -> ml_collections.ConfigDict:
  """The config of `'configs/nmt.py:multi30k'` (file, optional variant), as `--config=` loads it."""
  path, _, variant = spec.partition(':')
  if not os.path.isfile(path):
    raise ValueError(f'config file {path!r} (from {spec!r}) does not exist.')
  module_spec = importlib.util.spec_from_file_location(
      'lowrank_attn_config_' + os.path.basename(path).removesuffix('.py'), path
  )
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(variant) if variant else module.get_config()


# ---------------------------------------------------------------------------- validation


def _fail(field: str, value, expected: str):
  raise ValueError(f'config.{field}={value!r} is invalid: {expected}.')


def _require_int(field: str, value, minimum: int, allow: tuple = ()):
  if value in allow and not isinstance(value, bool):
    return
  if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
    _fail(
        field, value, f'expected an integer >= {minimum}' + (f' or one of {allow}' if allow else '')
    )


def _require_number(
    field: str, value, low: float, high: float | None = None, *, high_inclusive: bool = False
):
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
  values = {
      k: v
      for k, v in schema.values_of(config.model).items()
      if k != 'attention' and not k.endswith('_attention')
  }
  for attention_type in models.ATTENTION_TYPES:
    if attention_type in task.attention_types:
      path = f'model.{attention_type}_attention'
      values[f'{attention_type}_attention'] = schema.build(
          AttentionSpec, attention_options(config, attention_type), path
      )
  for field in ('num_encoder_layers', 'num_decoder_layers'):
    values.setdefault(field, 0)  # the task has no such stack
  return schema.build(models.TransformerConfig, values, 'model', vocab_size=vocab_size)


def validate(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the first invalid field; returns None if all are valid."""
  c = config
  _check_choice(c, 'task', tuple(tasks.TASKS))
  task = tasks.get(c.task)
  if c.data.task != c.task:
    _fail('data.task', c.data.task, f'must equal config.task={c.task!r}')
  train_config(c)  # the training fields: 'config.num_train_steps=0 is invalid: ...'

  data_config = data_lib.as_data_config(c.data)  # 'config.data: max_length=1 must be ...'
  try:
    task.data_format.check_config(data_config)
    data_config.extra_test_splits(len(task.data_format.file_features(data_config, None)))
  except ValueError as e:
    raise ValueError(f'config.data: {e}') from None
  for name, settings in task.settings.items():
    schema.build(settings, schema.values_of(c[name]), name)
  model = model_config(c, vocab_size=1)  # every field and every layer's attention
  if model.positions == 'learned' and c.data.max_length > model.max_length:
    _fail(
        'model.max_length',
        model.max_length,
        f'learned positions need >= data.max_length={c.data.max_length}',
    )
  task.check_config(c)


def shrink(
    config: ml_collections.ConfigDict,
    *,
    emb_dim: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    length: int = 128,
    steps: int = 100,
    batch: int = 32,
) -> ml_collections.ConfigDict:
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
  schema does not have, a value of the wrong type and anything but a JSON object where a group
  of fields belongs are each a ValueError naming the field. JSON lists come back as tuples.
  Runs written before the task refactor recorded a `decode` group for every task; where the
  task has none, it is dropped.
  """
  if not isinstance(values, Mapping):
    raise ValueError(
        f'a config is a mapping of fields (a JSON object), not a ' f'{type(values).__name__}.'
    )
  task = values.get('task')
  if not isinstance(task, str) or task not in tasks.TASKS:
    raise ValueError(f'config task={task!r} is not one of {tuple(tasks.TASKS)}.')
  config = base_config(task)
  if 'decode' in values and 'decode' not in config:
    values = {k: v for k, v in values.items() if k != 'decode'}

  def update(node, given, path):
    if not isinstance(given, Mapping):
      raise ValueError(
          f'config.{path.removesuffix(".")}={given!r} is invalid: expected a group '
          'of fields (a JSON object).'
      )
    for name, value in given.items():
      if name not in node:
        raise ValueError(
            f'config.{path}{name} is not a field of this schema (a run written by '
            'another version of lowrank_attn?).'
        )
      if isinstance(node[name], ml_collections.ConfigDict):
        update(node[name], value, f'{path}{name}.')
      else:
        try:
          node[name] = _tuples(value)
        except (TypeError, ValueError) as e:  # ConfigDict's type check
          raise ValueError(
              f'config.{path}{name}={value!r} is invalid: ' f'{" ".join(str(e).split())}'
          ) from None

  update(config, values, '')
  return config


def _tuples(value):
  return tuple(_tuples(v) for v in value) if isinstance(value, list) else value
