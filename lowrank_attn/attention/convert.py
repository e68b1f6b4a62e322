"""Exact conversions between attention kinds (pure functions of parameter dicts).

The reduced-width collaborative re-parametrization (a CP decomposition of the stacked
per-head W_Q^(i) W_K^(i)T) builds on `concat_to_collaborative`, its full-rank case.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np

from lowrank_attn.attention.spec import AttentionSpec


def concatenate_mixing(num_heads: int, key_dim: int, dtype=jnp.float32):
  """Block one-hot mixing `[num_heads, key_dim]`: head i owns its own slice of the key width.

  With key_dim = num_heads * head_dim a collaborative layer then computes exactly the logits
  of concatenated heads (Cordonnier et al. 2020, sec. 3.1). When key_dim is not a multiple
  of num_heads the slices differ in size by at most one column.
  """
  owner = np.arange(key_dim) * num_heads // key_dim  # the head owning each column
  return jnp.asarray(owner[None, :] == np.arange(num_heads)[:, None], dtype)


def concat_to_collaborative(params: dict, spec: AttentionSpec) -> tuple[dict, AttentionSpec]:
  """Re-parametrize a concat/fixed-head layer as a full-width collaborative one, exactly.

  W~_Q = [W_Q^(1) ... W_Q^(h)], W~_K likewise, block one-hot mixing. Of the bias terms in
  (x_q W_Q^(i) + b_Q^(i)) . (x_k W_K^(i) + b_K^(i)), only x_k . (W_K^(i) b_Q^(i)) changes across
  keys; the others are constant along a softmax row and cancel. So the content bias is
  c_i = W_K^(i) b_Q^(i) and the key bias is dropped. The logit scale stays the original.
  """
  if spec.kind not in ('concat', 'fixed_head') or spec.num_kv_heads != spec.num_heads:
    raise ValueError('concat_to_collaborative needs kind concat or fixed_head with '
                     f'num_kv_heads == num_heads, got kind={spec.kind!r}, '
                     f'num_kv_heads={spec.num_kv_heads}.')
  if spec.normalize_qk:
    raise ValueError('a layer with normalize_qk=True has no exact collaborative form.')
  h, d = spec.num_heads, spec.head_dim
  new_spec = dataclasses.replace(spec, kind='collaborative', key_dim=h * d)
  wq, wk = params['query_kernel'], params['key_kernel']
  new = {name: params[name] for name in ('value_kernel', 'value_bias', 'out_kernel', 'out_bias',
                                         'gate_log_alpha') if name in params}
  new['query_kernel'] = wq.reshape(wq.shape[0], h * d)
  new['key_kernel'] = wk.reshape(wk.shape[0], h * d)
  new['mixing'] = concatenate_mixing(h, h * d, wq.dtype)
  if spec.use_bias:
    new['content_bias'] = jnp.einsum('chd,hd->ch', wk, params['query_bias'])
  return new, new_spec
