"""The optimizer: which parameters weight decay reaches, the schedules, one AdamW update.

References are written independently of `optim.py`: decayed parameters as golden lists of
paths per model, the schedules as numpy closed forms, AdamW as a numpy update.
"""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lowrank_attn import models
from lowrank_attn.attention import AttentionSpec
from lowrank_attn.tasks import glue
from lowrank_attn.sharding import logical_metadata
from lowrank_attn.train import optim, state as state_lib

# ---------------------------------------------------------------------------- weight decay


def _config(**fields):
  return models.TransformerConfig(
      **{'vocab_size': 11, 'emb_dim': 8, 'mlp_dim': 16, 'max_length': 8, **fields}
  )


# name -> (model, config): every model kind, every attention kind, with and without biases,
# tied and untied embeddings, learned and sinusoidal positions, token types, post-LN.
MODELS = {
    'lm_concat_untied': (
        'lm',
        _config(
            num_decoder_layers=1, decoder_attention=AttentionSpec(num_heads=2), tie_embeddings=False
        ),
    ),
    'lm_talking_heads_no_bias_tied_sinusoidal': (
        'lm',
        _config(
            num_decoder_layers=1,
            positions='sinusoidal',
            decoder_attention=AttentionSpec(num_heads=2, kind='talking_heads', use_bias=False),
        ),
    ),
    'lm_fixed_head_gated_qk_norm': (
        'lm',
        _config(
            num_decoder_layers=1,
            decoder_attention=AttentionSpec(
                num_heads=2, kind='fixed_head', head_dim=2, gated=True, normalize_qk=True
            ),
        ),
    ),
    'mlm_collaborative_token_types_post_ln': (
        'mlm',
        _config(
            num_encoder_layers=1,
            type_vocab_size=2,
            norm='post',
            encoder_attention=AttentionSpec(num_heads=2, kind='collaborative', key_dim=4),
        ),
    ),
    'mlm_collaborative_no_bias_untied': (
        'mlm',
        _config(
            num_encoder_layers=1,
            tie_embeddings=False,
            encoder_attention=AttentionSpec(
                num_heads=2, kind='collaborative', key_dim=4, use_bias=False
            ),
        ),
    ),
    'nmt_gated_fixed_head_collaborative_talking_heads': (
        'nmt',
        _config(
            num_encoder_layers=1,
            num_decoder_layers=1,
            tie_embeddings=False,
            encoder_attention=AttentionSpec(num_heads=2, kind='fixed_head', head_dim=2, gated=True),
            decoder_attention=AttentionSpec(
                num_heads=2, kind='collaborative', key_dim=4, use_bias=False
            ),
            cross_attention=AttentionSpec(num_heads=2, kind='talking_heads'),
        ),
    ),
    'glue_classifier_token_types': (
        'glue',
        _config(
            num_encoder_layers=1,
            type_vocab_size=2,
            norm='post',
            encoder_attention=AttentionSpec(num_heads=2),
        ),
    ),
}

# Exactly the parameters that decay (checked by hand): kernels and embeddings. Never biases
# (per-head [heads, head_dim] ones and the collaborative content bias included), norms,
# gates, collaborative mixing vectors or talking-heads mixing matrices.
DECAYED = {
    'lm_concat_untied': """
        decoder/embedding/position_table
        decoder/embedding/tokens/embed/embedding
        decoder/layers/0/mlp/wi/kernel
        decoder/layers/0/mlp/wo/kernel
        decoder/layers/0/self_attention/key_kernel
        decoder/layers/0/self_attention/out_kernel
        decoder/layers/0/self_attention/query_kernel
        decoder/layers/0/self_attention/value_kernel
        output/kernel
    """,
    'lm_talking_heads_no_bias_tied_sinusoidal': """
        decoder/embedding/tokens/embed/embedding
        decoder/layers/0/mlp/wi/kernel
        decoder/layers/0/mlp/wo/kernel
        decoder/layers/0/self_attention/key_kernel
        decoder/layers/0/self_attention/out_kernel
        decoder/layers/0/self_attention/query_kernel
        decoder/layers/0/self_attention/value_kernel
    """,
    'lm_fixed_head_gated_qk_norm': """
        decoder/embedding/position_table
        decoder/embedding/tokens/embed/embedding
        decoder/layers/0/mlp/wi/kernel
        decoder/layers/0/mlp/wo/kernel
        decoder/layers/0/self_attention/key_kernel
        decoder/layers/0/self_attention/out_kernel
        decoder/layers/0/self_attention/query_kernel
        decoder/layers/0/self_attention/value_kernel
    """,
    'mlm_collaborative_token_types_post_ln': """
        encoder/embedding/position_table
        encoder/embedding/token_types/embedding
        encoder/embedding/tokens/embed/embedding
        encoder/layers/0/mlp/wi/kernel
        encoder/layers/0/mlp/wo/kernel
        encoder/layers/0/self_attention/key_kernel
        encoder/layers/0/self_attention/out_kernel
        encoder/layers/0/self_attention/query_kernel
        encoder/layers/0/self_attention/value_kernel
        head_dense/kernel
    """,
    'mlm_collaborative_no_bias_untied': """
        encoder/embedding/position_table
        encoder/embedding/tokens/embed/embedding
        encoder/layers/0/mlp/wi/kernel
        encoder/layers/0/mlp/wo/kernel
        encoder/layers/0/self_attention/key_kernel
        encoder/layers/0/self_attention/out_kernel
        encoder/layers/0/self_attention/query_kernel
        encoder/layers/0/self_attention/value_kernel
        head_dense/kernel
        output/kernel
    """,
    'nmt_gated_fixed_head_collaborative_talking_heads': """
        decoder/embedding/position_table
        decoder/embedding/tokens/embed/embedding
        decoder/layers/0/cross_attention/key_kernel
        decoder/layers/0/cross_attention/out_kernel
        decoder/layers/0/cross_attention/query_kernel
        decoder/layers/0/cross_attention/value_kernel
        decoder/layers/0/mlp/wi/kernel
        decoder/layers/0/mlp/wo/kernel
        decoder/layers/0/self_attention/key_kernel
        decoder/layers/0/self_attention/out_kernel
        decoder/layers/0/self_attention/query_kernel
        decoder/layers/0/self_attention/value_kernel
        encoder/embedding/position_table
        encoder/layers/0/mlp/wi/kernel
        encoder/layers/0/mlp/wo/kernel
        encoder/layers/0/self_attention/key_kernel
        encoder/layers/0/self_attention/out_kernel
        encoder/layers/0/self_attention/query_kernel
        encoder/layers/0/self_attention/value_kernel
        output/kernel
    """,
    'glue_classifier_token_types': """
        classifier/kernel
        encoder/embedding/position_table
        encoder/embedding/token_types/embedding
        encoder/embedding/tokens/embed/embedding
        encoder/layers/0/mlp/wi/kernel
        encoder/layers/0/mlp/wo/kernel
        encoder/layers/0/self_attention/key_kernel
        encoder/layers/0/self_attention/out_kernel
        encoder/layers/0/self_attention/query_kernel
        encoder/layers/0/self_attention/value_kernel
    """,
}


def _abstract_params(kind: str, cfg: models.TransformerConfig) -> nnx.State:
  build = {
      'lm': lambda: models.DecoderLM(cfg, rngs=nnx.Rngs(0)),
      'mlm': lambda: models.EncoderMLM(cfg, rngs=nnx.Rngs(0)),
      'nmt': lambda: models.EncoderDecoder(cfg, bos_id=1, rngs=nnx.Rngs(0)),
      'glue': lambda: glue.SentenceClassifier(
          cfg, num_outputs=2, pooling='mean', classifier_dropout=0.1, rngs=nnx.Rngs(0)
      ),
  }[kind]
  return nnx.state(nnx.eval_shape(build), nnx.Param)


def _paths(tree, keep=lambda leaf: True) -> list[str]:
  return sorted(
      state_lib.parameter_path(p)
      for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
      if keep(leaf)
  )


@pytest.mark.parametrize('name', MODELS)
def test_exactly_kernels_and_embeddings_decay(name):
  params = _abstract_params(*MODELS[name])
  mask = optim.weight_decay_mask(params)
  assert _paths(mask) == _paths(nnx.to_pure_dict(params))  # the optimizer's tree
  assert _paths(mask, keep=bool) == DECAYED[name].split()


class _Layer(nnx.Module):

  def __init__(self, name, shape, axes):
    metadata = {} if axes is None else logical_metadata(*axes)
    setattr(self, name, nnx.Param(jnp.zeros(shape), **metadata))


@pytest.mark.parametrize(
    'name,shape,axes,message',
    [
        # A new kind of parameter must be classified, not decayed (or spared) by default.
        ('alibi_slopes', (4,), ('heads',), r'layer/alibi_slopes: no weight-decay role .*ROLES'),
        # A vector or a head-space parameter named like a kernel is not one.
        ('kernel', (8,), ('embed',), r'layer/kernel is named as a kernel but its logical axes'),
        ('query_kernel', (4, 4), ('heads', 'kv'), r"logical axes \('heads', 'kv'\) are not"),
        ('embedding', (11, 8), None, r'layer/embedding \(embedding\) carries no logical axes'),
    ],
)
def test_unclassified_parameters_fail_loudly(name, shape, axes, message):
  params = nnx.state({'layer': _Layer(name, shape, axes)}, nnx.Param)
  with pytest.raises(ValueError, match=message):
    optim.weight_decay_mask(params)


@pytest.mark.parametrize('trainable', [None, 'layers/1/'])
def test_setup_decays_what_the_mask_says(trainable, helpers):
  """`setup`'s optimizer on zero gradients: only the decayed (and trainable) parameters move."""
  config = helpers.load_config('lm', 'tiny')
  config.weight_decay, config.trainable = 0.1, trainable
  config.lr_schedule, config.warmup_steps = 'constant', 0
  s = state_lib.setup(config, vocab_size=11, bos_id=1)
  params = jax.tree.map(lambda a: jnp.ones(a.shape, a.dtype), s.abstract_state['params'])
  updates, _ = s.tx.update(jax.tree.map(jnp.zeros_like, params), s.tx.init(params), params)
  moved = _paths(updates, keep=lambda u: bool(jnp.any(u != 0)))
  expected = [
      p
      for p in _paths(optim.weight_decay_mask(nnx.state(s.abstract_model, nnx.Param)), keep=bool)
      if trainable is None or trainable in p
  ]
  assert moved == expected
  assert moved and all(p.endswith(('kernel', 'embedding', 'position_table')) for p in moved)
  for path, update in jax.tree_util.tree_flatten_with_path(updates)[0]:
    if state_lib.parameter_path(path) in moved:  # decoupled: -lr x weight_decay x parameter
      np.testing.assert_allclose(update, -config.learning_rate * 0.1, rtol=1e-6)


# ---------------------------------------------------------------------------- schedules


def _reference_lr(step, *, lr, warmup, total, decay, end):
  """Closed forms, float64."""
  if warmup > 0 and step < warmup:
    return lr * step / warmup  # linear from 0
  if decay == 'inverse_sqrt':
    # Vaswani et al. (2017) eq. 3: lr x min(step / warmup, sqrt(warmup / step)); no warmup:
    # 1/sqrt(step + 1).
    return lr * np.sqrt(warmup / step) if warmup > 0 else lr / np.sqrt(step + 1)
  if decay == 'constant':
    return lr
  span = max(total - warmup, 1)
  t = min(step - warmup, span) / span  # fraction of the decay done
  if decay == 'cosine':
    return lr * (end + (1 - end) * (1 + np.cos(np.pi * t)) / 2)
  return lr * (1 - t) + lr * end * t  # linear


@pytest.mark.parametrize('decay', optim.SCHEDULES)
@pytest.mark.parametrize('warmup,end', [(0, 0.0), (10, 0.0), (10, 0.1), (0, 0.25)])
def test_schedules_match_closed_forms(decay, warmup, end):
  lr, total = 3e-3, 50
  schedule = optim.learning_rate_schedule(
      learning_rate=lr, warmup_steps=warmup, num_train_steps=total, decay=decay, end_factor=end
  )
  steps = np.arange(total + 10)  # past the end: cosine and linear stay at lr x end
  got = np.asarray(schedule(jnp.asarray(steps)))
  want = np.array(
      [_reference_lr(s, lr=lr, warmup=warmup, total=total, decay=decay, end=end) for s in steps]
  )
  np.testing.assert_allclose(got, want, rtol=2e-6, atol=lr * 1e-7)  # float32
  assert got.max() == pytest.approx(lr, rel=1e-6)


def test_unknown_schedule_names_the_field():
  with pytest.raises(ValueError, match=r"config\.lr_schedule='exp'"):
    optim.learning_rate_schedule(learning_rate=1.0, warmup_steps=0, num_train_steps=10, decay='exp')


# ---------------------------------------------------------------------------- AdamW


def _numpy_adamw(params, grads_per_step, decayed, *, lrs, b1, b2, eps, weight_decay, clip):
  """Loshchilov & Hutter (2019) AdamW, decay decoupled and scaled by the learning rate,
  after global-norm clipping; float64."""
  params = {k: np.asarray(v, np.float64) for k, v in params.items()}
  m = {k: np.zeros_like(v) for k, v in params.items()}
  v = {k: np.zeros_like(p) for k, p in params.items()}
  for t, (grads, lr) in enumerate(zip(grads_per_step, lrs), start=1):
    norm = np.sqrt(sum(np.sum(np.square(g, dtype=np.float64)) for g in grads.values()))
    scale = min(1.0, clip / norm)
    for k in params:
      g = grads[k] * scale
      m[k] = b1 * m[k] + (1 - b1) * g
      v[k] = b2 * v[k] + (1 - b2) * g * g
      step = (m[k] / (1 - b1**t)) / (np.sqrt(v[k] / (1 - b2**t)) + eps)
      if decayed[k]:
        step = step + weight_decay * params[k]
      params[k] = params[k] - lr * step
  return params


def test_adamw_matches_numpy_and_spares_the_bias():
  rng = np.random.default_rng(0)
  # A per-head bias is a matrix too: the case the old `ndim > 1` rule decayed.
  params = {
      'query_kernel': rng.normal(size=(4, 2, 3)).astype(np.float32),
      'query_bias': rng.normal(size=(2, 3)).astype(np.float32),
  }
  decayed = {'query_kernel': True, 'query_bias': False}
  # Global norms ~0.2, ~4 and ~0.4 around the clip norm 1: clipped on one step only (a clip
  # applied on every step, or at another norm, rescales every step alike, which Adam cancels).
  grads = [
      {k: (f * rng.normal(size=p.shape)).astype(np.float32) for k, p in params.items()}
      for f in (0.05, 1.0, 0.1)
  ]
  hyper = dict(b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.1)
  schedule = optim.learning_rate_schedule(
      learning_rate=0.05, warmup_steps=2, num_train_steps=3, decay='linear'
  )
  tx = optim.make_optimizer(schedule, **hyper, grad_clip_norm=1.0, decay_mask=decayed)
  state, got = tx.init(params), dict(params)
  for g in grads:
    updates, state = tx.update(g, state, got)
    got = optax.apply_updates(got, updates)
  want = _numpy_adamw(params, grads, decayed, lrs=[0.0, 0.025, 0.05], clip=1.0, **hyper)
  for k in params:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
  # And the decay made a difference where it applies, none where it does not.
  undecayed = _numpy_adamw(
      params, grads, decayed, lrs=[0.0, 0.025, 0.05], clip=1.0, **{**hyper, 'weight_decay': 0.0}
  )
  assert np.abs(want['query_kernel'] - undecayed['query_kernel']).max() > 1e-4
  np.testing.assert_array_equal(want['query_bias'], undecayed['query_bias'])


def test_gates_get_their_own_learning_rate_on_the_same_schedule():
  """config.gate_learning_rate: the gate's AdamW step is the numpy one at the gate rate times
  the schedule's shape, every other parameter's at the model's rate."""
  rng = np.random.default_rng(1)
  params = {
      'query_kernel': rng.normal(size=(4, 2, 3)).astype(np.float32),
      'gate_log_alpha': rng.normal(size=(2,)).astype(np.float32),
  }
  decayed = {'query_kernel': True, 'gate_log_alpha': False}
  grads = [
      {k: (0.1 * rng.normal(size=p.shape)).astype(np.float32) for k, p in params.items()}
      for _ in range(3)
  ]
  hyper = dict(b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.01)
  schedule = optim.learning_rate_schedule(
      learning_rate=5e-5, warmup_steps=2, num_train_steps=3, decay='linear'
  )
  abstract = nnx.State(
      {
          'query_kernel': nnx.Param(jnp.zeros((4, 2, 3))),
          'gate_log_alpha': nnx.Param(jnp.zeros((2,))),
      }
  )
  scales = optim.role_scales(abstract, {'gate': 0.05 / 5e-5})
  assert scales == {'query_kernel': 1.0, 'gate_log_alpha': pytest.approx(1000.0)}
  tx = optim.make_optimizer(
      schedule, **hyper, grad_clip_norm=0.0, decay_mask=decayed, update_scales=scales
  )
  state, got = tx.init(params), dict(params)
  for g in grads:
    updates, state = tx.update(g, state, got)
    got = optax.apply_updates(got, updates)
  kernel = _numpy_adamw(params, grads, decayed, lrs=[0.0, 2.5e-5, 5e-5], clip=np.inf, **hyper)
  gate = _numpy_adamw(params, grads, decayed, lrs=[0.0, 0.025, 0.05], clip=np.inf, **hyper)
  np.testing.assert_allclose(got['query_kernel'], kernel['query_kernel'], rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(got['gate_log_alpha'], gate['gate_log_alpha'], rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match=r"no parameter role \['gates'\]"):
    optim.role_scales(abstract, {'gates': 2.0})


def test_gate_learning_rate_reaches_the_optimizer_only_when_set(helpers):
  from lowrank_attn.train import config as config_lib  # pylint: disable=g-import-not-at-top

  config = config_lib.load('configs/lm.py:tiny')
  config.model.attention.gated = True
  config.learning_rate, config.warmup_steps = 1e-3, 0
  plain = state_lib.setup(config, vocab_size=11, bos_id=1)
  config.gate_learning_rate = 0.5
  gated = state_lib.setup(config, vocab_size=11, bos_id=1)
  # The optimizer state of a run without the field is unchanged (old checkpoints restore).
  plain_state = jax.eval_shape(plain.tx.init, plain.abstract_state['params'])
  assert jax.tree.structure(plain_state) != jax.tree.structure(
      jax.eval_shape(gated.tx.init, gated.abstract_state['params'])
  )
  params = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), gated.abstract_state['params'])
  grads = jax.tree.map(jnp.ones_like, params)
  updates, _ = gated.tx.update(grads, gated.tx.init(params), params)
  flat = {
      '/'.join(str(getattr(k, 'key', k)) for k in path): np.asarray(u)
      for path, u in jax.tree_util.tree_flatten_with_path(updates)[0]
  }
  # Adam's first step is lr * sign(g): the gates' is 500x the others'.
  gates = [u for name, u in flat.items() if name.endswith('gate_log_alpha')]
  biases = [u for name, u in flat.items() if name.endswith('out_bias')]
  assert gates and biases
  np.testing.assert_allclose(np.concatenate([g.ravel() for g in gates]), -0.5, rtol=1e-5)
  np.testing.assert_allclose(np.concatenate([b.ravel() for b in biases]), -1e-3, rtol=1e-5)
  config.learning_rate = 0.0
  with pytest.raises(ValueError, match='gate_learning_rate.*needs learning_rate > 0'):
    config_lib.validate(config)
