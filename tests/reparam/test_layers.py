"""NNX layers re-parametrized at any key width: `MultiHeadAttention.from_flax(kind=
'collaborative', key_dim=k)` for flax's layer and `layer.to_collaborative(k)` for ours,
checked against the layer written in numpy from the CP factors and flax's own outputs."""

import inspect
import math

from flax import nnx
import jax
import numpy as np
import pytest

from lowrank_attn import nn as lnn
from lowrank_attn.reparam.convert import CP_OPTIONS
from lowrank_attn.reparam import collaborative_factors

from .dense import (
    D_K,
    D_Q,
    HEAD_DIM,
    HEADS,
    RANK,
    cp_tensor,
    dense_tensor,
    reference,
    relative_error,
)


def flax_layer():
  """Flax's layer with random biases (zero biases would hide the content bias)."""
  return nnx.MultiHeadAttention(
      HEADS,
      D_Q,
      in_kv_features=D_K,
      decode=False,
      bias_init=nnx.initializers.normal(0.5),
      rngs=nnx.Rngs(0),
  )


def flax_weights(layer):
  return {
      f'{name}_{kind}': np.asarray(getattr(getattr(layer, name), kind)[...])
      for name in ('query', 'key', 'value', 'out')
      for kind in ('kernel', 'bias')
  }


def inputs(seed=1):
  rng = np.random.default_rng(seed)
  return (
      rng.standard_normal((2, 5, D_Q)).astype(np.float32),
      rng.standard_normal((2, 7, D_K)).astype(np.float32),
  )


def exact_content_bias(weights):
  return np.einsum(
      'khd,hd->kh',
      weights['key_kernel'].astype(np.float64),
      weights['query_bias'].astype(np.float64),
  )


def test_from_flax_below_full_width_is_the_layer_built_from_the_factors():
  theirs = flax_layer()
  ours = lnn.MultiHeadAttention.from_flax(theirs, kind='collaborative', key_dim=RANK)
  assert (ours.spec.kind, ours.spec.key_dim) == ('collaborative', RANK)
  assert ours.spec.logit_scale == pytest.approx(1 / math.sqrt(HEAD_DIM))  # the original's
  weights = flax_weights(theirs)
  factors = collaborative_factors(weights['query_kernel'], weights['key_kernel'], RANK)
  forms = cp_tensor(factors.query_kernel, factors.mixing, factors.key_kernel)
  x, y = inputs()
  expected = reference(forms, exact_content_bias(weights), weights, HEAD_DIM**-0.5, x, y)
  np.testing.assert_allclose(ours(x, y), expected, atol=1e-5)
  # At full width the same call reproduces flax's outputs.
  full = lnn.MultiHeadAttention.from_flax(theirs, kind='collaborative', key_dim=HEADS * HEAD_DIM)
  np.testing.assert_allclose(full(x, y), theirs(x, y), atol=3e-6)


def test_from_flax_routes_cp_options_and_layer_options():
  theirs = flax_layer()
  weights = flax_weights(theirs)
  ours = lnn.MultiHeadAttention.from_flax(
      theirs,
      kind='collaborative',
      key_dim=RANK,
      tol=0.5,
      rescale_logits=True,
      gated=True,
      deterministic=True,
  )
  early = collaborative_factors(weights['query_kernel'], weights['key_kernel'], RANK, tol=0.5)
  assert early.num_iterations < 100  # tol=0.5 stops after the first check
  np.testing.assert_allclose(ours.query_kernel[...], early.query_kernel, rtol=1e-6)
  assert ours.spec.gated and ours.spec.logit_scale == pytest.approx(1 / math.sqrt(RANK / HEADS))
  with pytest.raises(ValueError, match="only used by kind='collaborative'"):
    lnn.MultiHeadAttention.from_flax(theirs, kind='concat', tol=0.5)


def test_cp_options_are_the_keyword_arguments_of_the_decomposition():
  parameters = inspect.signature(collaborative_factors).parameters.values()
  assert CP_OPTIONS == tuple(p.name for p in parameters if p.kind == p.KEYWORD_ONLY)


def test_our_layer_to_collaborative():
  """A gated layer of ours, converted: exact at full width; below it, the error is the dense
  numpy error of its factors, the gates and settings are kept."""
  rngs = nnx.Rngs(0)
  layer = lnn.MultiHeadAttention(
      HEADS,
      D_Q,
      in_kv_features=D_K,
      gated=True,
      gate_log_alpha_init=5.0,
      deterministic=True,
      rngs=rngs,
      bias_init=nnx.initializers.normal(0.5),
  )
  layer.gate_log_alpha[...] = jax.numpy.asarray([5.0, -5.0, 5.0, 5.0])  # head 1 closed
  x, y = inputs()
  full, error = layer.to_collaborative(return_error=True)
  assert error == 0.0 and full.spec.gated and full.deterministic
  np.testing.assert_allclose(full(x, y), layer(x, y), atol=3e-6)

  reduced, error = layer.to_collaborative(RANK, return_error=True)
  weights = {name: np.asarray(value) for name, value in layer.kernel_params().items()}
  forms = cp_tensor(reduced.query_kernel[...], reduced.mixing[...], reduced.key_kernel[...])
  dense = relative_error(dense_tensor(weights['query_kernel'], weights['key_kernel']), forms)
  assert 0.05 < dense < 1.0
  np.testing.assert_allclose(error, dense, rtol=1e-5)
  np.testing.assert_array_equal(reduced.gate_log_alpha[...], layer.gate_log_alpha[...])
  gates = np.asarray(layer.gate_values())
  expected = reference(
      forms,
      exact_content_bias(weights),
      {**weights, 'out_kernel': weights['out_kernel'] * gates[:, None, None]},
      HEAD_DIM**-0.5,
      x,
      y,
  )
  np.testing.assert_allclose(reduced(x, y), expected, atol=1e-5)
  assert layer.spec.kind == 'concat'  # the original is unchanged
