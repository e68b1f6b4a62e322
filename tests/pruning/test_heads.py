"""Physical head pruning: outputs equal the head-masked original (every kind, through a
save/restore of the pruned run), sizes and FLOPs shrink as counted by hand, gate-derived keep
masks, gate initialisation, and the errors a wrong `keep` gets."""

import json

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_attn import models
from lowrank_attn.pruning import keep_from_gates, prune_heads
from lowrank_attn.runs import RunDir
from lowrank_attn.train import checkpoints, config as config_lib

V, D, H, LAYERS = 40, 16, 4, 2
KINDS = {
    'concat': dict(kind='concat'),
    'fixed_head': dict(kind='fixed_head', head_dim=6),
    'collaborative': dict(kind='collaborative', key_dim=12),
    'talking_heads': dict(kind='talking_heads'),
    'gated': dict(kind='concat', gated=True),
    'gated_collaborative': dict(kind='collaborative', key_dim=12, gated=True),
}


def small_config(**attention) -> models.TransformerConfig:
  spec = models.AttentionSpec(num_heads=H, **attention)
  return models.TransformerConfig(
      vocab_size=V,
      emb_dim=D,
      mlp_dim=32,
      num_encoder_layers=LAYERS,
      num_decoder_layers=LAYERS,
      encoder_attention=spec,
      decoder_attention=spec,
      cross_attention=spec,
      max_length=16,
      dropout_rate=0.0,
  )


def training_config(**attention):
  """The training config whose model config is `small_config(**attention)`."""
  config = config_lib.base_config('nmt')
  config.model.emb_dim, config.model.mlp_dim = D, 32
  config.model.max_length = config.data.max_length = config.decode.max_length = 16
  config.model.num_encoder_layers = config.model.num_decoder_layers = LAYERS
  config.model.dropout_rate = 0.0
  for field, value in {'num_heads': H, **attention}.items():
    config.model.attention[field] = value
  return config


def random_model(cfg, seed=0):
  """Every parameter moved away from its init (biases, mixing, gates), so no pruned term is
  trivially zero; gate log-alphas in [-4, 3]: some heads closed, some gates between 0 and 1."""
  model = models.EncoderDecoder(cfg, bos_id=1, rngs=nnx.Rngs(seed))
  rng = np.random.default_rng(seed)

  def perturb(path, x):
    if path[-1].key == 'gate_log_alpha':
      return jnp.asarray(rng.uniform(-4.0, 3.0, x.shape), x.dtype)
    return x + 0.3 * jnp.asarray(rng.standard_normal(x.shape), x.dtype)

  state = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(
      state, jax.tree_util.tree_map_with_path(perturb, nnx.to_pure_dict(state))
  )
  nnx.update(model, state)
  return model


def batch(seed=0):
  rng = np.random.default_rng(seed)
  inputs = rng.integers(3, V, (2, 9))
  inputs[1, 6:] = 0  # padding
  targets = rng.integers(3, V, (2, 7))
  return jnp.asarray(inputs, jnp.int32), jnp.asarray(targets, jnp.int32)


@nnx.jit
def logits_of(model, inputs, targets, head_masks=None):
  return model(inputs, targets, head_masks=head_masks)[0]


def random_keep(seed=0):
  """Random masks, plus the cases that must be covered: layers keeping no head, all heads,
  one head, and several heads that are not the first ones."""
  rng = np.random.default_rng(seed)
  keep = {t: rng.random((LAYERS, H)) < 0.5 for t in ('encoder', 'decoder', 'cross')}
  keep['encoder'][0] = False
  keep['encoder'][1] = [True, False, True, True]
  keep['decoder'][1] = False
  keep['cross'][0] = True
  keep['cross'][1] = [False, True, False, False]
  return keep


@pytest.mark.parametrize('name', list(KINDS))
def test_pruned_model_equals_masked_original_through_a_saved_run(name, tmp_path):
  model = random_model(small_config(**KINDS[name]))
  keep = random_keep()
  inputs, targets = batch()
  masks = {t: jnp.asarray(k, jnp.float32) for t, k in keep.items()}
  expected = logits_of(model, inputs, targets, masks)

  pruned = prune_heads(model, keep)
  assert pruned.cfg.encoder_attention.num_heads == tuple(keep['encoder'].sum(1))
  np.testing.assert_allclose(logits_of(pruned, inputs, targets), expected, atol=1e-5)

  # Saved as a run: config.json must rebuild the pruned model through the training config
  # (per-layer head counts as --config.model.<type>_attention.num_heads='(..)' would set them).
  config = training_config(**KINDS[name])
  assert config_lib.model_config(config, V) == model.cfg
  overrides = RunDir(tmp_path / 'pruned').write_model(pruned, config)
  assert overrides['model.encoder_attention.num_heads'] == tuple(keep['encoder'].sum(1))
  with open(tmp_path / 'pruned' / checkpoints.CONFIG_FILE) as f:
    restored_config = config_lib.from_dict(json.load(f))
  config_lib.validate(restored_config)
  restored_cfg = config_lib.model_config(restored_config, V)
  assert restored_cfg == pruned.cfg
  _, state = checkpoints.load_state(tmp_path / 'pruned')
  restored = models.EncoderDecoder(restored_cfg, bos_id=1, rngs=nnx.Rngs(1))
  nnx.update(restored, jax.tree.map(jnp.asarray, state['params']))
  np.testing.assert_allclose(logits_of(restored, inputs, targets), expected, atol=1e-5)


def test_attention_sites_name_every_layer_once_by_its_parameter_path():
  # The one walk pruning, re-parametrization and the L0 penalty share: model order (encoder,
  # then decoder self before cross), and paths that index the parameter tree.
  model = random_model(small_config())
  sites = model.attention_sites()
  assert [(s.attention_type, s.index) for s in sites] == [
      ('encoder', 0),
      ('encoder', 1),
      ('decoder', 0),
      ('cross', 0),
      ('decoder', 1),
      ('cross', 1),
  ]
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  for site in sites:
    node = params
    for key in site.path:
      node = node[key]
    expected = nnx.to_pure_dict(nnx.state(site.layer, nnx.Param))
    assert jax.tree.all(jax.tree.map(lambda a, b: a is b, node, expected)), site.path
  assert {t: [id(a) for a in layers] for t, layers in model.attention_layers().items()} == {
      t: [id(s.layer) for s in sites if s.attention_type == t]
      for t in ('encoder', 'decoder', 'cross')
  }
  assert list(model.decoder.attention_layers()) == [s.layer for s in sites[2:]]


def test_a_layer_without_heads_adds_only_its_output_bias():
  model = random_model(small_config())
  pruned = prune_heads(model, {'encoder': np.zeros((LAYERS, H), bool)})
  attention = pruned.encoder.layers[0].self_attention
  x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 5, D)), jnp.float32)
  out = attention(x)
  bias = np.asarray(model.encoder.layers[0].self_attention.out_bias[...])
  np.testing.assert_array_equal(out, np.broadcast_to(bias, out.shape))


def test_decoding_with_a_pruned_decoder_matches_the_full_pass():
  """The cache of a pruned (talking-heads) decoder: per-layer head counts, 0 included (in
  layer 0, whose cache position the decoder reads)."""
  model = random_model(small_config(kind='talking_heads'))
  pruned = prune_heads(model, {'decoder': np.array([[0, 0, 0, 0], [1, 0, 1, 0]], bool)})
  inputs, targets = batch()
  full = logits_of(pruned, inputs[:1], targets[:1])
  encoded, _ = pruned.encode(inputs[:1])
  pruned.init_cache(1, 16)
  shifted = jnp.concatenate([jnp.ones((1, 1), jnp.int32), targets[:1, :-1]], axis=1)
  steps = [
      pruned.decode(encoded, inputs[:1], shifted[:, i : i + 1], decode=True)[0]
      for i in range(shifted.shape[1])
  ]
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, rtol=1e-5, atol=1e-5)


def per_head_params(kind: str, d: int = D // H) -> int:
  """Parameters of one head, counted from the papers' layer definitions (D = in = out)."""
  if kind == 'concat':  # W_Q, W_K, W_V columns with biases, W_O rows
    return 3 * (D * d + d) + d * D
  if kind == 'collaborative':  # mixing row (key_dim), content-bias column, W_V, W_O
    return 12 + D + (D * d + d) + d * D
  raise ValueError(kind)


def shared_params(kind: str) -> int:
  """Parameters a layer shares among its heads, which go with its last head."""
  return 2 * D * 12 if kind == 'collaborative' else 0  # W_Q, W_K of width key_dim


@pytest.mark.parametrize('kind', ['concat', 'collaborative'])
def test_parameters_and_flops_shrink_by_the_pruned_heads(kind):
  model = random_model(small_config(**KINDS[kind]))
  keep = random_keep(1)
  pruned = prune_heads(model, keep)
  count = lambda m: sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))
  removed = sum(int((~k).sum()) for k in keep.values())
  emptied = sum(int((~k.any(axis=1)).sum()) for k in keep.values())
  assert count(pruned) == (
      count(model) - removed * per_head_params(kind) - emptied * shared_params(kind)
  )

  # Encoder self-attention FLOPs (2 x multiply-adds) of one head, concat: projections of n
  # tokens, n x n logits and weighted sum, output projection.
  b, n, d = 2, 9, D // H
  per_head = 2 * (3 * b * n * D * d + 2 * b * n * n * d + b * n * d * D)
  encoder_only = prune_heads(model, {'encoder': keep['encoder']})
  if kind == 'concat':
    saved = model.encoder.flops(b, n) - encoder_only.encoder.flops(b, n)
    assert saved == int((~keep['encoder']).sum()) * per_head
  assert pruned.flops(b, n, 7) < model.flops(b, n, 7)


def test_pruned_model_trains_like_the_masked_one():
  """Gradients of the kept parameters equal those of the masked original: training the pruned
  model is training with fixed head masks."""
  model = random_model(small_config())
  keep = random_keep(2)
  pruned = prune_heads(model, keep)
  inputs, targets = batch()
  masks = {t: jnp.asarray(k, jnp.float32) for t, k in keep.items()}

  def loss(m, head_masks=None):
    logits = m(inputs, targets, head_masks=head_masks)[0]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))

  full = nnx.jit(nnx.grad(loss))(model, masks)
  small = nnx.jit(nnx.grad(loss))(pruned)
  kept = np.flatnonzero(keep['encoder'][1])
  np.testing.assert_allclose(
      small['encoder']['layers'][1]['self_attention']['query_kernel'],
      np.asarray(full['encoder']['layers'][1]['self_attention']['query_kernel'])[:, kept],
      atol=1e-6,
  )
  np.testing.assert_allclose(
      small['decoder']['layers'][0]['mlp']['wi']['kernel'],
      full['decoder']['layers'][0]['mlp']['wi']['kernel'],
      atol=1e-6,
  )


def test_keep_from_gates_is_eval_gate_above_zero():
  model = random_model(small_config(gated=True))
  log_alpha = np.array([-5.0, -2.3, 0.0, 3.0], np.float32)
  model.encoder.layers[0].self_attention.gate_log_alpha[...] = log_alpha
  keep = keep_from_gates(model)
  # Louizos et al. eq. 13: gate = clip(sigmoid(log_alpha) * (1.1 + 0.1) - 0.1, 0, 1).
  gate = np.clip(1.2 / (1 + np.exp(-log_alpha)) - 0.1, 0, 1)
  np.testing.assert_array_equal(keep['encoder'][0], gate > 0)
  assert keep['encoder'][0].tolist() == [False, True, True, True]
  assert set(keep) == {'encoder', 'decoder', 'cross'}


def test_ungated_models_keep_every_head():
  keep = keep_from_gates(random_model(small_config()))
  assert all(k.all() and k.shape == (LAYERS, H) for k in keep.values())


def test_gate_log_alpha_init_glorot_as_voita():
  """Voita et al.'s gates start from TF's glorot-uniform over shape [1, h, 1, 1]:
  U(-limit, limit), limit = sqrt(6 / (fan_in + fan_out)) with fan_in = fan_out = h."""
  h = 64
  spec = models.AttentionSpec(
      num_heads=h, in_features=D, head_dim=2, gated=True, gate_log_alpha_init='glorot'
  )
  from lowrank_attn.nn import MultiHeadAttention

  log_alpha = np.asarray(MultiHeadAttention.from_spec(spec, rngs=nnx.Rngs(0)).gate_log_alpha[...])
  limit = np.sqrt(6.0 / (h + h))
  assert np.all(np.abs(log_alpha) <= limit)
  assert np.abs(log_alpha).max() > 0.8 * limit and np.std(log_alpha) > 0.4 * limit
  default = MultiHeadAttention.from_spec(
      models.AttentionSpec(num_heads=h, in_features=D, head_dim=2, gated=True), rngs=nnx.Rngs(0)
  )
  np.testing.assert_array_equal(default.gate_values(), 1.0)


def test_gate_log_alpha_init_from_the_config():
  config = config_lib.base_config('nmt')
  config.model.encoder_attention.gate_log_alpha_init = 'glorot'
  assert config_lib.model_config(config, V).encoder_attention.gate_log_alpha_init == 'glorot'
  config.model.encoder_attention.gate_log_alpha_init = 'xavier'
  with pytest.raises(ValueError, match=r"encoder_attention.*gate_log_alpha_init='xavier'"):
    config_lib.model_config(config, V)


@pytest.mark.parametrize(
    'keep, message',
    [
        (
            {'encoder': np.ones((LAYERS, H + 1), bool)},
            r"keep\['encoder'\] has shape \(2, 5\), " r'expected \[2, 4\]',
        ),
        ({'encoder': np.ones((LAYERS + 1, H), bool)}, r"keep\['encoder'\] has shape \(3, 4\)"),
        (
            {'decoder_self': np.ones((LAYERS, H), bool)},
            r"types \['decoder_self'\].*'cross', " r"'decoder', 'encoder'",
        ),
        ({'cross': np.full((LAYERS, H), 0.5)}, r"keep\['cross'\] layer 0 = \[0.5"),
    ],
)
def test_bad_keep_is_a_value_error_naming_it(keep, message):
  with pytest.raises(ValueError, match=message):
    prune_heads(random_model(small_config()), keep)


def test_grouped_keys_are_refused_not_pruned_wrongly():
  model = random_model(small_config(num_kv_heads=2))
  with pytest.raises(ValueError, match='encoder attention uses grouped keys'):
    prune_heads(model, {'encoder': np.array([[1, 0, 1, 1], [1, 1, 1, 1]], bool)})
  assert prune_heads(model, {}).cfg == model.cfg  # nothing pruned: nothing refused
