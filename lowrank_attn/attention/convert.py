"""Conversions between attention kinds (pure functions of parameter dicts).

- `concat_to_collaborative`: concat/fixed-head -> collaborative, exact at full key width and a
  CP decomposition of the stacked per-head W_Q^(i) W_K^(i)T below it (`lowrank_attn.reparam`).
- `per_head_svd`: the fair low-rank baseline at equal key width, each head's W_Q^(i) W_K^(i)T
  truncated by SVD, expressed as a collaborative layer with block one-hot mixing.
"""

import dataclasses
import math

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


def _check_convertible(name: str, spec: AttentionSpec) -> None:
  if spec.kind not in ('concat', 'fixed_head') or spec.num_kv_heads != spec.num_heads:
    raise ValueError(f'{name} needs kind concat or fixed_head with num_kv_heads == num_heads, '
                     f'got kind={spec.kind!r}, num_kv_heads={spec.num_kv_heads}.')
  if spec.normalize_qk:
    raise ValueError(f'{name}: a layer with normalize_qk=True has no collaborative form (its '
                     'logits are not bilinear in the inputs).')


def _unchanged_and_content_bias(params: dict, spec: AttentionSpec) -> dict:
  """Values, output and gates as they are, plus the content bias c_i = W_K^(i) b_Q^(i).

  Of the bias terms in (x_q W_Q^(i) + b_Q^(i)) . (x_k W_K^(i) + b_K^(i)), only x_k . c_i changes
  across keys; the others are constant along a softmax row and cancel, so b_K is dropped. This
  holds whatever the shared query/key width (Cordonnier et al. 2020).
  """
  new = {name: params[name] for name in ('value_kernel', 'value_bias', 'out_kernel', 'out_bias',
                                         'gate_log_alpha') if name in params}
  if spec.use_bias:
    new['content_bias'] = jnp.einsum('chd,hd->ch', params['key_kernel'], params['query_bias'])
  return new


# The keyword arguments of `lowrank_attn.reparam.collaborative_factors`, which the conversions
# pass on (`**cp_options`); everything else they take is a setting of the converted layer.
CP_OPTIONS = ('num_iterations', 'tol', 'num_starts', 'check_every', 'seed')


def concat_to_collaborative(params: dict, spec: AttentionSpec, key_dim: int | None = None, *,
                            rescale_logits: bool = False, return_error: bool = False,
                            **cp_options):
  """Re-parametrize a concat/fixed-head layer as a collaborative one of shared key width key_dim.

  From key_dim = num_heads * head_dim (the default) on, exactly: W~_Q = [W_Q^(1) ... W_Q^(h)],
  W~_K likewise, block one-hot mixing (Cordonnier et al. 2020, sec. 3.1). Below it, the
  rank-key_dim CP decomposition of T_i = W_Q^(i) W_K^(i)T (`lowrank_attn.reparam.
  collaborative_factors`, options `cp_options`). The content bias is exact at any width;
  values, output and gates are copied.

  The logit scale stays the original layer's (1/sqrt(head_dim) unless it had its own): the
  factors approximate its logits at that scale. `rescale_logits=True` instead uses
  1/sqrt(key_dim / num_heads), as the paper's code does (its layer divides by
  sqrt(dim_key_query_all / num_attention_heads) whatever it was converted from), which
  multiplies every logit by sqrt(num_heads * head_dim / key_dim).

  Returns:
    (params, spec), or (params, spec, relative_error) with `return_error=True`, where
    relative_error is |T - T^|_F / |T|_F of the query/key factors (0.0 when exact).
  """
  _check_convertible('concat_to_collaborative', spec)
  h, d = spec.num_heads, spec.head_dim
  key_dim = h * d if key_dim is None else key_dim
  scale = 1.0 / math.sqrt(key_dim / h) if rescale_logits else spec.logit_scale
  new_spec = dataclasses.replace(spec, kind='collaborative', key_dim=key_dim,
                                 logit_scale=float(scale))
  new = _unchanged_and_content_bias(params, spec)
  wq, wk = params['query_kernel'], params['key_kernel']
  if key_dim == h * d:  # exact, and cheaper than going through the general path
    new['query_kernel'] = wq.reshape(wq.shape[0], h * d)
    new['key_kernel'] = wk.reshape(wk.shape[0], h * d)
    new['mixing'] = concatenate_mixing(h, h * d, wq.dtype)
    error = 0.0
  else:
    # Imported here: reparam sits on top of the kernels and may import them at module level.
    from lowrank_attn.reparam.cp import collaborative_factors  # pylint: disable=g-import-not-at-top
    factors = collaborative_factors(wq, wk, key_dim, **cp_options)
    new['query_kernel'] = jnp.asarray(factors.query_kernel, wq.dtype)
    new['key_kernel'] = jnp.asarray(factors.key_kernel, wk.dtype)
    new['mixing'] = jnp.asarray(factors.mixing, wq.dtype)
    error = factors.relative_error
  return (new, new_spec, error) if return_error else (new, new_spec)


def per_head_svd(params: dict, spec: AttentionSpec, key_dim: int, *, return_error: bool = False):
  """The low-rank concat baseline at equal key width: each head's logits truncated by SVD.

  Head i keeps the best rank-k_i approximation of W_Q^(i) W_K^(i)T (Eckart-Young), k_i = its
  share of key_dim (key_dim / num_heads; shares differ by at most one when key_dim is not a
  multiple of num_heads). That is a concat layer with query/key head width k_i and value head
  width head_dim, which `AttentionSpec` cannot express (one head_dim for queries, keys and
  values), so it is returned as the collaborative layer computing the same logits: block
  one-hot mixing over key_dim columns, head i's columns being its rank-k_i factors with the
  singular values split evenly between queries and keys. The content bias is kept exact, as
  in `concat_to_collaborative` (a concat layer of head width k_i would only keep its
  projection onto its key directions); the logit scale and everything else are unchanged.

  Returns:
    (params, spec), or (params, spec, relative_error) with `return_error=True`: |T - T^|_F /
    |T|_F over all heads, from the discarded singular values (Eckart-Young).
  """
  _check_convertible('per_head_svd', spec)
  h, d = spec.num_heads, spec.head_dim
  if not isinstance(key_dim, int) or isinstance(key_dim, bool) or not h <= key_dim <= h * d:
    raise ValueError(f'per_head_svd: key_dim={key_dim!r} must be an integer from num_heads={h} '
                     f'to num_heads * head_dim={h * d} (rank 1 to head_dim per head).')
  wq, wk = params['query_kernel'], params['key_kernel']
  # SVD of W_Q^(i) W_K^(i)T from thin QRs of its factors, in float64: R_Q R_K^T is d x d.
  q64 = np.moveaxis(np.asarray(wq, np.float64), 1, 0)  # [h, D_q, d]
  k64 = np.moveaxis(np.asarray(wk, np.float64), 1, 0)
  basis_q, r_q = np.linalg.qr(q64)
  basis_k, r_k = np.linalg.qr(k64)
  u, s, vt = np.linalg.svd(r_q @ np.swapaxes(r_k, 1, 2))
  root = np.sqrt(s)[:, None, :]
  head_q = basis_q @ (u * root)  # [h, D_q, r]: columns sorted by singular value
  head_k = basis_k @ (np.swapaxes(vt, 1, 2) * root)
  mixing = np.asarray(concatenate_mixing(h, key_dim, np.float32)).astype(bool)
  query = np.zeros((wq.shape[0], key_dim))
  key = np.zeros((wk.shape[0], key_dim))
  for i in range(h):
    columns = np.flatnonzero(mixing[i])
    query[:, columns] = head_q[i, :, :len(columns)]
    key[:, columns] = head_k[i, :, :len(columns)]
  new = _unchanged_and_content_bias(params, spec)
  new['query_kernel'] = jnp.asarray(query, wq.dtype)
  new['key_kernel'] = jnp.asarray(key, wk.dtype)
  new['mixing'] = jnp.asarray(mixing, wq.dtype)
  new_spec = dataclasses.replace(spec, kind='collaborative', key_dim=key_dim,
                                 logit_scale=float(spec.logit_scale))
  if not return_error:
    return new, new_spec
  discarded = sum(np.sum(s[i, int(mixing[i].sum()):] ** 2) for i in range(h))
  total = np.sum(s ** 2)
  error = float(np.sqrt(discarded / total)) if total > 0 else 0.0
  return new, new_spec, error
