"""The configuration schema: every field, its default and what it means (commented once, here).

Task configs (`configs/lm.py`, `configs/mlm.py`, `configs/nmt.py`) start from
`base_config(task)` and change values; they cannot add fields (the ConfigDict is locked, so a
typo such as `--config.modle.emb_dim=8` fails at once). `validate(config)` checks values and
raises a `ValueError` naming the field before any data is read or any device is touched.

Attention settings are given once in `model.attention` and overridden per attention type in
`model.encoder.attention`, `model.decoder.attention` and `model.decoder.cross_attention`, whose
fields are None ("inherit") unless set. So
    --config.model.attention.gated=True                        gates on all three types
    --config.model.encoder.attention.kind=collaborative        collaborative encoder only
"""

from typing import Any

import jax.numpy as jnp
import ml_collections
from ml_collections import config_dict

from lowrank_attn import data as data_lib
from lowrank_attn import models
from lowrank_attn.attention import AttentionSpec
from lowrank_attn.train import optim, sharding

TASKS = ('lm', 'mlm', 'nmt')
DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}

# Attention fields: default value (model.attention) and type (for the per-type overrides).
_ATTENTION_FIELDS: dict[str, tuple[Any, type]] = {
    'kind': ('concat', str),  # 'concat' | 'fixed_head' | 'collaborative' | 'talking_heads'
    'num_heads': (8, int),
    'qkv_features': (None, int),  # total q/k/v width; None: model.emb_dim
    'head_dim': (None, int),  # per-head width; required by 'fixed_head'
    'key_dim': (None, int),  # 'collaborative': shared query/key width (None: full)
    'mixing_init': ('concatenate', str),  # 'collaborative': 'concatenate'|'all_ones'|'random'
    'logit_scale': (None, float),  # None: 1/sqrt(per-head query/key width)
    'gated': (False, bool),  # hard-concrete head gates (Voita et al. 2019)
    'gate_temperature': (0.33, float),
    'gate_log_alpha_init': (3.0, float),  # 3.0: every gate starts fully open
    'dropout_rate': (0.0, float),  # dropout on the attention weights
}

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


def _placeholder(value, kind):
  return config_dict.placeholder(kind) if value is None else value


def _attention_defaults() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(
      {name: _placeholder(value, kind) for name, (value, kind) in _ATTENTION_FIELDS.items()})


def _attention_overrides() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(
      {name: config_dict.placeholder(kind) for name, (_, kind) in _ATTENTION_FIELDS.items()})


def base_config(task: str) -> ml_collections.ConfigDict:
  """All fields with their defaults (Transformer-base sizes); locked against new keys."""
  if task not in TASKS:
    raise ValueError(f'task={task!r} is not one of {TASKS}.')
  c = ml_collections.ConfigDict()
  c.task = task  # 'lm' (decoder-only), 'mlm' (BERT-style encoder), 'nmt' (encoder-decoder)

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
  c.l0_penalty_weight = 0.0  # lambda of Voita et al.: loss += lambda x expected open gates

  # ---- Devices and parallelism (lowrank_attn/train/sharding.py).
  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1  # data-parallel ways; -1: the devices the other axes leave
  c.mesh.fsdp = 1  # parameter/optimizer-state sharding ways (splits the batch too)
  c.mesh.tensor = 1  # tensor-parallel ways (heads, MLP width, vocabulary)
  c.logical_axis_rules = DEFAULT_RULES  # logical axis -> mesh axes (None: replicated)
  c.jax_distributed = False  # call jax.distributed.initialize() (multi-host TPU / GPU)
  c.peak_flops_per_device = config_dict.placeholder(float)  # for MFU; None: measure matmuls

  # ---- Data: the fields of `lowrank_attn.data.make_pipeline` (documented there), i.e.
  # name, task, data_dir, tfds_data_dir, max_length, tokenizer, vocab_size,
  # sentencepiece_model_type, vocab_path, tokenizer_path, tokenizer_max_corpus_chars,
  # source_lang, target_lang, packing, mlm_probability, num_workers.
  c.data = data_lib.default_data_config(task=task, packing=task != 'nmt')

  # ---- Model (lowrank_attn/models).
  c.model = ml_collections.ConfigDict()
  c.model.emb_dim = 512  # D, the residual stream width
  c.model.mlp_dim = 2048  # hidden width of the feed-forward blocks
  c.model.max_length = 256  # position table size / longest decoded sequence
  c.model.positions = 'learned'  # 'learned' | 'sinusoidal'
  c.model.norm = 'pre'  # 'pre' (x + f(LN x)) | 'post' (LN(x + f(x)): Vaswani, BERT)
  c.model.activation = 'gelu'  # 'gelu' | 'relu'
  c.model.dropout_rate = 0.1  # embeddings and residual branches
  c.model.tie_embeddings = True  # output layer = transposed token embeddings
  c.model.scale_embeddings = True  # token embeddings x sqrt(D) (False for BERT weights)
  c.model.layer_norm_epsilon = 1e-6
  c.model.dtype = 'float32'  # computation dtype: 'float32' | 'bfloat16' (params stay float32)
  c.model.type_vocab_size = 0  # mlm: BERT token-type embeddings (2 for BERT); 0: none
  c.model.attention = _attention_defaults()  # every attention type, unless overridden below
  if task in ('mlm', 'nmt'):
    c.model.encoder = ml_collections.ConfigDict()
    c.model.encoder.num_layers = 6
    c.model.encoder.attention = _attention_overrides()  # encoder self-attention
  if task in ('lm', 'nmt'):
    c.model.decoder = ml_collections.ConfigDict()
    c.model.decoder.num_layers = 6
    c.model.decoder.attention = _attention_overrides()  # decoder (causal) self-attention
    if task == 'nmt':
      c.model.decoder.cross_attention = _attention_overrides()  # encoder-decoder attention

  # ---- Decoding and BLEU during evaluation (nmt).
  c.decode = ml_collections.ConfigDict()
  c.decode.beam_size = 4  # 1: greedy
  c.decode.length_penalty = 0.6  # alpha of Wu et al. (2016): score / ((5 + len) / 6)^alpha
  c.decode.max_length = 128  # longest translation, in tokens (<= model.max_length)
  c.decode.num_examples = 256  # eval sentences translated for BLEU; -1: all, 0: none

  c.lock()
  return c


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


def attention_fields(config, attention_type: str) -> tuple[str, dict[str, Any]]:
  """(config path, resolved fields) of one attention type: defaults + its overrides."""
  path = {'encoder': 'model.encoder.attention', 'decoder': 'model.decoder.attention',
          'cross': 'model.decoder.cross_attention'}[attention_type]
  fields = dict(config.model.attention)
  fields.update({k: v for k, v in _get(config, path).items() if v is not None})
  return path, fields


def attention_types(task: str) -> tuple[str, ...]:
  return {'lm': ('decoder',), 'mlm': ('encoder',), 'nmt': ('encoder', 'decoder', 'cross')}[task]


def validate(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the first invalid field; returns None if all are valid."""
  c = config
  _check_choice(c, 'task', TASKS)
  if c.data.task != c.task:
    _fail('data.task', c.data.task, f'must equal config.task={c.task!r}')
  for field in ('num_train_steps', 'per_device_batch_size', 'grad_accum_steps',
                'log_every_steps', 'checkpoint_every_steps', 'keep_checkpoints'):
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

  for axis in sharding.MESH_AXES:
    _check_int(c, f'mesh.{axis}', 1, allow=(-1,))
  if [c.mesh[a] for a in sharding.MESH_AXES].count(-1) > 1:
    _fail('mesh', c.mesh.to_dict(), 'at most one axis may be -1 ("the rest")')
  rules = sharding.validate_rules(c.logical_axis_rules)
  missing = [name for name in models.LOGICAL_AXES if name not in dict(rules)]
  if missing:
    _fail('logical_axis_rules', c.logical_axis_rules,
          f'no rule for logical axes {missing} (add e.g. ({missing[0]!r}, None))')

  # The data package validates its own fields when the pipeline is built; the model needs:
  _check_int(c, 'data.max_length', 2)

  m = c.model
  for field in ('emb_dim', 'mlp_dim', 'max_length'):
    _check_int(c, f'model.{field}', 1)
  _check_int(c, 'model.type_vocab_size', 0)
  _check_choice(c, 'model.positions', models.config.POSITIONS)
  _check_choice(c, 'model.norm', models.config.NORMS)
  _check_choice(c, 'model.activation', models.config.ACTIVATIONS)
  _check_choice(c, 'model.dtype', DTYPES)
  _check_float(c, 'model.dropout_rate', 0.0, 1.0)
  _check_float(c, 'model.layer_norm_epsilon', 0.0)
  if m.positions == 'learned' and c.data.max_length > m.max_length:
    _fail('model.max_length', m.max_length,
          f'learned positions need >= data.max_length={c.data.max_length}')
  for stack in ('encoder', 'decoder'):
    if stack in m:
      _check_int(c, f'model.{stack}.num_layers', 1)
  for attention_type in attention_types(c.task):
    path, fields = attention_fields(c, attention_type)
    try:
      models.AttentionConfig(**fields)
      AttentionSpec(num_heads=fields['num_heads'], in_features=m.emb_dim, kind=fields['kind'],
                    qkv_features=fields['qkv_features'], head_dim=fields['head_dim'],
                    key_dim=fields['key_dim'], logit_scale=fields['logit_scale'],
                    gated=fields['gated'])
    except (ValueError, TypeError) as e:
      shown = {k: v for k, v in fields.items() if v is not None}
      raise ValueError(f'config.{path} is invalid: {e} (settings after merging '
                       f'config.model.attention with config.{path}: {shown})') from None

  if c.task == 'nmt':
    _check_int(c, 'decode.beam_size', 1)
    _check_float(c, 'decode.length_penalty', 0.0)
    _check_int(c, 'decode.max_length', 1)
    _check_int(c, 'decode.num_examples', 0, allow=(-1,))
    if m.positions == 'learned' and c.decode.max_length > m.max_length:
      _fail('decode.max_length', c.decode.max_length,
            f'must be <= model.max_length={m.max_length} with learned positions')


def model_config(config: ml_collections.ConfigDict, vocab_size: int) -> models.TransformerConfig:
  """The models' `TransformerConfig` for a (validated) task config and a vocabulary size."""
  m = config.model
  attention = {}
  for attention_type in models.ATTENTION_TYPES:
    if attention_type in attention_types(config.task):
      attention[attention_type] = models.AttentionConfig(
          **attention_fields(config, attention_type)[1])
    else:
      attention[attention_type] = models.AttentionConfig()
  return models.TransformerConfig(
      vocab_size=vocab_size, emb_dim=m.emb_dim, mlp_dim=m.mlp_dim,
      num_encoder_layers=m.encoder.num_layers if 'encoder' in m else 0,
      num_decoder_layers=m.decoder.num_layers if 'decoder' in m else 0,
      encoder_attention=attention['encoder'], decoder_attention=attention['decoder'],
      cross_attention=attention['cross'], max_length=m.max_length, positions=m.positions,
      norm=m.norm, activation=m.activation, dropout_rate=m.dropout_rate,
      tie_embeddings=m.tie_embeddings, scale_embeddings=m.scale_embeddings,
      type_vocab_size=m.type_vocab_size, layer_norm_epsilon=m.layer_norm_epsilon,
      dtype=DTYPES[m.dtype], param_dtype=jnp.float32)


def to_dict(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """JSON-ready nested dict (tuples become lists)."""
  return config.to_dict()

