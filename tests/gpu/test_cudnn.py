"""implementation='cudnn' and 'pallas' on a CUDA GPU: cuDNN's fused attention and our Pallas
(Triton) kernel compute what 'xla' computes.

Run with `make test-gpu` (or `JAX_PLATFORMS=cuda pytest -m gpu tests/gpu`) on a machine with
an NVIDIA GPU; `make test` leaves these tests out. Selected on a machine without a GPU they
fail (`test_the_backend_is_a_gpu`), they do not skip.

Parameters: `make_params` of tests/conftest.py (random, biases and gates included). Reference:
the materialising path in float32 (an independent formula: logits, softmax, weighted sum).
cuDNN computes in bfloat16, so it is held to what the same path computed in bfloat16
achieves: its error against the float32 reference may be at most 2x that of 'xla' in
bfloat16, plus a little. 'pallas' is held to the same in bfloat16, and in float32 (IEEE
products) to float32 rounding against the reference at HIGHEST precision.

Written without a GPU at hand for the collaborative and 'pallas' cases (issue 23): the next
GPU session runs them first.
"""

import functools

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_attn import attention as A
from lowrank_attn import models
from lowrank_attn.attention import fused

pytestmark = pytest.mark.gpu

KINDS = {  # what cuDNN and 'pallas' compute (talking heads is refused)
    'concat': dict(),
    'grouped_query': dict(num_kv_heads=2),
    'fixed_head': dict(kind='fixed_head', head_dim=128),
    'gated': dict(gated=True),
    # key_dim D/4 (+ 4 content-bias columns) against values 64 wide: cuDNN's "mla" path where
    # `fused.cudnn_accepts_value_width()`, else zero-padded to equal widths.
    'collaborative': dict(kind='collaborative', key_dim=64),
}
B, L, D, H = 2, 256, 256, 4  # head_dim 64


def test_the_backend_is_a_gpu():
  assert (
      jax.default_backend() == 'gpu'
  ), f'tests/gpu need a CUDA GPU; jax sees {jax.devices()} (set JAX_PLATFORMS=cuda)'


def make_mask(kind, rng, length):
  if kind is None:
    return None
  shape = {'padding': (B, 1, 1, length), 'full': (B, 1, length, length)}[kind]
  mask = rng.random(shape) < 0.8
  if kind == 'padding':
    mask[1, ..., length // 2 :] = False  # the second example is half padding
  else:
    mask[:, :, 7] = False  # a query that sees no key
  return jnp.asarray(mask)


@functools.partial(
    jax.jit, static_argnames=('spec', 'implementation', 'is_causal', 'dtype', 'precision')
)
def loss_and_grads(
    params, x, mask, segment_ids=None, *, spec, implementation, is_causal, dtype, precision=None
):
  def loss(params, x):
    params = jax.tree.map(lambda p: p.astype(dtype), params)
    out = A.multi_head_attention(
        params,
        x.astype(dtype),
        spec=spec,
        mask=mask,
        segment_ids=segment_ids,
        is_causal=is_causal,
        implementation=implementation,
        precision=precision,
    ).out
    return jnp.sum(jnp.sin(out.astype(jnp.float32))), out.astype(jnp.float32)

  (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
  return out, grads


def relative_error(result, reference):
  """||result - reference|| / ||reference|| over all leaves together (a gradient that is zero
  in exact arithmetic, e.g. the key bias's, contributes its noise but sets no scale)."""
  pairs = list(zip(jax.tree.leaves(result), jax.tree.leaves(reference), strict=True))
  difference = sum(float(jnp.sum(jnp.square(a - b))) for a, b in pairs)
  return (difference / sum(float(jnp.sum(jnp.square(b))) for _, b in pairs)) ** 0.5


def max_error(result, reference):
  """The worst of relative_error over outputs, parameter gradients and input gradients."""
  (out, (param_grads, input_grads)), (out_ref, (param_ref, input_ref)) = result, reference
  return max(
      relative_error(out, out_ref),
      relative_error(param_grads, param_ref),
      relative_error(input_grads, input_ref),
  )


def layer_inputs(kind, length, make_params):
  """The spec of `kind`, random parameters, inputs `[B, length, D]` and the rng that made them."""
  spec = A.AttentionSpec(num_heads=H, in_features=D, **KINDS[kind])
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((B, length, D)), jnp.float32)
  return spec, make_params(spec, seed=0), x, rng


@pytest.mark.parametrize('length', [L, L - 1], ids=['even', 'odd'])  # cuDNN: even with a mask
@pytest.mark.parametrize('is_causal', [False, True], ids=['full', 'causal'])
@pytest.mark.parametrize('mask_kind', [None, 'padding', 'full'])
@pytest.mark.parametrize('kind', KINDS)
def test_cudnn_equals_the_materialising_path(kind, mask_kind, is_causal, length, make_params):
  """Outputs, parameter gradients and input gradients."""
  spec, params, x, rng = layer_inputs(kind, length, make_params)
  mask = make_mask(mask_kind, rng, length)
  run = functools.partial(loss_and_grads, params, x, mask, spec=spec, is_causal=is_causal)
  reference = run(implementation='xla', dtype=jnp.float32)
  bf16_error = max_error(run(implementation='xla', dtype=jnp.bfloat16), reference)
  cudnn_error = max_error(run(implementation='cudnn', dtype=jnp.bfloat16), reference)
  assert cudnn_error <= 2 * bf16_error + 1e-3, (cudnn_error, bf16_error)


def test_a_query_that_sees_no_key_outputs_zero(make_params):
  spec = A.AttentionSpec(num_heads=H, in_features=D)
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), make_params(spec, seed=0))
  x = jnp.ones((B, L, D), jnp.bfloat16)
  mask = jnp.ones((B, 1, L, L), bool).at[:, :, 5].set(False)
  out = A.multi_head_attention(params, x, spec=spec, mask=mask, implementation='cudnn').out
  heads = A.multi_head_attention(
      params, x, spec=spec, mask=mask, implementation='cudnn', head_mask=jnp.zeros((H,))
  ).out  # only the output bias
  np.testing.assert_array_equal(np.float32(out[:, 5]), np.float32(heads[:, 5]))
  assert not np.array_equal(np.float32(out[:, 4]), np.float32(heads[:, 4]))


def test_the_compiled_program_calls_cudnn(make_params):
  """Not XLA's attention under another name: the program holds cuDNN's fused kernel."""
  spec = A.AttentionSpec(num_heads=H, in_features=D)
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), make_params(spec, seed=0))
  x = jnp.ones((B, L, D), jnp.bfloat16)

  def call(implementation):
    fn = lambda p, x: A.multi_head_attention(
        p, x, spec=spec, is_causal=True, implementation=implementation
    ).out
    return jax.jit(jax.grad(lambda p, x: jnp.sum(fn(p, x)))).lower(params, x).compile().as_text()

  assert 'cudnn' in call('cudnn').lower()
  assert 'cudnn$fmha' not in call('xla').lower()


def test_decoder_lm_with_cudnn_attention():
  """A bfloat16 DecoderLM on packed rows: loss and gradients as with 'xla' (bf16 tolerance)."""

  def config(implementation):
    spec = A.AttentionSpec(num_heads=H, implementation=implementation)
    return models.TransformerConfig(
        vocab_size=97,
        emb_dim=D,
        mlp_dim=512,
        num_encoder_layers=0,
        num_decoder_layers=2,
        max_length=L,
        dropout_rate=0.0,
        dtype='bfloat16',
        decoder_attention=spec,
    )

  xla = models.DecoderLM(config('xla'), rngs=nnx.Rngs(0))
  model = models.DecoderLM(config('cudnn'), rngs=nnx.Rngs(1))
  nnx.update(model, nnx.state(xla, nnx.Param))
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(1, 97, (B, L)), jnp.int32)
  segments = jnp.asarray(np.repeat([[1, 2], [1, 0]], L // 2, axis=1), jnp.int32)
  tokens = tokens * (segments > 0)

  def loss_fn(module):
    logits, _ = module(tokens[:, :-1], segment_ids=segments[:, :-1])
    targets = tokens[:, 1:]
    log_p = jnp.take_along_axis(
        jax.nn.log_softmax(logits.astype(jnp.float32)), targets[..., None], -1
    )[..., 0]
    weights = (targets > 0).astype(jnp.float32)
    return -jnp.sum(log_p * weights) / jnp.sum(weights)

  def value_and_grads(module):
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    return jax.jit(jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest))))(params)

  (loss, grads), (xla_loss, xla_grads) = value_and_grads(model), value_and_grads(xla)
  np.testing.assert_allclose(loss, xla_loss, rtol=1e-2)
  assert relative_error(grads, xla_grads) < 0.05


def test_which_cudnn_path_collaborative_takes():
  """Not a pass/fail of the machine's versions: records them next to the decision."""
  from jax._src.cudnn import fused_attention_stablehlo as cudnn

  version, capability = cudnn.check_cudnn_version(), jax.devices()[0].compute_capability
  expected = version >= 91000 and tuple(map(int, capability.split('.'))) >= (9, 0)
  assert fused.cudnn_accepts_value_width() is expected, (version, capability)


# ------------------------------------------------------------------ our Pallas kernel


def make_segments(length):
  """Example 0: two packed segments; example 1: half padding (0)."""
  ids = np.ones((B, length), np.int32)
  ids[0, length // 3 :] = 2
  ids[1, length // 2 :] = 0
  return jnp.asarray(ids)


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
@pytest.mark.parametrize('length', [L, L - 1], ids=['even', 'odd'])
@pytest.mark.parametrize('is_causal', [False, True], ids=['full', 'causal'])
@pytest.mark.parametrize('kind', KINDS)
def test_pallas_equals_the_materialising_path(kind, is_causal, length, dtype, make_params):
  """Outputs, parameter gradients and input gradients, with packed segments and padding."""
  spec, params, x, _ = layer_inputs(kind, length, make_params)
  ids = make_segments(length)
  run = functools.partial(loss_and_grads, params, x, spec=spec, is_causal=is_causal)
  reference = run(
      A.segment_mask(ids, ids),
      implementation='xla',
      dtype=jnp.float32,
      precision=jax.lax.Precision.HIGHEST,
  )
  pallas = run(None, (ids, ids), implementation='pallas', dtype=jnp.dtype(dtype))
  if dtype == 'float32':
    assert max_error(pallas, reference) < 1e-4
  else:
    bf16_error = max_error(
        run(A.segment_mask(ids, ids), implementation='xla', dtype=jnp.bfloat16), reference
    )
    assert max_error(pallas, reference) <= 2 * bf16_error + 1e-3


def test_the_compiled_program_calls_our_triton_kernel(make_params):
  spec = A.AttentionSpec(num_heads=H, in_features=D, kind='collaborative', key_dim=64)
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), make_params(spec, seed=0))
  x = jnp.ones((B, L, D), jnp.bfloat16)
  fn = lambda p, x: A.multi_head_attention(
      p, x, spec=spec, is_causal=True, implementation='pallas'
  ).out
  text = jax.jit(jax.grad(lambda p, x: jnp.sum(fn(p, x)))).lower(params, x).compile().as_text()
  assert 'triton' in text.lower() and 'cudnn$fmha' not in text.lower()
