"""implementation='splash' with segment ids computes what 'xla' computes with their mask.

Padding and packed sequences reach splash as (query, key) segment ids, the other
implementations as `segment_mask` of them. The splash kernel runs in Pallas' CPU interpreter
(no TPU here), so these check our operands, padding to whole blocks and the zeroing of queries
that see no key, not TPU compilation (tests/tpu/test_compile_splash.py does that).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_attn import attention as A
from lowrank_attn.attention import fused

KINDS = {'concat': dict(), 'collaborative': dict(kind='collaborative', key_dim=6)}
LENGTH = 24  # not a multiple of splash's 128-wide blocks: padded


@pytest.fixture
def interpret_splash(monkeypatch):
  """Splash in Pallas' interpreter (the calls pass platform='tpu' to be checked as on a TPU)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

  monkeypatch.setattr(
      splash, 'make_splash_mha', functools.partial(splash.make_splash_mha, interpret=True)
  )


def segments():
  """(query, key) ids `[2, LENGTH]`: packed segments, padding (0), a negative id; query
  segment 4 has no key, segment 5's keys come after its queries (causal: they see none)."""
  q = np.zeros((2, LENGTH), np.int32)
  kv = np.zeros((2, LENGTH), np.int32)
  q[0, :8], q[0, 8:18] = 1, 2  # padding from 18
  kv[0] = q[0]
  q[1, :5], q[1, 5:9], q[1, 9:15], q[1, 15:20], q[1, 20:] = 3, 4, 5, 1, -1
  kv[1, :6], kv[1, 6:12], kv[1, 12:17], kv[1, 17:] = 3, 1, 5, 0
  return jnp.asarray(q), jnp.asarray(kv)


def inputs(seed=0):
  rng = np.random.default_rng(seed)
  return (
      jnp.asarray(rng.normal(size=(2, LENGTH, 8)), jnp.float32),
      jnp.asarray(rng.normal(size=(2, LENGTH, 8)), jnp.float32),
  )


def loss_and_grads(params, x, y, *, spec, implementation, is_causal, mask=None, segment_ids=None):
  def loss(params, x, y):
    out = A.multi_head_attention(
        params,
        x,
        y,
        spec=spec,
        mask=mask,
        is_causal=is_causal,
        segment_ids=segment_ids,
        implementation=implementation,
        platform='tpu',
    ).out
    return jnp.sum(jnp.sin(out)), out  # a gradient that differs per output element

  return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(params, x, y)


@pytest.mark.parametrize('is_causal', [False, True], ids=['full', 'causal'])
@pytest.mark.parametrize('self_attention', [True, False], ids=['self', 'cross'])
@pytest.mark.parametrize('kind', list(KINDS))
def test_splash_segment_ids_match_xla_mask(
    make_params, interpret_splash, kind, is_causal, self_attention
):
  spec = A.AttentionSpec(num_heads=2, in_features=8, **KINDS[kind])
  params = make_params(spec)
  x, y = inputs()
  q_ids, kv_ids = segments()
  if self_attention:
    y, kv_ids = x, q_ids
  expected_grads, expected = loss_and_grads(
      params,
      x,
      y,
      spec=spec,
      implementation='xla',
      is_causal=is_causal,
      mask=A.segment_mask(q_ids, kv_ids),
  )
  grads, out = loss_and_grads(
      params,
      x,
      y,
      spec=spec,
      implementation='splash',
      is_causal=is_causal,
      segment_ids=(q_ids, kv_ids),
  )
  np.testing.assert_allclose(out, expected, atol=2e-5, rtol=1e-4)
  for g, g_ref in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads), strict=True):
    np.testing.assert_allclose(g, g_ref, atol=2e-4, rtol=2e-4)


def test_queries_that_see_no_key_output_only_the_bias(make_params, interpret_splash):
  """Padding, a negative id, a segment without keys: the heads output 0, as with the mask."""
  spec = A.AttentionSpec(num_heads=2, in_features=8)
  params = make_params(spec)
  x, y = inputs()
  q_ids, kv_ids = segments()
  out = A.multi_head_attention(
      params, x, y, spec=spec, segment_ids=(q_ids, kv_ids), implementation='splash', platform='tpu'
  ).out
  sees_none = ~np.any(np.asarray(A.segment_mask(q_ids, kv_ids))[:, 0], axis=-1)
  assert sees_none[0, 18:].all() and sees_none[1, 5:9].all() and sees_none[1, 20:].all()
  np.testing.assert_allclose(
      np.asarray(out)[sees_none],
      np.broadcast_to(params['out_bias'], (sees_none.sum(), 8)),
      atol=1e-6,
  )


@pytest.mark.parametrize('is_causal', [False, True], ids=['full', 'causal'])
def test_sees_any_key_is_the_masks_row_any(is_causal):
  rng = np.random.default_rng(0)
  q_ids = jnp.asarray(rng.integers(-1, 5, (16, 20)), jnp.int32)
  kv_ids = jnp.asarray(rng.integers(-1, 5, (16, 20)), jnp.int32)
  mask = A.segment_mask(q_ids, kv_ids)[:, 0]
  if is_causal:
    mask = mask & A.causal_mask(20)
  np.testing.assert_array_equal(
      fused._sees_any_key(q_ids, kv_ids, is_causal), np.any(mask, axis=-1)
  )


@pytest.mark.parametrize('implementation', ['blockwise', 'xla'])
def test_other_implementations_take_segment_ids_as_their_mask(make_params, implementation):
  spec = A.AttentionSpec(num_heads=2, in_features=8, kind='collaborative', key_dim=6)
  params = make_params(spec)
  x, y = inputs()
  q_ids, kv_ids = segments()
  extra = jnp.asarray(np.random.default_rng(1).random((2, 1, LENGTH, LENGTH)) < 0.8)
  call = functools.partial(
      A.multi_head_attention,
      params,
      x,
      y,
      spec=spec,
      is_causal=True,
      implementation=implementation,
      block_size=8,
  )
  np.testing.assert_allclose(
      call(mask=extra, segment_ids=(q_ids, kv_ids)).out,
      call(mask=extra & A.segment_mask(q_ids, kv_ids), implementation='xla').out,
      atol=2e-5,
  )


def test_splash_still_refuses_a_boolean_mask_and_bad_segment_ids(make_params):
  spec = A.AttentionSpec(num_heads=2, in_features=8)
  params = make_params(spec)
  x, _ = inputs()
  q_ids, _ = segments()
  call = functools.partial(
      A.multi_head_attention, params, x, spec=spec, implementation='splash', platform='tpu'
  )
  for extra in (dict(), dict(segment_ids=(q_ids, q_ids))):
    with pytest.raises(ValueError, match=r'a boolean mask .*segment_ids'):
      call(mask=A.segment_mask(q_ids, q_ids), **extra)
  with pytest.raises(ValueError, match='segment_ids must be a'):
    call(segment_ids=q_ids)
  with pytest.raises(ValueError, match='query segment_ids must be integers'):
    call(segment_ids=(q_ids * 1.0, q_ids))
  with pytest.raises(ValueError, match=r'key segment_ids has shape \(2, 5\)'):
    call(segment_ids=(q_ids, q_ids[:, :5]))
