"""Conversions between attention kinds: of a layer's parameter dict, and of NNX layers.

- `concat_to_collaborative`: concat/fixed-head -> collaborative, exact at full key width and a
  CP decomposition of the stacked per-head W_Q^(i) W_K^(i)T below it (`collaborative_factors`).
- `per_head_svd`: the fair low-rank baseline at equal key width, each head's W_Q^(i) W_K^(i)T
  truncated by SVD, expressed as a collaborative layer with block one-hot mixing.
- `from_flax`, `layer_to_collaborative`: the same for NNX layers, behind
  `MultiHeadAttention.from_flax` and `MultiHeadAttention.to_collaborative`.
"""

import dataclasses
import math

from flax import nnx
import jax.numpy as jnp
import numpy as np

from lowrank_attn.attention import AttentionSpec, concatenate_mixing
from lowrank_attn.nn import MultiHeadAttention
from lowrank_attn.reparam.cp import collaborative_factors


def _check_convertible(name: str, spec: AttentionSpec) -> None:
  if spec.kind not in ('concat', 'fixed_head') or spec.num_kv_heads != spec.num_heads:
    raise ValueError(
        f'{name} needs kind concat or fixed_head with num_kv_heads == num_heads, '
        f'got kind={spec.kind!r}, num_kv_heads={spec.num_kv_heads}.'
    )
  if spec.normalize_qk:
    raise ValueError(
        f'{name}: a layer with normalize_qk=True has no collaborative form (its '
        'logits are not bilinear in the inputs).'
    )


def _unchanged_and_content_bias(params: dict, spec: AttentionSpec) -> dict:
  """Values, output and gates as they are, plus the content bias c_i = W_K^(i) b_Q^(i).

  Of the bias terms in (x_q W_Q^(i) + b_Q^(i)) . (x_k W_K^(i) + b_K^(i)), only x_k . c_i changes
  across keys; the others are constant along a softmax row and cancel, so b_K is dropped. This
  holds whatever the shared query/key width (Cordonnier et al. 2020).
  """
  new = {
      name: params[name]
      for name in ('value_kernel', 'value_bias', 'out_kernel', 'out_bias', 'gate_log_alpha')
      if name in params
  }
  if spec.use_bias:
    new['content_bias'] = jnp.einsum('chd,hd->ch', params['key_kernel'], params['query_bias'])
  return new


# The keyword arguments of `collaborative_factors`, which the conversions pass on
# (`**cp_options`); everything else they take is a setting of the converted layer.
CP_OPTIONS = ('num_iterations', 'tol', 'num_starts', 'check_every', 'seed')


def concat_to_collaborative(
    params: dict,
    spec: AttentionSpec,
    key_dim: int | None = None,
    *,
    rescale_logits: bool = False,
    return_error: bool = False,
    **cp_options,
):
  """Re-parametrize a concat/fixed-head layer as a collaborative one of shared key width key_dim.

  From key_dim = num_heads * head_dim (the default) on, exactly: W~_Q = [W_Q^(1) ... W_Q^(h)],
  W~_K likewise, block one-hot mixing (Cordonnier et al. 2020, sec. 3.1). Below it, the
  rank-key_dim CP decomposition of T_i = W_Q^(i) W_K^(i)T (`collaborative_factors`, options
  `cp_options`). The content bias is exact at any width; values, output and gates are copied.

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
  new_spec = dataclasses.replace(
      spec, kind='collaborative', key_dim=key_dim, logit_scale=float(scale)
  )
  new = _unchanged_and_content_bias(params, spec)
  wq, wk = params['query_kernel'], params['key_kernel']
  if key_dim == h * d:  # exact, and cheaper than going through the general path
    new['query_kernel'] = wq.reshape(wq.shape[0], h * d)
    new['key_kernel'] = wk.reshape(wk.shape[0], h * d)
    new['mixing'] = concatenate_mixing(h, h * d, wq.dtype)
    error = 0.0
  else:
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
    raise ValueError(
        f'per_head_svd: key_dim={key_dim!r} must be an integer from num_heads={h} '
        f'to num_heads * head_dim={h * d} (rank 1 to head_dim per head).'
    )
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
    query[:, columns] = head_q[i, :, : len(columns)]
    key[:, columns] = head_k[i, :, : len(columns)]
  new = _unchanged_and_content_bias(params, spec)
  new['query_kernel'] = jnp.asarray(query, wq.dtype)
  new['key_kernel'] = jnp.asarray(key, wk.dtype)
  new['mixing'] = jnp.asarray(mixing, wq.dtype)
  new_spec = dataclasses.replace(
      spec, kind='collaborative', key_dim=key_dim, logit_scale=float(spec.logit_scale)
  )
  if not return_error:
    return new, new_spec
  discarded = sum(np.sum(s[i, int(mixing[i].sum()) :] ** 2) for i in range(h))
  total = np.sum(s**2)
  error = float(np.sqrt(discarded / total)) if total > 0 else 0.0
  return new, new_spec, error


# --------------------------------------------------------------------------- NNX layers


def from_flax(
    module: nnx.MultiHeadAttention,
    *,
    kind: str = 'concat',
    key_dim: int | None = None,
    rescale_logits: bool = False,
    layer_class: type = MultiHeadAttention,
    **options,
) -> MultiHeadAttention:
  """`MultiHeadAttention.from_flax` (documented there): our layer (of `layer_class`) computing
  what `module` computes, re-parametrized by `concat_to_collaborative` for kind='collaborative'.
  """
  if not isinstance(module, nnx.MultiHeadAttention):
    raise ValueError(f'module must be a flax.nnx.MultiHeadAttention, got {type(module)}.')
  cp_options = {name: options.pop(name) for name in CP_OPTIONS if name in options}
  if kind != 'collaborative' and (key_dim is not None or rescale_logits or cp_options):
    raise ValueError(
        f'key_dim, rescale_logits and the CP options {CP_OPTIONS} are only used '
        f"by kind='collaborative' (got kind={kind!r})."
    )
  sizes = dict(
      num_heads=module.num_heads,
      in_features=module.in_features,
      qkv_features=module.qkv_features,
      out_features=module.out_features,
      num_kv_heads=module.num_kv_heads,
      in_kv_features=module.in_kv_features,
  )
  settings = dict(
      **sizes,
      kind=kind,
      head_dim=module.head_dim if kind == 'fixed_head' else None,
      dtype=module.dtype,
      param_dtype=module.param_dtype,
      broadcast_dropout=module.broadcast_dropout,
      dropout_rate=module.dropout_rate,
      deterministic=module.deterministic,
      precision=module.precision,
      use_bias=module.use_bias,
      decode=module.decode,
      normalize_qk=module.normalize_qk,
  )

  # Flax's parameters under our names, then (collaborative) re-parametrized.
  weights = {}
  for name in ('query', 'key', 'value', 'out'):
    weights[f'{name}_kernel'] = getattr(module, name).kernel[...]
    if module.use_bias:
      weights[f'{name}_bias'] = getattr(module, name).bias[...]
  if module.normalize_qk:
    weights['query_ln_scale'] = module.query_ln.scale[...]
    weights['key_ln_scale'] = module.key_ln.scale[...]
  if kind == 'collaborative':
    concat_spec = AttentionSpec(**sizes, use_bias=module.use_bias, normalize_qk=module.normalize_qk)
    weights, spec = concat_to_collaborative(
        weights, concat_spec, key_dim, rescale_logits=rescale_logits, **cp_options
    )
    settings.update(key_dim=spec.key_dim, logit_scale=spec.logit_scale)
  layer = layer_class(**{**settings, **options}, rngs=nnx.Rngs(0))  # parameters set below
  if module.rngs is not None and layer.rngs is not None:
    layer.rngs = nnx.clone(module.rngs)  # same dropout stream as the original
  layer.set_params(weights)
  return layer


def layer_to_collaborative(
    layer: MultiHeadAttention,
    key_dim: int | None = None,
    *,
    rescale_logits: bool = False,
    return_error: bool = False,
    **cp_options,
):
  """`MultiHeadAttention.to_collaborative` (documented there): a new collaborative layer of
  the same class, settings and dropout stream, from `concat_to_collaborative`."""
  params, spec, error = concat_to_collaborative(
      layer.kernel_params(),
      layer.spec,
      key_dim,
      rescale_logits=rescale_logits,
      return_error=True,
      **cp_options,
  )
  new = type(layer).from_spec(
      spec,
      rngs=nnx.Rngs(0),
      dtype=layer.dtype,
      param_dtype=layer.param_dtype,
      broadcast_dropout=layer.broadcast_dropout,
      deterministic=layer.deterministic,
      precision=layer.precision,
      decode=layer.decode,
      keep_rngs=layer.rngs is not None,
  )
  if layer.rngs is not None:
    new.rngs = nnx.clone(layer.rngs)
  new.set_params(params)
  return (new, error) if return_error else new
