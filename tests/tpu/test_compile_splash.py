"""implementation='splash' compiles inside the real train step for a TPU slice.

Packed translation: the encoder, the causal decoder and the cross-attention all pass (query,
key) segment ids to the Pallas splash kernel, which Mosaic compiles for TPU (under the data
parallel mesh's `shard_map`). Needs libtpu, as tests/tpu/test_compile.py.
"""

import importlib
import importlib.util
import pathlib

import pytest

from lowrank_attn.train import config as config_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec('libtpu') is None,
    reason="libtpu is not installed (pip install -e '.[tpu]', or run `make test-tpu`)",
)


@needs_libtpu
@pytest.mark.slow
def test_tiny_nmt_with_splash_compiles_for_v5e_2x2(tmp_path):
  tool = importlib.import_module('tpu.compile')  # imported here: it loads the whole trainer
  config = config_lib.load(f'{ROOT}/configs/nmt.py:tiny')
  assert config.data.packing  # segment ids in every attention type
  config.model.attention.implementation = 'splash'
  report = tool.compile_train_step(
      config, 'v5e:2x2', name='nmt:tiny splash', dump_hlo=str(tmp_path)
  )
  print(report.describe())
  assert report.num_chips == 4 and report.mesh == {'data': 4, 'fsdp': 1, 'tensor': 1}
  assert 0 < report.hbm_bytes < tool.chips.CHIPS['v5e'].hbm_bytes
  assert 0 < report.step_secs < 1.0
  # The kernel is in the program: Mosaic custom calls (forward and backward), no [q, kv]
  # attention weights.
  hlo = (tmp_path / 'train_step.hlo.txt').read_text()
  assert 'tpu_custom_call' in hlo


@needs_libtpu
@pytest.mark.slow
def test_xla_cost_analysis_leaves_the_splash_kernel_out():
  """Why tpu/compile.py adds splash's FLOPs back (`Report.kernel_flops`): libtpu's cost model
  answers no FLOPs and no time for a program that is one splash call, while it counts the
  same attention written as einsums. If a jax or libtpu update makes it count the kernel
  (splash given a `pl.CostEstimate`), this fails: drop the correction then."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  tool = importlib.import_module('tpu.compile')
  from lowrank_attn.attention import fused

  devices, chip = tool.topology_devices('v5e:2x2')
  mesh = jax.sharding.Mesh(devices[:1], ('x',))
  batch, length, heads, head_dim = 2, 512, 4, 128
  spec = jax.ShapeDtypeStruct(
      (batch, length, heads, head_dim), jnp.bfloat16, sharding=NamedSharding(mesh, P())
  )

  def einsums(q, k, v):
    logits = jnp.einsum('bqhd,bkhd->bhqk', q, k, preferred_element_type=jnp.float32)
    return jnp.einsum('bhqk,bkhd->bqhd', jax.nn.softmax(logits).astype(q.dtype), v)

  def cost(fn):
    analysis = jax.jit(fn).lower(spec, spec, spec).compile().cost_analysis()
    return analysis[0] if isinstance(analysis, list) else analysis

  products = 2 * 2 * batch * heads * length * length * head_dim
  assert cost(einsums)['flops'] >= products
  splash = cost(lambda q, k, v: fused.splash_attention(q, k, v, False, heads))
  assert splash['flops'] <= 0 and splash.get('optimal_seconds', -1) <= 0, splash
