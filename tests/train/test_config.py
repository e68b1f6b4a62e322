"""Configs: every task config is complete and valid; bad values fail naming the field."""

import dataclasses
import os
import re
import subprocess
import sys

import pytest

from lowrank_attn import sharding
from lowrank_attn.train import config as config_lib

REQUIRED_TOP_LEVEL = (
    'num_train_steps',
    'checkpoint_every_steps',
    'eval_every_steps',
    'seed',
    'per_device_batch_size',
)


@pytest.mark.parametrize(
    'name,variant', [(n, v) for n in ('lm', 'mlm', 'nmt') for v in ('base', 'tiny')]
)
def test_task_configs_are_valid_and_documented(name, variant, helpers):
  config = helpers.load_config(name, variant)
  config_lib.validate(config)
  assert config.task == name
  for key in REQUIRED_TOP_LEVEL:
    assert key in config, key
  doc = (helpers.root / 'configs' / f'{name}.py').read_text()
  assert f'python -m lowrank_attn.main --config=configs/{name}.py:tiny' in doc
  assert 'Measured:' in doc and 'wall' in doc  # the tiny variant's measured runtime
  assert 'Result' in doc or 'eval loss' in doc


def test_unknown_variant_is_rejected(helpers):
  with pytest.raises(ValueError, match='unknown variant'):
    helpers.load_config('lm', 'huge')


@pytest.mark.parametrize(
    'field,value,message',
    [
        ('num_train_steps', 0, r'config\.num_train_steps=0'),
        ('lr_schedule', 'exp', r'config\.lr_schedule=.exp.'),
        ('mesh.data', 0, r'config\.mesh\.data=0'),
        ('model.norm', 'sandwich', r"config\.model: norm='sandwich'"),
        ('model.dtype', 'float16', r"config\.model: dtype='float16'"),
        ('model.encoder_attention.kind', 'linear', r'config\.model\.encoder_attention: .*linear'),
        ('model.attention.kind', 'fixed_head', r'config\.model\.attention: .*head_dim'),
        (
            'model.cross_attention.num_heads',
            3,
            r'config\.model: cross_attention \(layer 0\): .*divisible',
        ),
        # Found only by building the gates (this used to pass validation and crash later).
        ('model.attention.gate_temperature', 0.0, r'config\.model\.attention: .*temperature'),
        (
            'model.decoder_attention.num_heads',
            (4, 4, 2),
            r'decoder_attention\.num_heads=\(4, 4, 2\) gives 3 layers, the model has 2',
        ),
        ('model.max_length', 16, r'config\.model\.max_length=16 .*data\.max_length'),
        ('logical_axis_rules', (('batch', 'data'),), r'no rule for logical axes'),
        ('logical_axis_rules', (('batch', 'model'),), r"'model', which is not a mesh axis"),
    ],
)
def test_invalid_values_name_the_field(field, value, message, helpers):
  config = helpers.load_config('nmt', 'tiny')
  node = config
  *parents, leaf = field.split('.')
  for p in parents:
    node = node[p]
  node[leaf] = value
  with pytest.raises(ValueError, match=message):
    config_lib.validate(config)


def test_per_type_overrides_resolve_one_line_changes(helpers):
  config = helpers.load_config('nmt', 'tiny')
  config.model.encoder_attention.kind = 'collaborative'  # collaborative keys, encoder only
  config.model.attention.gated = True  # gates on all three
  config_lib.validate(config)
  model = config_lib.model_config(config, vocab_size=100)
  assert model.encoder_attention.kind == 'collaborative'
  assert model.decoder_attention.kind == model.cross_attention.kind == 'concat'
  assert model.encoder_attention.gated and model.decoder_attention.gated
  assert model.cross_attention.gated


def test_per_layer_head_counts_and_options_from_the_schema(helpers):
  config = helpers.load_config('nmt', 'tiny')
  config.model.encoder_attention.num_heads = (4, 2)  # e.g. a pruned encoder
  config.model.decoder_attention.num_kv_heads = 2  # kernel options are config fields
  config.model.attention.normalize_qk = True
  config_lib.validate(config)
  model = config_lib.model_config(config, vocab_size=100)
  assert [model.attention('encoder', i).num_heads for i in range(2)] == [4, 2]
  assert model.attention('decoder', 0).num_kv_heads == 2
  assert model.attention('cross', 1).normalize_qk


def _main(root, *args):
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  return subprocess.run(
      [sys.executable, '-m', 'lowrank_attn.main', *args],
      cwd=root,
      env=env,
      capture_output=True,
      text=True,
      timeout=120,
  )


def test_command_line_rejects_unknown_and_invalid_fields(tmp_path, helpers):
  unknown = _main(
      helpers.root,
      '--config=configs/nmt.py:tiny',
      f'--workdir={tmp_path}',
      '--config.model.encoder_attention.kindd=collaborative',
  )
  assert unknown.returncode == 2  # bad input
  assert 'unknown field kindd Did you mean "kind"' in unknown.stderr
  assert 'Traceback' not in unknown.stderr
  invalid = _main(
      helpers.root,
      '--config=configs/nmt.py:tiny',
      f'--workdir={tmp_path}',
      '--config.model.encoder_attention.kind=collab',
  )
  assert invalid.returncode == 2
  assert "config.model.encoder_attention: kind='collab' is not one of" in invalid.stderr
  assert not os.listdir(tmp_path)  # rejected before anything was written


# A bad value of every TrainConfig field (one that the ConfigDict's own type check lets
# through where it can be set from the command line).
BAD_TRAIN_VALUES = {
    'init_from': '',
    'trainable': '(',
    'seed': -1,
    'num_train_steps': 0,
    'per_device_batch_size': 0,
    'grad_accum_steps': 0,
    'log_every_steps': 0,
    'progress_every_secs': -1.0,
    'eval_every_steps': -1,
    'num_eval_steps': 0,
    'eval_split': '',
    'checkpoint_every_steps': 0,
    'keep_checkpoints': 0,
    'async_checkpointing': 'yes',
    'learning_rate': -1e-3,
    'gate_learning_rate': -0.05,
    'lr_schedule': 'exp',
    'warmup_steps': -1,
    'end_learning_rate_factor': 1.5,
    'weight_decay': -0.1,
    'adam_b1': 1.0,
    'adam_b2': 1.0,
    'adam_eps': -1e-9,
    'grad_clip_norm': -1.0,
    'label_smoothing': 1.0,
    'l0_penalty_weight': -1.0,
    'mesh': {'data': 2, 'pipeline': 2},
    'logical_axis_rules': (('batch', 'data'),),
    'jax_distributed': 1,
    'coordinator_address': '',
    'num_processes': 0,
    'process_id': -1,
    'max_steps_in_flight': 0,
    'peak_flops_per_device': 0.5,
}


def test_every_train_field_has_a_bad_value_case():
  assert set(BAD_TRAIN_VALUES) == {f.name for f in dataclasses.fields(config_lib.TrainConfig)}
  assert tuple(f.name for f in dataclasses.fields(config_lib.MeshConfig)) == sharding.MESH_AXES


@pytest.mark.parametrize('field', BAD_TRAIN_VALUES)
def test_bad_train_values_name_the_field(field):
  value = BAD_TRAIN_VALUES[field]
  with pytest.raises(ValueError, match=rf'^config\.{field}={re.escape(repr(value))} is invalid'):
    config_lib.TrainConfig(**{field: value})


@pytest.mark.parametrize(
    'mesh,message',
    [
        ({'data': 0}, r'config\.mesh\.data=0 is invalid'),
        ({'fsdp': -2}, r'config\.mesh\.fsdp=-2 is invalid'),
        ({'tensor': 1.5}, r'config\.mesh\.tensor=1\.5 is invalid'),
        ({'data': -1, 'tensor': -1}, r"config\.mesh=\{'data': -1, 'fsdp': 1, 'tensor': -1\} .*-1"),
    ],
)
def test_bad_mesh_values_name_the_axis(mesh, message):
  with pytest.raises(ValueError, match=message):
    config_lib.TrainConfig(mesh=mesh)


def test_process_id_must_be_below_num_processes(helpers):
  config = helpers.load_config('lm', 'tiny')
  config.num_processes, config.process_id = 2, 2
  with pytest.raises(ValueError, match=r'config\.process_id=2 .*num_processes=2'):
    config_lib.validate(config)


@pytest.mark.parametrize('name', ['lm', 'mlm', 'nmt'])
def test_train_fields_derive_from_the_dataclass(name):
  """base_config's training entries are TrainConfig's fields at their defaults, and the
  optional ones take a value of their type from the command line (typed placeholders)."""
  config = config_lib.base_config(name)
  assert config_lib.train_config(config) == config_lib.TrainConfig()
  assert config.mesh.to_dict() == dataclasses.asdict(config_lib.MeshConfig())
  for field, kind in (
      ('init_from', str),
      ('trainable', str),
      ('coordinator_address', str),
      ('num_processes', int),
      ('process_id', int),
      ('peak_flops_per_device', float),
  ):
    assert config[field] is None and config.get_type(field) is kind, field
