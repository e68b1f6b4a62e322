"""Mixed precision (`TransformerConfig.dtype`, default 'auto') and rematerialisation
(`TransformerConfig.remat`): what each resolves to, and that neither changes the math beyond
rounding."""

import re

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_attn import models
from lowrank_attn.models import config as config_lib
from lowrank_attn.tasks import base
from lowrank_attn.train import config as train_config

V, D, LAYERS, L, B = 97, 64, 3, 32, 4


def lm_config(**overrides):
  attention = models.AttentionSpec(num_heads=4, platform=overrides.pop('platform', None))
  values = dict(
      vocab_size=V,
      emb_dim=D,
      mlp_dim=4 * D,
      num_decoder_layers=LAYERS,
      max_length=L,
      dropout_rate=0.0,
      decoder_attention=attention,
  )
  return models.TransformerConfig(**{**values, **overrides})


def tokens(seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(1, V, (B, L)), jnp.int32)


def mean_loss(model, x):
  """The tasks' token cross entropy of next-token prediction, as a train step computes it."""
  logits, _ = model(x[:, :-1])
  out = base.cross_entropy(logits, x[:, 1:], jnp.ones(x[:, 1:].shape))
  return out['nll'] / out['weight']


# ------------------------------------------------------------------ dtype


@pytest.mark.parametrize(
    'platform,dtype',
    [(None, 'float32'), ('cpu', 'float32'), ('gpu', 'bfloat16'), ('tpu', 'bfloat16')],
)
def test_auto_dtype_is_bfloat16_on_accelerators_and_float32_on_cpu(platform, dtype):
  cfg = lm_config(platform=platform)
  assert cfg.dtype == 'auto' and cfg.resolved_dtype == dtype  # None: this CPU backend
  assert cfg.compute_dtype == jnp.dtype(dtype) and cfg.parameter_dtype == jnp.float32
  assert cfg.describe_numerics().startswith(
      f'compute {dtype} (dtype=auto on {platform or "cpu"}), parameters float32'
  )
  # An explicit dtype wins over the platform.
  assert lm_config(platform=platform, dtype='float32').compute_dtype == jnp.float32


def test_dtype_and_remat_are_config_fields_with_checked_values():
  config = train_config.base_config('lm')
  assert (config.model.dtype, config.model.remat) == ('auto', 'none')
  config.model.dtype, config.model.remat = 'float32', 'dots_saveable'  # --config.model.*=
  cfg = train_config.model_config(config, vocab_size=V)
  assert (cfg.compute_dtype, cfg.remat) == (jnp.float32, 'dots_saveable')
  with pytest.raises(
      ValueError, match=r"dtype='float16' is not one of \('auto', 'float32', " r"'bfloat16'\)"
  ):
    lm_config(dtype='float16')
  with pytest.raises(
      ValueError, match=r"remat='dots' is not one of \('none', 'full', .*" r"'dots_saveable'.*\)\.$"
  ):
    lm_config(remat='dots')
  # Every name but 'none'/'full' is a jax policy; factories of policies are not names.
  for name in config_lib.REMAT_POLICIES[2:]:
    assert callable(getattr(jax.checkpoint_policies, name))
  assert 'save_only_these_names' not in config_lib.REMAT_POLICIES


def test_bfloat16_keeps_parameters_logits_and_loss_float32():
  cfg = lm_config(dtype='bfloat16', tie_embeddings=True)
  model = models.DecoderLM(cfg, rngs=nnx.Rngs(0))
  params = jax.tree.leaves(nnx.state(model, nnx.Param))
  assert {p.dtype for p in params} == {jnp.dtype(jnp.float32)}
  x = tokens()
  logits, _ = model(x)
  assert logits.dtype == jnp.float32
  # The logits are the bfloat16 final activations times the bfloat16 embedding, accumulated
  # and kept in float32: within float32 summation error (D * 2^-24 of sum |h_i w_i|) of the
  # exact product, not rounded to bfloat16 (2^-9 of each logit).
  hidden, _ = model.decoder(
      x, jnp.broadcast_to(jnp.arange(L), x.shape), segment_ids=(jnp.ones_like(x),) * 2
  )
  assert hidden.dtype == jnp.bfloat16
  h = np.asarray(hidden.astype(jnp.float32), np.float64)
  w = np.asarray(
      model.tokens.embed.embedding[...].astype(jnp.bfloat16).astype(jnp.float32), np.float64
  )
  exact, scale = h @ w.T, np.abs(h) @ np.abs(w).T
  assert np.all(np.abs(np.asarray(logits, np.float64) - exact) <= D * 2.0**-24 * scale)
  loss, grads = nnx.value_and_grad(mean_loss)(model, x)
  assert loss.dtype == jnp.float32
  assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}


def test_a_bfloat16_loss_is_within_rounding_of_the_float32_loss():
  """The same parameters and batch in float32 and in bfloat16 compute.

  Tolerance: bfloat16 keeps 8 significant bits; round-to-nearest errs by a uniform fraction
  of at most u = 2^-8 of a value: unbiased, standard deviation u / sqrt(3). Along any path
  from the tokens to the logits a transformer layer rounds at most 12 times (LayerNorm outputs,
  query/key/value, attention output and its projection, residual sum; the same for the MLP),
  embedding, final LayerNorm and output weights 5 times more: n = 12 layers + 5 independent
  roundings with gains ~1 give a logit relative error of standard deviation u sqrt(n / 3).
  A token's cross entropy logsumexp(z) - z_y moves by sum_j (p_j - [j = y]) dz_j: standard
  deviation <= sqrt(2) of one logit's; the loss averages T tokens' independent errors. The
  bound is 6 standard deviations of that.
  """
  x = tokens(1)
  f32 = models.DecoderLM(lm_config(dtype='float32'), rngs=nnx.Rngs(0))
  bf16 = models.DecoderLM(lm_config(dtype='bfloat16'), rngs=nnx.Rngs(0))
  u, n, num_tokens = 2.0**-8, 12 * LAYERS + 5, B * (L - 1)
  logits, _ = f32(x[:, :-1])
  logit_error = u * np.sqrt(n / 3) * float(jnp.sqrt(jnp.mean(jnp.square(logits))))
  bound = 6 * np.sqrt(2) * logit_error / np.sqrt(num_tokens)
  difference = abs(float(mean_loss(bf16, x)) - float(mean_loss(f32, x)))
  assert difference <= bound, (difference, bound)


# ------------------------------------------------------------------ remat


def loss_and_grads(remat, dtype='float32'):
  model = models.DecoderLM(lm_config(remat=remat, dtype=dtype), rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  x = tokens(2)
  fn = lambda params: mean_loss(nnx.merge(graphdef, params), x)
  return jax.jit(jax.value_and_grad(fn))(params), fn, params


@pytest.mark.parametrize('remat', ['full', 'dots_saveable', 'nothing_saveable'])
def test_remat_changes_neither_loss_nor_gradients(remat):
  (loss, grads), _, _ = loss_and_grads('none')
  (remat_loss, remat_grads), _, _ = loss_and_grads(remat)
  # The backward pass recomputes the same float32 operations; XLA may fuse them differently,
  # so equality up to a few float32 roundings (2^-24 each) of each value.
  np.testing.assert_allclose(remat_loss, loss, rtol=2.0**-20)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(remat_grads)):
    np.testing.assert_allclose(r, g, rtol=2.0**-16, atol=2.0**-20 * float(jnp.max(jnp.abs(g))))


def dots(remat):
  """Matrix products in the compiled program of the loss's gradient."""
  _, fn, params = loss_and_grads(remat)
  return len(re.findall(r'= \S+ dot\(', jax.jit(jax.grad(fn)).lower(params).compile().as_text()))


def test_remat_recomputes_the_forward_pass_in_the_compiled_program():
  _, fn, params = loss_and_grads('full')
  forward = str(jax.make_jaxpr(fn)(params))
  assert forward.count('remat') == LAYERS  # one checkpoint around each block
  _, fn, params = loss_and_grads('none')
  assert 'remat' not in str(jax.make_jaxpr(fn)(params))
  none, full, saved_dots = dots('none'), dots('full'), dots('dots_saveable')
  # 'full' recomputes each block's forward products in the backward pass; 'dots_saveable'
  # keeps them (and recomputes only the elementwise work between them).
  per_block_forward = 6  # query, key, value, logits, weighted sum, output projection...
  assert full >= none + LAYERS * per_block_forward, (none, full)
  assert saved_dots == none, (none, saved_dots)
