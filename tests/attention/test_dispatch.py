"""implementation='auto': the table of `dispatch.choose_implementation`, on CPU, by forcing the
platform it chooses for; every choice can compute its call; layers use it and log it once."""

import dataclasses
import itertools
import logging

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_attn import models
from lowrank_attn.attention import AttentionSpec, dispatch, kernels

BF16, F32, F16 = jnp.bfloat16, jnp.float32, jnp.float16
FUSED = dispatch.FUSED_MIN_LENGTH


def spec(kind='concat', **options):
  sizes = dict(num_heads=8, in_features=512)
  if kind == 'fixed_head':
    sizes['head_dim'] = 64
  return AttentionSpec(kind=kind, **sizes, **options)


def choose(s, length=512, *, platform, dtype=BF16, batch=8, kv_length=None, **flags):
  return dispatch.choose_implementation(
      s,
      q_length=length,
      kv_length=length if kv_length is None else kv_length,
      batch=batch,
      dtype=dtype,
      platform=platform,
      **flags
  )


@pytest.mark.parametrize(
    'platform,dtype,expected',
    [
        ('tpu', BF16, 'splash'),
        ('tpu', F32, 'splash'),
        ('gpu', BF16, 'cudnn'),
        ('gpu', F16, 'cudnn'),
        ('gpu', F32, 'pallas'),  # cuDNN computes attention in 16-bit types only
        ('cpu', F32, 'blockwise'),
        ('cpu', BF16, 'blockwise'),  # 512 keys: blockwise is faster
    ],
)
def test_long_rows_go_to_the_platforms_fused_kernel(platform, dtype, expected):
  assert choose(spec(), platform=platform, dtype=dtype) == expected
  assert choose(spec('fixed_head'), platform=platform, dtype=dtype) == expected


@pytest.mark.parametrize('platform', ['cpu', 'gpu', 'tpu'])
def test_short_rows_are_materialised(platform):
  assert choose(spec(), FUSED - 1, platform=platform) == 'xla'
  # Cross-attention: short on either side is short.
  assert choose(spec(), FUSED, kv_length=FUSED - 1, platform=platform) == 'xla'
  assert choose(spec(), FUSED - 1, kv_length=4096, platform=platform) in ('xla', 'blockwise')
  # Our CPU configs' rows (128-256): 'xla', whose losses they reproduce bitwise.
  for length in (FUSED, dispatch.CPU_BLOCKWISE_MIN_LENGTH - 1):
    assert choose(spec(), length, platform='cpu', dtype=F32) == 'xla'
  assert (
      choose(spec(), FUSED, platform=platform)
      == {'cpu': 'xla', 'gpu': 'cudnn', 'tpu': 'splash'}[platform]
  )
  # The documented threshold: one splash block.
  assert choose(spec(), 127, platform=platform) == 'xla'
  assert choose(spec(), 128, platform=platform) != 'xla' or platform == 'cpu'


def test_weights_that_would_not_fit_go_blockwise():
  s = spec('talking_heads')  # no fused kernel: 'xla' or 'blockwise' on every platform
  limit = dispatch.MATERIALISE_MAX_BYTES
  # The largest batch whose float32 [batch, 8 heads, 256, 256] weights fit, and one more row.
  batch = limit // (4 * 8 * 256 * 256)
  assert dispatch.weights_bytes(s, batch, 256, 256) <= limit
  assert dispatch.weights_bytes(s, batch + 1, 256, 256) > limit
  for platform in ('cpu', 'gpu', 'tpu'):
    assert choose(s, 256, batch=batch, platform=platform) == 'xla'
    assert choose(s, 256, batch=batch + 1, platform=platform) == 'blockwise'
  # The documented threshold, 1 GiB: batch 8, 8 heads, L = 2048 is 1 GiB of float32 weights.
  assert choose(s, 2048, batch=8, platform='gpu') == 'xla'
  assert choose(s, 2048, batch=9, platform='gpu') == 'blockwise'
  # Fewer output heads than logit heads (a pruned talking-heads layer): the logit heads count,
  # and 'blockwise' cannot compute it, so 'xla' materialises them past the limit.
  pruned = AttentionSpec(
      num_heads=2, num_logit_heads=8, head_dim=64, in_features=512, kind='talking_heads'
  )
  assert dispatch.weights_bytes(pruned, batch + 1, 256, 256) > limit
  assert choose(pruned, 256, batch=batch + 1, platform='gpu') == 'xla'


@pytest.mark.parametrize('platform', ['cpu', 'gpu', 'tpu'])
def test_what_only_xla_computes_goes_to_xla_whatever_the_size(platform):
  huge = dict(length=8192, batch=64)  # 137 GB of weights
  for flag in ('return_weights', 'return_logits', 'cache'):
    assert choose(spec(), **huge, platform=platform, **{flag: True}) == 'xla'


@pytest.mark.parametrize('platform', ['gpu', 'tpu'])
def test_what_no_fused_kernel_computes_falls_back(platform):
  for s, flags in ((spec('talking_heads'), {}), (spec(), {'dropout': True})):
    assert choose(s, platform=platform, **flags) == 'xla'
    assert choose(s, 8192, batch=64, platform=platform, **flags) == 'blockwise'


def test_a_boolean_mask_skips_the_kernels_that_take_segment_ids():
  assert choose(spec(), platform='gpu', dtype=BF16, mask=True) == 'cudnn'
  assert choose(spec(), platform='gpu', dtype=F32, mask=True) == 'xla'
  assert choose(spec(), platform='tpu', mask=True) == 'xla'


def test_collaborative_on_gpu_goes_where_it_costs_no_padding():
  # Key width 128 + 8 content-bias columns = 136 against values of 64: cuDNN (without values
  # of their own width, as on this machine) would pad the values to 136; ours reads the key.
  quarter = spec('collaborative', key_dim=128)
  assert not jax.devices()[0].platform == 'gpu'  # cudnn_accepts_value_width() is False here
  assert choose(quarter, platform='gpu') == 'pallas'
  # 56 + 8 = 64 = head_dim: no padding either way.
  assert choose(spec('collaborative', key_dim=56), platform='gpu') == 'cudnn'
  # Full width: 512 + 8 columns exceed cuDNN's 256.
  assert choose(spec('collaborative'), platform='gpu') == 'pallas'
  assert choose(quarter, platform='tpu') == 'splash'


def test_every_choice_can_compute_its_call():
  kinds = [
      spec(),
      spec('fixed_head'),
      spec('collaborative', key_dim=128),
      spec('collaborative', key_dim=56),
      spec('talking_heads'),
      spec(num_kv_heads=2),
      spec(use_bias=False, kind='collaborative', key_dim=128),
  ]
  flag_names = ('mask', 'dropout', 'return_weights', 'cache')
  for s, platform, dtype, length, flags in itertools.product(
      kinds,
      ('cpu', 'gpu', 'tpu'),
      (F32, BF16, F16),
      (FUSED - 1, 512, 8192),
      itertools.product((False, True), repeat=len(flag_names)),
  ):
    flags = dict(zip(flag_names, flags))
    chosen = choose(s, length, platform=platform, dtype=dtype, **flags)
    dispatch.check_implementation(chosen, s, platform=platform, dtype=dtype, **flags)


@pytest.mark.parametrize('num_heads', [2, 3])
def test_a_pruned_talking_heads_layer_is_computed_by_xla(num_heads):
  """num_logit_heads != num_heads (what pruning a talking-heads layer leaves): 'blockwise'
  refuses it by name (it crashed), and on CPU 'auto' at 512 keys, where it would pick
  'blockwise', computes it as 'xla' does."""
  s = AttentionSpec(
      num_heads=num_heads, num_logit_heads=4, head_dim=2, in_features=6, kind='talking_heads'
  )
  with pytest.raises(ValueError, match=r'num_logit_heads=4 with num_heads=%d' % num_heads):
    dispatch.check_implementation('blockwise', s, platform='cpu')
  # A layer pruned to no head adds only its output bias, on every implementation.
  none = AttentionSpec(
      num_heads=0, num_logit_heads=4, head_dim=2, in_features=6, kind='talking_heads'
  )
  dispatch.check_implementation('blockwise', none, platform='cpu')
  assert choose(s, 512, platform='cpu', dtype=F32, batch=1) == 'xla'
  params = {
      name: jax.random.normal(jax.random.key(i), shape) / 3
      for i, (name, shape) in enumerate(s.param_shapes().items())
  }
  x = jax.random.normal(jax.random.key(9), (1, 512, 6))
  auto = kernels.multi_head_attention(params, x, spec=s, platform='cpu').out
  xla = kernels.multi_head_attention(params, x, spec=s, implementation='xla').out
  np.testing.assert_array_equal(auto, xla)


def test_auto_must_be_resolved_before_it_is_checked():
  with pytest.raises(ValueError, match="implementation='auto' stands for another"):
    dispatch.check_implementation('auto', spec(), platform='cpu')


def test_the_call_computes_with_the_chosen_implementation(monkeypatch):
  """multi_head_attention resolves 'auto' per call: the forced platform's choice reaches
  `dispatch.attend`, and on CPU short rows compute exactly as implementation='xla'."""
  s = AttentionSpec(num_heads=2, in_features=8)
  params = {
      name: jax.random.normal(jax.random.key(i), shape) / 3
      for i, (name, shape) in enumerate(s.param_shapes().items())
  }
  x = jax.random.normal(jax.random.key(9), (2, 5, 8))
  auto = kernels.multi_head_attention(params, x, spec=s, is_causal=True).out
  xla = kernels.multi_head_attention(params, x, spec=s, is_causal=True, implementation='xla').out
  np.testing.assert_array_equal(auto, xla)

  called = []
  monkeypatch.setattr(
      dispatch,
      'attend',
      lambda *a, implementation, **k: called.append(implementation) or jnp.zeros((2, FUSED, 2, 4)),
  )
  long_x = jnp.zeros((2, FUSED, 8), jnp.bfloat16)
  for platform, dtype, expected in (
      ('gpu', BF16, 'cudnn'),
      ('tpu', BF16, 'splash'),
      ('gpu', F32, 'pallas'),
  ):
    kernels.multi_head_attention(params, long_x, spec=s, platform=platform, dtype=dtype)
    assert called[-1] == expected


def test_the_choice_is_logged_once_per_model(caplog, monkeypatch):
  monkeypatch.setattr(dispatch, '_logged', set())
  attention = AttentionSpec(num_heads=2)
  cfg = models.TransformerConfig(
      vocab_size=11,
      emb_dim=8,
      mlp_dim=16,
      num_encoder_layers=2,
      num_decoder_layers=2,
      max_length=16,
      encoder_attention=attention,
      decoder_attention=attention,
      cross_attention=attention,
  )
  model = models.EncoderDecoder(cfg, bos_id=1, rngs=nnx.Rngs(0))
  inputs, targets = jnp.ones((2, 7), jnp.int32), jnp.ones((2, 5), jnp.int32)
  with caplog.at_level(logging.INFO):
    model(inputs, targets)
    model(inputs, targets)
  lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith('attention:')]
  assert lines == [
      'attention: encoder self-attention -> xla (cpu, float32, L=7)',
      'attention: decoder self-attention -> xla (cpu, float32, L=5)',
      'attention: cross-attention -> xla (cpu, float32, q=5, kv=7)',
  ]
