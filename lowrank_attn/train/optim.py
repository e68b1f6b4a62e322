"""Learning-rate schedules and the optimizer (optax).

AdamW after global-norm gradient clipping; linear warmup from 0, then one of
  inverse_sqrt  lr * sqrt(warmup / step)            (Vaswani et al. 2017, eq. 3)
  cosine        half cosine down to lr * end_factor at num_train_steps
  linear        straight line down to lr * end_factor at num_train_steps
  constant      lr
Weight decay skips vectors and scalars (biases, LayerNorm, gate log-alphas): decaying them
only fights the normalisation, and pulling gate log-alphas to 0 would half-close every gate.
Gradient accumulation is not an optax wrapper: `train_step` averages micro-batch gradients
itself, so one optimizer step is one training step and schedules count real steps.
"""

import jax
import jax.numpy as jnp
import optax

SCHEDULES = ('inverse_sqrt', 'cosine', 'linear', 'constant')


def learning_rate_schedule(*, learning_rate: float, warmup_steps: int, num_train_steps: int,
                           decay: str, end_factor: float = 0.0) -> optax.Schedule:
  if decay not in SCHEDULES:
    raise ValueError(f'config.lr_schedule={decay!r} is not one of {SCHEDULES}.')
  warmup = optax.linear_schedule(0.0, learning_rate, max(warmup_steps, 1))
  decay_steps = max(num_train_steps - warmup_steps, 1)
  end = learning_rate * end_factor
  if decay == 'inverse_sqrt':
    after = lambda count: learning_rate * jnp.sqrt(
        max(warmup_steps, 1) / (count + max(warmup_steps, 1)))
  elif decay == 'cosine':
    after = optax.cosine_decay_schedule(learning_rate, decay_steps, alpha=end_factor)
  elif decay == 'linear':
    after = optax.linear_schedule(learning_rate, end, decay_steps)
  else:
    after = optax.constant_schedule(learning_rate)
  if warmup_steps <= 0:
    return after
  return optax.join_schedules([warmup, after], [warmup_steps])


def _decay_mask(params):
  return jax.tree.map(lambda x: x.ndim > 1, params)


def make_optimizer(schedule: optax.Schedule, *, b1: float, b2: float, eps: float,
                   weight_decay: float, grad_clip_norm: float) -> optax.GradientTransformation:
  parts = []
  if grad_clip_norm > 0:
    parts.append(optax.clip_by_global_norm(grad_clip_norm))
  parts.append(optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                           mask=_decay_mask))
  return optax.chain(*parts)
