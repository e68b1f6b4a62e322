"""Mesh from config, logical rules, and parameters created directly in their shards."""

import jax
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from lowrank_attn import sharding, train
from lowrank_attn.train import config as config_lib


def test_mesh_shape_fills_the_rest_and_rejects_bad_shapes():
  assert sharding.mesh_shape({'data': -1, 'fsdp': 2, 'tensor': 1}, 8) == (4, 2, 1)
  assert sharding.mesh_shape({'data': 1, 'fsdp': -1, 'tensor': 2}, 8) == (1, 4, 2)
  with pytest.raises(ValueError, match='at most one axis may be -1'):
    sharding.mesh_shape({'data': -1, 'fsdp': -1, 'tensor': 1}, 8)
  with pytest.raises(ValueError, match='do not divide the 8 available devices'):
    sharding.mesh_shape({'data': -1, 'fsdp': 3, 'tensor': 1}, 8)
  with pytest.raises(ValueError, match='uses 4 devices but 8 are available'):
    sharding.mesh_shape({'data': 2, 'fsdp': 2, 'tensor': 1}, 8)
  mesh = sharding.make_mesh({'data': 2, 'fsdp': 2, 'tensor': 2})
  assert mesh.axis_names == sharding.MESH_AXES
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_logical_rules_map_dedupe_and_replicate_uneven_dims():
  rules = sharding.validate_rules(config_lib.DEFAULT_RULES)
  mesh = sharding.make_mesh({'data': 2, 'fsdp': 2, 'tensor': 2})
  assert sharding.logical_to_spec(('embed', 'mlp'), rules) == P('fsdp', 'tensor')
  # 'batch' takes data and fsdp; 'embed' (-> fsdp) then stays unsharded.
  assert sharding.logical_to_spec(('batch', 'length', 'embed'), rules) == P(
      ('data', 'fsdp'), None, None
  )
  # A 65-symbol vocabulary cannot be split in 2: replicated instead of failing in jit.
  assert sharding.logical_to_spec(('vocab', 'embed'), rules, (65, 32), mesh) == P(None, 'fsdp')
  with pytest.raises(ValueError, match="logical axis 'heads' has no rule"):
    sharding.logical_to_spec(('heads',), (('embed', None),))
  assert sharding.batch_spec(rules, 2) == P(('data', 'fsdp'), None)


# Shard shapes of two parameters: mlp.wi.kernel [embed 32, mlp 64] and
# self_attention.query_kernel [embed 32, heads 4, kv 8].
@pytest.mark.parametrize(
    'mesh_config,expected',
    [
        (
            {'data': 8, 'fsdp': 1, 'tensor': 1},
            {'mlp.wi.kernel': (32, 64), 'self_attention.query_kernel': (32, 4, 8)},
        ),
        (
            {'data': 1, 'fsdp': 8, 'tensor': 1},
            {'mlp.wi.kernel': (4, 64), 'self_attention.query_kernel': (4, 4, 8)},
        ),
        (
            {'data': 4, 'fsdp': 1, 'tensor': 2},
            {'mlp.wi.kernel': (32, 32), 'self_attention.query_kernel': (32, 2, 8)},
        ),
        (
            {'data': 2, 'fsdp': 2, 'tensor': 2},
            {'mlp.wi.kernel': (16, 32), 'self_attention.query_kernel': (16, 2, 8)},
        ),
    ],
)
def test_parameters_are_created_sharded(mesh_config, expected, helpers):
  config = helpers.override(helpers.load_config('lm', 'tiny'), helpers.small_model)
  for axis, size in mesh_config.items():
    config.mesh[axis] = size
  s = train.setup(config, vocab_size=64, bos_id=1)
  state = train.create_state(s)
  layer = state['params']['decoder']['layers'][0]
  for name, shard_shape in expected.items():
    node = layer
    for part in name.split('.'):
      node = node[part]
    assert len(node.addressable_shards) == 8
    assert node.addressable_shards[0].data.shape == shard_shape, name
  # Adam moments follow their parameter's sharding.
  mu = state['opt_state'][1][0].mu['decoder']['layers'][0]['mlp']['wi']['kernel']
  assert mu.sharding == layer['mlp']['wi']['kernel'].sharding
  # The same numbers whatever the mesh: init is a function of the seed only.
  one_device = helpers.override(config, {'mesh.data': 1, 'mesh.fsdp': 1, 'mesh.tensor': 1})
  one_device = train.setup(one_device, vocab_size=64, bos_id=1, devices=jax.devices()[:1])
  reference = train.create_state(one_device)['params']['decoder']['layers'][0]
  np.testing.assert_array_equal(
      np.asarray(layer['mlp']['wi']['kernel']), np.asarray(reference['mlp']['wi']['kernel'])
  )
