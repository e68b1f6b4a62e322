"""Learning-rate schedules and the optimizer (optax).

AdamW after global-norm gradient clipping; linear warmup from 0, then one of
  inverse_sqrt  lr * sqrt(warmup / step)            (Vaswani et al. 2017, eq. 3)
  cosine        half cosine down to lr * end_factor at num_train_steps
  linear        straight line down to lr * end_factor at num_train_steps
  constant      lr
Weight decay applies to kernels and embeddings only (`weight_decay_mask`), never to biases,
norms, gates or head-mixing parameters: decaying a norm or bias only fights the normalisation,
and pulling gate log-alphas to 0 would half-close every gate.
Gates may have their own peak learning rate (`config.gate_learning_rate`, on the same schedule):
Voita et al.'s gates must travel log-alpha units from their start to close, which a fine-tuning
rate such as 5e-5 never lets them do.
Gradient accumulation is not an optax wrapper: `train_step` averages micro-batch gradients
itself, so one optimizer step is one training step and schedules count real steps.
"""

from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
import optax

SCHEDULES = ('inverse_sqrt', 'cosine', 'linear', 'constant')


def learning_rate_schedule(
    *,
    learning_rate: float,
    warmup_steps: int,
    num_train_steps: int,
    decay: str,
    end_factor: float = 0.0,
) -> optax.Schedule:
  if decay not in SCHEDULES:
    raise ValueError(f'config.lr_schedule={decay!r} is not one of {SCHEDULES}.')
  warmup = optax.linear_schedule(0.0, learning_rate, max(warmup_steps, 1))
  decay_steps = max(num_train_steps - warmup_steps, 1)
  end = learning_rate * end_factor
  if decay == 'inverse_sqrt':
    after = lambda count: learning_rate * jnp.sqrt(
        max(warmup_steps, 1) / (count + max(warmup_steps, 1))
    )
  elif decay == 'cosine':
    after = optax.cosine_decay_schedule(learning_rate, decay_steps, alpha=end_factor)
  elif decay == 'linear':
    after = optax.linear_schedule(learning_rate, end, decay_steps)
  else:
    after = optax.constant_schedule(learning_rate)
  if warmup_steps <= 0:
    return after
  return optax.join_schedules([warmup, after], [warmup_steps])


# ---------------------------------------------------------------------------- weight decay

# The role of every parameter, by its name (the last part of its path): nnx's own names
# ('kernel', 'embedding', 'scale', 'bias') and those of our attention layer and models. A name
# missing here is a ValueError (`weight_decay_mask`): a new kind of parameter is classified on
# purpose, never decayed by default.
PARAMETER_ROLES = {
    # Projections of the residual stream (dense layers, attention's q/k/v/out, output layer).
    'kernel': 'kernel',
    'query_kernel': 'kernel',
    'key_kernel': 'kernel',
    'value_kernel': 'kernel',
    'out_kernel': 'kernel',
    # Lookup tables into the residual stream (tokens, token types, learned positions).
    'embedding': 'embedding',
    'position_table': 'embedding',
    # Biases, whatever their shape: per-head ones are [heads, head_dim] and the collaborative
    # content bias is [embed, heads] (the keys' share of a query bias, Cordonnier et al. 2020).
    'bias': 'bias',
    'query_bias': 'bias',
    'key_bias': 'bias',
    'value_bias': 'bias',
    'out_bias': 'bias',
    'content_bias': 'bias',
    'output_bias': 'bias',
    # LayerNorm scales (nnx's 'scale'; the per-head query/key norms).
    'scale': 'norm',
    'query_ln_scale': 'norm',
    'key_ln_scale': 'norm',
    # Voita et al. (2019) gates: decay would pull log-alpha to 0, half-closing every gate.
    'gate_log_alpha': 'gate',
    # Per-head mixing: collaborative attention's mixing vectors [heads, key] (Cordonnier et al.
    # 2020) and talking-heads' [heads, heads] matrices over the logits and the weights (Shazeer
    # et al. 2020). They recombine heads, not project the input; decay would pull them to 0
    # (uniform attention, no output) rather than to their start (talking heads: the identity,
    # where the layer equals concat).
    'mixing': 'mixing',
    'pre_softmax_mixing': 'mixing',
    'post_softmax_mixing': 'mixing',
}
DECAYED_ROLES = ('kernel', 'embedding')
# A decayed parameter reads from or writes to these feature spaces (its logical axes name one).
_FEATURE_AXES = ('embed', 'mlp')


def _path(path) -> str:
  return '/'.join(str(getattr(k, 'key', getattr(k, 'idx', k))) for k in path)


def decays(name: str, logical_axes: tuple[str | None, ...] | None, where: str = '') -> bool:
  """Whether AdamW decays a parameter called `name` whose dimensions carry `logical_axes`.

  Kernels and embeddings decay, everything else does not (`PARAMETER_ROLES`). The logical
  axes must agree with the role: a decayed parameter is a matrix (or higher) with one
  dimension on the model's feature space ('embed' or 'mlp'), so a vector or a head-space
  parameter named like a kernel fails here instead of being decayed.
  """
  where = where or name
  role = PARAMETER_ROLES.get(name)
  if role is None:
    raise ValueError(
        f'parameter {where}: no weight-decay role for the name {name!r}; add it to '
        f'lowrank_attn.train.optim.PARAMETER_ROLES (one of '
        f'{sorted(set(PARAMETER_ROLES.values()))}; {DECAYED_ROLES} decay).'
    )
  if role not in DECAYED_ROLES:
    return False
  if logical_axes is None:
    raise ValueError(
        f'parameter {where} ({role}) carries no logical axes (out_sharding '
        'metadata, lowrank_attn.sharding.logical_metadata); cannot check it.'
    )
  if len(logical_axes) < 2 or not set(_FEATURE_AXES) & set(logical_axes):
    raise ValueError(
        f'parameter {where} is named as a {role} but its logical axes {tuple(logical_axes)} '
        f'are not those of one (>= 2 dimensions, one of {_FEATURE_AXES}); rename it or '
        'classify it in lowrank_attn.train.optim.PARAMETER_ROLES.'
    )
  return True


def weight_decay_mask(params: nnx.State) -> dict[str, Any]:
  """True for each parameter that weight decay applies to (`decays`), as a pure dict.

  `params`: the model's `nnx.Param` state, abstract or not (`nnx.split(model, nnx.Param)`):
  the variables' logical axes are read from their metadata. The result has the structure of
  `nnx.to_pure_dict(params)`, the parameter tree the optimizer sees.
  """

  def one(path, variable):
    if not isinstance(variable, nnx.Variable):
      raise ValueError(
          f'weight_decay_mask needs the nnx.State of the parameters (Variables '
          f'with their metadata), got a {type(variable).__name__} at {_path(path)}.'
      )
    name = str(getattr(path[-1], 'key', path[-1]))
    return decays(name, variable.get_metadata().get('out_sharding'), _path(path))

  return nnx.to_pure_dict(
      jax.tree_util.tree_map_with_path(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))
  )


def role_scales(params: nnx.State, scales: dict[str, float]) -> dict[str, Any]:
  """Per parameter, the factor of its role in `scales` (1.0 for roles not named), shaped as
  `nnx.to_pure_dict(params)`: e.g. {'gate': 1000.0} to give gates their own learning rate."""
  unknown = sorted(set(scales) - set(PARAMETER_ROLES.values()))
  if unknown:
    raise ValueError(f'no parameter role {unknown}; roles: {sorted(set(PARAMETER_ROLES.values()))}')

  def one(path, variable):
    name = str(getattr(path[-1], 'key', path[-1]))
    if name not in PARAMETER_ROLES:
      decays(name, None, _path(path))  # raises, naming the unclassified parameter
    return float(scales.get(PARAMETER_ROLES[name], 1.0))

  return nnx.to_pure_dict(
      jax.tree_util.tree_map_with_path(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))
  )


def make_optimizer(
    schedule: optax.Schedule,
    *,
    b1: float,
    b2: float,
    eps: float,
    weight_decay: float,
    grad_clip_norm: float,
    decay_mask: Any,
    update_scales: Any = None,
) -> optax.GradientTransformation:
  """Global-norm clipping (if > 0), then AdamW, then (if given) each update times its
  parameter's factor in `update_scales` (`role_scales`).

  `decay_mask`: True where weight decay applies, a pytree shaped like the parameters (see
  `weight_decay_mask`) or a function of them returning one. A factor f on a parameter that
  does not decay is the same as a learning rate f times the schedule's for it.
  """
  parts = []
  if grad_clip_norm > 0:
    parts.append(optax.clip_by_global_norm(grad_clip_norm))
  parts.append(
      optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=decay_mask)
  )
  if update_scales is not None:
    parts.append(
        optax.stateless(
            lambda updates, params: jax.tree.map(lambda u, f: u * f, updates, update_scales)
        )
    )
  return optax.chain(*parts)


def config_optimizer(
    config, schedule: optax.Schedule, *, decay_mask: Any, update_scales: Any = None
) -> optax.GradientTransformation:
  """`make_optimizer` with the config's Adam, weight decay and clipping settings."""
  return make_optimizer(
      schedule,
      b1=config.adam_b1,
      b2=config.adam_b2,
      eps=config.adam_eps,
      weight_decay=config.weight_decay,
      grad_clip_norm=config.grad_clip_norm,
      decay_mask=decay_mask,
      update_scales=update_scales,
  )
