"""implementation='pallas' (our Pallas flash kernel, `attention/pallas_gpu.py`) and 'cudnn' for
collaborative attention, on CPU.

No GPU here: the Pallas kernel runs in Pallas' interpreter (the same kernel code Triton
compiles on a GPU, but not Triton's compilation; tests/gpu run that), against the materialising
formula (logits, `core.masked_softmax`, weighted sum) in float32, values and gradients. The
cuDNN wrapper runs with jax's XLA attention standing in for cuDNN. Shapes are small: the
interpreter runs every program of the grid one after another.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_attn import attention as A
from lowrank_attn.attention import core, dispatch, fused, pallas_gpu

BLOCK = 8  # several query and key blocks, lengths not a multiple of them
LQ, LK, H = 13, 11, 2


def reference(query, key, value, key_bias, segment_ids, is_causal):
  """The materialising formula in float32: `[B, q, heads, dv]`."""
  f32 = lambda x: x.astype(jnp.float32)
  heads = query.shape[-2]
  key = jnp.repeat(f32(key), heads // key.shape[-2], axis=-2)
  logits = jnp.einsum('bqhd,bkhd->bhqk', f32(query), key)
  if key_bias is not None:
    logits = logits + f32(key_bias)[:, :, None, :]
  mask = None if segment_ids is None else core.segment_mask(*segment_ids)
  if is_causal:
    mask = core.combine_masks(mask, core.causal_mask(query.shape[1], key.shape[1]))
  return core.weighted_sum(core.masked_softmax(logits, mask), f32(value))


def operands(dtype, key_heads, dk=6, dv=5, seed=0):
  """query, key, value, key_bias and segment ids `[2, L]`: two packed segments and padding
  in row 0; in row 1 a query segment (3) without keys and padding queries (0)."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
  q_ids = np.array([[1] * 6 + [2] * 5 + [0] * 2, [1] * 4 + [3] * 3 + [2] * 4 + [0] * 2])
  kv_ids = np.array([[1] * 5 + [2] * 4 + [0] * 2, [2] * 5 + [1] * 6])
  return (
      normal(2, LQ, H, dk),
      normal(2, LK, key_heads, dk),
      normal(2, LK, H, dv),
      normal(2, H, LK),
      (jnp.asarray(q_ids, jnp.int32), jnp.asarray(kv_ids, jnp.int32)),
  )


def value_and_grads(fn, query, key, value, key_bias):
  """fn's output and the gradients of sum(sin(out)) w.r.t. query, key, value, key_bias."""

  def loss(*args):
    out = fn(*args)
    return jnp.sum(jnp.sin(out.astype(jnp.float32))), out

  grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
      query, key, value, key_bias
  )
  return out, grads


def relative_error(result, expected):
  result, expected = np.float32(result), np.float32(expected)
  return np.linalg.norm(result - expected) / np.linalg.norm(expected)


@pytest.mark.parametrize(
    'key_heads, is_causal, dtype',
    [
        (1, False, jnp.float32),
        (1, True, jnp.float32),
        (1, False, jnp.bfloat16),
        (1, True, jnp.bfloat16),
        (H, True, jnp.float32),
    ],
    ids=[
        'shared_key-full-float32',
        'shared_key-causal-float32',
        'shared_key-full-bfloat16',
        'shared_key-causal-bfloat16',
        'per_head_key-causal-float32',
    ],
)
def test_kernel_equals_the_materialising_formula(dtype, is_causal, key_heads):
  """Collaborative's operands (one shared key, values of another width, a key bias) and
  concat's (a key per head), with segment ids: values and gradients of q, k, v, key_bias."""
  query, key, value, key_bias, ids = operands(dtype, key_heads)
  kernel = functools.partial(
      pallas_gpu.flash_attention, segment_ids=ids, is_causal=is_causal, block_q=BLOCK, block_k=BLOCK
  )
  out, grads = value_and_grads(
      lambda q, k, v, b: kernel(q, k, v, key_bias=b), query, key, value, key_bias
  )
  f32 = lambda x: x.astype(jnp.float32)
  expected, expected_grads = value_and_grads(
      lambda q, k, v, b: reference(q, k, v, b, ids, is_causal),
      *map(f32, (query, key, value, key_bias)),
  )
  assert out.dtype == dtype and out.shape == (2, LQ, H, 5)
  eps = float(jnp.finfo(dtype).eps)
  if dtype == jnp.float32:  # rounding only: a few eps per summed term
    tolerance = dict(atol=8 * eps * LK, rtol=8 * eps * LK)
    np.testing.assert_allclose(out, expected, **tolerance)
    for g, g_ref in zip(grads, expected_grads, strict=True):
      np.testing.assert_allclose(g, g_ref, **tolerance)
  else:  # the weights (and dS) are rounded to bfloat16 before each product: eps/2 each
    assert relative_error(out, expected) < 2 * eps
    for name, g, g_ref in zip('qkvb', grads, expected_grads, strict=True):
      assert relative_error(g, g_ref) < 4 * eps, name


def test_a_query_that_sees_no_key_outputs_zero_and_has_zero_gradient():
  query, key, value, key_bias, ids = operands(jnp.float32, 1)
  kernel = lambda q, k, v, b: pallas_gpu.flash_attention(
      q, k, v, key_bias=b, segment_ids=ids, is_causal=True, block_q=BLOCK, block_k=BLOCK
  )
  out, (d_query, *others) = value_and_grads(kernel, query, key, value, key_bias)
  sees_none = ~np.any(
      np.asarray(core.segment_mask(*ids))[:, 0] & np.asarray(core.causal_mask(LQ, LK)), axis=-1
  )
  assert sees_none[0, 11:].all() and sees_none[1, 4:7].all() and sees_none[1, 11:].all()
  np.testing.assert_array_equal(np.asarray(out)[sees_none], 0.0)
  np.testing.assert_array_equal(np.asarray(d_query)[sees_none], 0.0)
  for g in (out, d_query, *others):
    assert np.isfinite(np.asarray(g)).all()


def test_kernel_without_segment_ids_hides_the_padded_keys():
  """No ids: only the padding to whole blocks is hidden (11 keys in blocks of 8)."""
  query, key, value, key_bias, _ = operands(jnp.float32, 1, dk=16, dv=16)
  out = pallas_gpu.flash_attention(
      query, key, value, key_bias=key_bias, block_q=BLOCK, block_k=BLOCK
  )
  np.testing.assert_allclose(
      out, reference(query, key, value, key_bias, None, False), atol=8e-7 * LK, rtol=8e-7 * LK
  )


# ------------------------------------------------------------------ through the layer


KINDS = {
    'concat_grouped_query': dict(num_kv_heads=1),
    'collaborative': dict(kind='collaborative', key_dim=4),  # D/2 (tests/gpu: D/4)
}


def layer_loss_and_grads(params, x, y, spec, implementation, segment_ids):
  def loss(params, x, y):
    out = A.multi_head_attention(
        params,
        x,
        y,
        spec=spec,
        is_causal=True,
        segment_ids=segment_ids,
        implementation=implementation,
        platform='gpu',
    ).out
    return jnp.sum(jnp.sin(out)), out

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(params, x, y)


@pytest.mark.parametrize('kind', KINDS)
def test_pallas_layer_equals_xla_layer(make_params, kind):
  """Cross-attention with packed segments and padding, every parameter's gradient."""
  spec = A.AttentionSpec(num_heads=H, in_features=8, **KINDS[kind])
  params = make_params(spec, seed=1)
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.normal(size=(2, LQ, 8)), jnp.float32)
  y = jnp.asarray(rng.normal(size=(2, LK, 8)), jnp.float32)
  ids = operands(jnp.float32, 1)[-1]
  grads, out = layer_loss_and_grads(params, x, y, spec, 'pallas', ids)
  expected_grads, expected = layer_loss_and_grads(params, x, y, spec, 'xla', ids)
  np.testing.assert_allclose(out, expected, atol=2e-5, rtol=2e-5)
  for (path, g_ref), g in zip(
      jax.tree.leaves_with_path(expected_grads), jax.tree.leaves(grads), strict=True
  ):
    np.testing.assert_allclose(g, g_ref, atol=1e-4, rtol=1e-4, err_msg=jax.tree_util.keystr(path))


def test_collaborative_reaches_the_kernel_as_one_shared_key(make_params, monkeypatch):
  """Not broadcast to every head (as cuDNN and splash need), and the bias not as columns."""
  seen, real = [], pallas_gpu.flash_attention

  def spy(query, key, value, **kwargs):
    seen.append((query.shape, key.shape, value.shape, kwargs['key_bias'].shape))
    return real(query, key, value, **kwargs)

  monkeypatch.setattr(pallas_gpu, 'flash_attention', spy)
  spec = A.AttentionSpec(num_heads=H, in_features=8, kind='collaborative', key_dim=6)
  A.multi_head_attention(
      make_params(spec), jnp.ones((1, 5, 8)), spec=spec, implementation='pallas', platform='gpu'
  )
  assert seen == [((1, 5, H, 6), (1, 5, 1, 6), (1, 5, H, 4), (1, H, 5))]


def test_pallas_refuses_what_it_cannot_compute(make_params):
  spec = A.AttentionSpec(num_heads=H, in_features=8)
  call = functools.partial(
      A.multi_head_attention,
      make_params(spec),
      jnp.ones((1, 5, 8)),
      spec=spec,
      implementation='pallas',
  )
  with pytest.raises(
      ValueError, match="implementation='pallas' needs a GPU backend, but this " "one is 'cpu'"
  ):
    call()
  with pytest.raises(
      ValueError, match=r'a boolean mask \(pallas takes is_causal, and ' 'segment_ids'
  ):
    call(mask=jnp.ones((5, 5), bool), platform='gpu')
  talking = A.AttentionSpec(num_heads=H, in_features=8, kind='talking_heads')
  with pytest.raises(ValueError, match="does not support kind='talking_heads'"):
    dispatch.check_implementation('pallas', talking, platform='gpu')
  dispatch.check_implementation('pallas', spec, dtype=jnp.float32, platform='gpu')


# ------------------------------------------------------------------ cuDNN for collaborative


@pytest.mark.parametrize(
    'version, capability, accepted',
    [
        (91000, '9.0', True),
        (91100, '10.0', True),
        (90900, '9.0', False),
        (91000, '8.9', False),
        (None, None, False),
    ],
)
def test_cudnn_value_width_rule(version, capability, accepted):
  """jax's rule (cuDNN >= 9.10 on compute capability >= 9.0); None: this machine's GPU,
  here none."""
  assert fused.cudnn_accepts_value_width(version, capability) is accepted


def test_cudnn_widths_pad_with_zero_columns():
  assert fused.cudnn_widths(10, 4, mla=True) == (16, 8)
  assert fused.cudnn_widths(10, 4, mla=False) == (16, 16)
  assert fused.cudnn_widths(64, 128, mla=False) == (128, 128)


@pytest.fixture
def hopper(monkeypatch):
  """cuDNN's limits of a Hopper GPU (256-wide heads), whatever GPU this machine has."""
  monkeypatch.setattr(fused, '_local_cudnn', lambda: (91000, '9.0'))


def test_cudnn_accepts_collaborative_up_to_its_widest_head(hopper):
  ok = A.AttentionSpec(num_heads=4, in_features=512, kind='collaborative', key_dim=128)
  dispatch.check_implementation('cudnn', ok, dtype=jnp.bfloat16, platform='gpu')
  wide = A.AttentionSpec(num_heads=4, in_features=512, kind='collaborative', key_dim=256)
  with pytest.raises(
      ValueError,
      match=r'head widths above 256 on this GPU \(collaborative key_dim=256 \+ '
      r'4 content-bias columns and head_dim=128 give 264\)',
  ):
    dispatch.check_implementation('cudnn', wide, dtype=jnp.bfloat16, platform='gpu')


@pytest.mark.parametrize(
    'kind,options,width',
    [('fixed_head', dict(head_dim=512), 512), ('concat', dict(num_heads=2), 320)],
)
def test_cudnn_refuses_wider_heads_of_every_kind(hopper, kind, options, width):
  """jax's cuDNN check (`check_is_flash_attention`: head dim <= 256 from Hopper on, 128
  before) would fail on the GPU at trace time; 'auto' must pick another kernel instead."""
  s = A.AttentionSpec(**{'num_heads': 8, 'in_features': 640, 'kind': kind, **options})
  with pytest.raises(ValueError, match=rf'head widths above 256 on this GPU \(head_dim={width}'):
    dispatch.check_implementation('cudnn', s, dtype=jnp.bfloat16, platform='gpu')
  choice = dispatch.choose_implementation(
      s, q_length=512, kv_length=512, dtype=jnp.bfloat16, platform='gpu'
  )
  assert choice != 'cudnn'


def test_cudnn_width_limit_before_hopper(monkeypatch):
  assert fused.cudnn_max_width('8.0') == fused.cudnn_max_width('8.9') == 128
  assert fused.cudnn_max_width('9.0') == fused.cudnn_max_width('10.0') == 256
  monkeypatch.setattr(fused, '_local_cudnn', lambda: (90100, '8.0'))  # an A100
  s = A.AttentionSpec(num_heads=4, in_features=768, kind='concat')  # head_dim 192
  with pytest.raises(ValueError, match=r'head widths above 128 on this GPU \(head_dim=192'):
    dispatch.check_implementation('cudnn', s, dtype=jnp.bfloat16, platform='gpu')


@pytest.mark.parametrize('mla', [True, False], ids=['mla', 'padded'])
def test_cudnn_wrapper_for_collaborative_with_xla_standing_in(make_params, monkeypatch, mla):
  """Our wrapper with the value-width decision forced: with 'mla' values keep their width and
  go to cuDNN's own function, else both widths are padded to the wider and go through
  `jax.nn.dot_product_attention` (which wants value.shape == key.shape); jax's XLA attention
  stands in for cuDNN in both, asserting what cuDNN asserts."""
  calls = []
  real = jax.nn.dot_product_attention

  def public(query, key, value, *args, mask=None, implementation, **kw):
    calls.append(('public', query.shape[-1], value.shape[-1]))
    assert value.shape == key.shape and query.shape[-1] % 8 == 0, (key.shape, value.shape)
    return real(query, key, value, *args, mask=mask, implementation='xla', **kw)

  def mla_kernel(query, key, value, mask=None, *, scale, mask_type):
    calls.append(('mla', query.shape[-1], value.shape[-1]))
    assert key.shape[-2] == value.shape[-2] and query.shape[-1] % 8 == value.shape[-1] % 8 == 0
    width = max(key.shape[-1], value.shape[-1])
    pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, width - x.shape[-1])))
    out = real(
        pad(query),
        pad(key),
        pad(value),
        mask=mask,
        scale=scale,
        implementation='xla',
        is_causal=mask_type.name == 'CAUSAL',
    )
    return out[..., : value.shape[-1]]

  from jax._src.cudnn import fused_attention_stablehlo as cudnn

  monkeypatch.setattr(jax.nn, 'dot_product_attention', public)
  monkeypatch.setattr(cudnn, 'dot_product_attention', mla_kernel)
  monkeypatch.setattr(fused, 'cudnn_accepts_value_width', lambda: mla)
  spec = A.AttentionSpec(num_heads=H, in_features=16, kind='collaborative', key_dim=14)
  params = make_params(spec, dtype=jnp.bfloat16)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(2, 7, 16)), jnp.bfloat16)
  mask = jnp.asarray(rng.random((2, 1, 7, 7)) < 0.7).at[1, :, 3].set(False)
  call = functools.partial(A.multi_head_attention, params, x, spec=spec, mask=mask, is_causal=True)
  out = call(implementation='cudnn', platform='gpu').out
  # key 14 + 2 bias columns = 16 wide, values 8: padded to 16 without mla.
  assert calls == ([('mla', 16, 8)] if mla else [('public', 16, 16)]), calls
  expected = call(implementation='xla').out
  eps = float(jnp.finfo(jnp.bfloat16).eps)
  assert relative_error(out, expected) < 4 * eps
  np.testing.assert_array_equal(np.float32(out[1, 3]), np.float32(expected[1, 3]))
