"""`AttentionSpec.implementation` end to end: spec, NNX layer, models and training config.

The kernels' blockwise path is checked against the materialising one in `test_blockwise.py`;
here: the option reaches the kernel from every place that can set it, and layers and models
compute the same losses and gradients with it.
"""

import dataclasses
import functools
import pathlib

from absl import flags
from flax import nnx
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np
import pytest

from lowrank_attn import models
from lowrank_attn import nn as lnn
from lowrank_attn.attention import AttentionSpec, blockwise
from lowrank_attn.train import config as config_lib

CONFIG = pathlib.Path(__file__).resolve().parents[2] / 'configs' / 'lm.py'
D, H, L, BLOCK = 8, 2, 7, 3  # lengths that are not a multiple of the block size
V = 23


def blockwise_twin(spec: AttentionSpec) -> AttentionSpec:
  return dataclasses.replace(spec, implementation='blockwise', block_size=BLOCK)


def value_and_grads(module, loss_fn, *args):
  """`loss_fn(module, *args)` and its gradients w.r.t. the module's parameters and the
  floating-point args."""
  graphdef, params, rest = nnx.split(module, nnx.Param, ...)
  argnums = (0, *(i + 1 for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating)))

  @jax.jit
  def run(params, *args):
    loss = lambda params, *args: loss_fn(nnx.merge(graphdef, params, rest), *args)
    return jax.value_and_grad(loss, argnums=argnums)(params, *args)

  return run(params, *args)


def assert_same(result, expected):
  (loss, grads), (expected_loss, expected_grads) = result, expected
  np.testing.assert_allclose(loss, expected_loss, atol=1e-5, rtol=1e-5)
  leaves = jax.tree.leaves_with_path(expected_grads)
  for (path, g_expected), g in zip(leaves, jax.tree.leaves(grads), strict=True):
    np.testing.assert_allclose(
        g, g_expected, atol=5e-5, rtol=5e-4, err_msg=jax.tree_util.keystr(path)
    )


# ------------------------------------------------------------------ the spec


def test_spec_validates_the_options_and_they_change_no_size_or_cost():
  spec = AttentionSpec(num_heads=H, in_features=D)
  assert (spec.implementation, spec.block_size) == ('auto', 128)
  for implementation in ('xla', 'blockwise', 'cudnn', 'splash'):
    other = dataclasses.replace(spec, implementation=implementation, block_size=5)
    assert other.param_shapes() == spec.param_shapes()
    assert other.flops(2, 9) == spec.flops(2, 9)
    assert other.options()['implementation'] == implementation
  with pytest.raises(ValueError, match=r"implementation='flash' is not one of \('auto', 'xla', "):
    AttentionSpec(num_heads=H, implementation='flash')
  for bad in (0, 2.0, True):
    with pytest.raises(ValueError, match=rf'block_size={bad!r} must be an integer >= 1'):
      AttentionSpec(num_heads=H, block_size=bad)


# ------------------------------------------------------------------ the layer


LAYER_KINDS = {  # every kind once, gates and grouped keys on the way
    'concat_grouped_query': dict(num_kv_heads=1),
    'fixed_head_gated': dict(kind='fixed_head', head_dim=3, gated=True),
    'collaborative': dict(kind='collaborative', key_dim=6),
    'talking_heads': dict(kind='talking_heads'),
}


def layer_loss(layer, x, mask):
  out = layer(x, mask=mask, is_causal=True, deterministic=True)
  return jnp.sum(jnp.sin(out))  # a gradient that differs per output element


@pytest.mark.parametrize('kind', LAYER_KINDS)
def test_blockwise_layer_equals_xla_layer(kind, make_params):
  """Causal self-attention with padding (a padded query sees no key), random parameters
  (talking-heads mixing away from the identity, gates strictly between 0 and 1)."""
  xla = lnn.MultiHeadAttention(H, D, rngs=nnx.Rngs(0), **LAYER_KINDS[kind])
  for name, value in make_params(xla.spec, seed=3).items():
    getattr(xla, name)[...] = value
  layer = lnn.MultiHeadAttention.from_spec(blockwise_twin(xla.spec), rngs=nnx.Rngs(1))
  nnx.update(layer, nnx.state(xla, nnx.Param))
  assert layer.spec.implementation == 'blockwise'

  x = jax.random.normal(jax.random.key(0), (2, L, D))
  valid = jnp.arange(L) < jnp.array([[L], [4]])
  mask = nnx.make_attention_mask(valid, valid)
  assert_same(
      value_and_grads(layer, layer_loss, x, mask), value_and_grads(xla, layer_loss, x, mask)
  )


def test_blockwise_layer_refuses_to_return_weights_or_logits():
  layer = lnn.MultiHeadAttention(H, D, implementation='blockwise', rngs=nnx.Rngs(0))
  x = jnp.ones((1, L, D))
  for argument in ('return_weights', 'return_logits'):
    with pytest.raises(ValueError, match=rf"{argument}=True needs implementation='xla'"):
      layer(x, **{argument: True})
  with pytest.raises(
      ValueError, match="sow_weights=True needs implementation='xla', not " "'blockwise'"
  ):
    layer(x, sow_weights=True)


@pytest.mark.parametrize('implementation', ['blockwise', 'splash'])
def test_decoding_computes_as_xla(implementation):
  """Step-by-step decoding equals the xla layer's causal call, even for a kernel ('splash')
  that cannot run here and takes no cache."""
  xla = lnn.MultiHeadAttention(H, D, kind='collaborative', key_dim=6, rngs=nnx.Rngs(0))
  layer = lnn.MultiHeadAttention.from_spec(
      dataclasses.replace(xla.spec, implementation=implementation), rngs=nnx.Rngs(0)
  )
  x = jax.random.normal(jax.random.key(0), (2, L, D))
  if implementation == 'splash':
    with pytest.raises(ValueError, match='needs a TPU backend'):
      layer(x, is_causal=True)
  layer.init_cache(x.shape)
  step = nnx.jit(lambda layer, x: layer(x, decode=True))
  steps = [step(layer, x[:, i : i + 1]) for i in range(L)]
  np.testing.assert_allclose(
      jnp.concatenate(steps, axis=1), xla(x, is_causal=True), atol=1e-5, rtol=1e-5
  )


# ------------------------------------------------------------------ the models


def model_config(implementation, **overrides):
  templates = {
      f'{t}_attention': AttentionSpec(
          num_heads=H, implementation=implementation, block_size=BLOCK, **options
      )
      for t, options in (
          ('encoder', dict(kind='collaborative', key_dim=6)),
          ('decoder', dict(num_kv_heads=1)),
          ('cross', dict(gated=True, gate_log_alpha_init=0.5)),
      )
  }
  return models.TransformerConfig(
      vocab_size=V,
      emb_dim=D,
      mlp_dim=16,
      num_encoder_layers=1,
      num_decoder_layers=1,
      max_length=16,
      dropout_rate=0.0,
      **templates,
      **overrides,
  )


def cross_entropy(logits, targets):
  weights = (targets != 0).astype(jnp.float32)
  log_p = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
  return -jnp.sum(log_p * weights) / jnp.sum(weights)


def lm_loss(model, tokens, segments):
  logits, _ = model(tokens[:, :-1], segment_ids=segments[:, :-1])
  return cross_entropy(logits, tokens[:, 1:] * (segments[:, 1:] > 0))


def nmt_loss(model, inputs, targets):
  logits, _ = model(inputs, targets)
  return cross_entropy(logits, targets)


def tokens(shape, seed, padding):
  """Random tokens, the last `padding[i]` of row i being padding (0)."""
  x = np.random.default_rng(seed).integers(1, V, shape)
  for row, count in enumerate(padding):
    x[row, shape[1] - count :] = 0
  return jnp.asarray(x, jnp.int32)


def spy_on_blockwise(monkeypatch):
  """The `is_causal` of every blockwise call, in call order."""
  calls, real = [], blockwise.blockwise_attention

  @functools.wraps(real)
  def spy(*args, is_causal=False, **kwargs):
    calls.append(is_causal)
    return real(*args, is_causal=is_causal, **kwargs)

  monkeypatch.setattr(blockwise, 'blockwise_attention', spy)
  return calls


def test_decoder_lm_with_blockwise_attention_equals_xla(monkeypatch):
  """Packed rows and padding; causality comes from is_causal, not from a [q, kv] mask."""
  xla = models.DecoderLM(model_config('xla'), rngs=nnx.Rngs(0))
  model = models.DecoderLM(model_config('blockwise'), rngs=nnx.Rngs(1))
  nnx.update(model, nnx.state(xla, nnx.Param))
  x = tokens((2, 11), seed=0, padding=(0, 3))
  segments = jnp.asarray([[1] * 6 + [2] * 5, [1] * 8 + [0] * 3], jnp.int32)
  calls = spy_on_blockwise(monkeypatch)
  assert_same(
      value_and_grads(model, lm_loss, x, segments), value_and_grads(xla, lm_loss, x, segments)
  )
  assert calls and all(calls), calls  # every decoder self-attention call is causal


def test_encoder_decoder_with_blockwise_attention_equals_xla(monkeypatch):
  xla = models.EncoderDecoder(model_config('xla'), bos_id=1, rngs=nnx.Rngs(0))
  model = models.EncoderDecoder(model_config('blockwise'), bos_id=1, rngs=nnx.Rngs(1))
  nnx.update(model, nnx.state(xla, nnx.Param))
  inputs = tokens((2, 10), seed=1, padding=(0, 4))
  targets = tokens((2, 7), seed=2, padding=(2, 0))
  calls = spy_on_blockwise(monkeypatch)
  assert_same(
      value_and_grads(model, nmt_loss, inputs, targets),
      value_and_grads(xla, nmt_loss, inputs, targets),
  )
  # Traced once: encoder self (not causal), decoder self (causal), cross (not causal).
  assert calls == [False, True, False], calls


def test_blockwise_model_never_materialises_attention_logits():
  """No float array ends in [q, kv] = [11, 11] in the blockwise model's gradient (in the
  xla model's, the logits and weights do)."""
  x = tokens((2, 12), seed=0, padding=(0, 3))
  segments = (x != 0).astype(jnp.int32)

  def square_float_shapes(implementation):
    model = models.DecoderLM(model_config(implementation), rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    loss = lambda p: lm_loss(nnx.merge(graphdef, p, rest), x, segments)
    jaxpr = jax.make_jaxpr(jax.grad(loss))(params).jaxpr
    return [
        v.aval.shape
        for v in _variables(jaxpr)
        if jnp.issubdtype(v.aval.dtype, jnp.floating) and v.aval.shape[-2:] == (11, 11)
    ]

  assert square_float_shapes('xla')
  assert not square_float_shapes('blockwise')


def _variables(jaxpr):
  """Every output variable of a jaxpr's equations, its sub-jaxprs' included."""
  for eqn in jaxpr.eqns:
    yield from eqn.outvars
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          yield from _variables(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          yield from _variables(sub)


# ------------------------------------------------------------------ the training config


def parse_flags(*overrides):
  """The config as `python -m lowrank_attn.main --config=configs/lm.py:tiny ...` parses it."""
  argv = ['main', f'--config={CONFIG}:tiny', *overrides]
  flag_values = flags.FlagValues()
  config_flags.DEFINE_config_file('config', flag_values=flag_values, sys_argv=argv)
  flag_values(argv)
  return flag_values.config


def test_command_line_selects_the_implementation():
  config = parse_flags(
      '--config.model.decoder_attention.implementation=blockwise',
      '--config.model.decoder_attention.block_size=64',
  )
  config_lib.validate(config)
  cfg = config_lib.model_config(config, vocab_size=V)
  assert (cfg.decoder_attention.implementation, cfg.decoder_attention.block_size) == (
      'blockwise',
      64,
  )
  model = nnx.eval_shape(lambda: models.DecoderLM(cfg, rngs=nnx.Rngs(0)))
  assert {layer.spec.implementation for layer in model.decoder.attention_layers()} == {'blockwise'}
  recorded = config_lib.from_dict(config_lib.to_dict(config))  # a run's config.json
  assert recorded.model.decoder_attention.implementation == 'blockwise'


@pytest.mark.parametrize(
    'override, message',
    [
        (
            'decoder_attention.implementation=flash',
            r"config\.model\.decoder_attention: implementation='flash' is not one of",
        ),
        ('attention.block_size=0', r'config\.model\.attention: block_size=0 must be an integer'),
    ],
)
def test_command_line_rejects_bad_values_naming_the_field(override, message):
  config = parse_flags(f'--config.model.{override}')
  with pytest.raises(ValueError, match=message):
    config_lib.validate(config)
