"""Whole models re-parametrized: every concat attention layer of chosen types made collaborative.

    converted = to_collaborative(model, key_dim=128)  # all concat / fixed_head attention
    converted.model            # a new model of the same class; the original is unchanged
    converted.config           # its TransformerConfig: those types collaborative at width 128
    converted.relative_errors  # {'encoder/layers/0/self_attention': |T - T^| / |T|, ...}

`to_low_rank_concat(model, key_dim)` is the fair baseline at equal key width: each head's
W_Q^(i) W_K^(i)T truncated by SVD to rank key_dim / heads. Everything but the converted
query/key parameters (embeddings, values, outputs, MLPs, norms, gates) is copied unchanged.
A converted model is a model like any other; `lowrank_attn.reparam.write_run` saves it as a
run that the training CLI fine-tunes (`--config.init_from`).
"""

from collections.abc import Callable, Sequence
import dataclasses
from typing import NamedTuple

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from lowrank_attn import models
from lowrank_attn.attention import AttentionSpec
from lowrank_attn.reparam.convert import concat_to_collaborative, per_head_svd

CONVERTIBLE_KINDS = ('concat', 'fixed_head')


class Converted(NamedTuple):
  """A re-parametrized model, its config and the error of each converted attention layer."""

  model: nnx.Module
  config: models.TransformerConfig
  # Per converted layer, by parameter path: |T - T^|_F / |T|_F of the per-head bilinear forms
  # T_i = W_Q^(i) W_K^(i)T (0.0 where exact).
  relative_errors: dict[str, float]


def to_collaborative(
    model: nnx.Module,
    key_dim: int | None = None,
    attention_types: Sequence[str] | None = None,
    *,
    rescale_logits: bool = False,
    **cp_options,
) -> Converted:
  """`model` with the attention of `attention_types` collaborative at shared key width key_dim.

  Each layer goes through `lowrank_attn.attention.concat_to_collaborative`: exact from
  key_dim = num_heads * head_dim on (None: that width), the CP decomposition of its per-head
  bilinear forms below it (`cp_options`: those of `lowrank_attn.reparam.collaborative_factors`),
  the content bias exact, the logit scale the original's unless `rescale_logits=True` (the
  paper's code).

  Args:
    model: a `DecoderLM`, `EncoderMLM` or `EncoderDecoder`.
    key_dim: the shared query/key width D~k of every converted layer.
    attention_types: of 'encoder', 'decoder', 'cross'; default: every type of the model whose
      layers are concat or fixed_head. A named type with another kind is a ValueError naming
      the layer.
  """

  def convert(params, spec):
    return concat_to_collaborative(
        params, spec, key_dim, rescale_logits=rescale_logits, return_error=True, **cp_options
    )

  return _convert(model, attention_types, convert)


def to_low_rank_concat(
    model: nnx.Module, key_dim: int, attention_types: Sequence[str] | None = None
) -> Converted:
  """`model` with each head's W_Q^(i) W_K^(i)T truncated by SVD to its share of key_dim.

  `lowrank_attn.attention.per_head_svd` per layer: concat heads of query/key width
  key_dim / num_heads, expressed as collaborative layers with block one-hot mixing (the
  config's mixing_init 'concatenate' draws the same mixing). To keep them concat heads while
  training, freeze the mixing (`--config.trainable='^(?!.*mixing)'`).
  """

  def convert(params, spec):
    return per_head_svd(params, spec, key_dim, return_error=True)

  return _convert(model, attention_types, convert)


def model_attention_types(model: nnx.Module) -> tuple[str, ...]:
  """The attention types a model has, in `models.ATTENTION_TYPES` order."""
  present = model.attention_layers()
  return tuple(t for t in models.ATTENTION_TYPES if t in present)


# ------------------------------------------------------------------------------ internals

LayerConversion = Callable[[dict, AttentionSpec], tuple[dict, AttentionSpec, float]]


def _convert(model: nnx.Module, attention_types, convert_layer: LayerConversion) -> Converted:
  if not isinstance(model, (models.DecoderLM, models.EncoderMLM, models.EncoderDecoder)):
    raise ValueError(
        f'model must be a DecoderLM, EncoderMLM or EncoderDecoder, got ' f'{type(model).__name__}.'
    )
  available = model_attention_types(model)
  if attention_types is None:
    attention_types = [
        t for t in available if getattr(model.cfg, f'{t}_attention').kind in CONVERTIBLE_KINDS
    ]
  elif isinstance(attention_types, str):
    attention_types = [attention_types]
  unknown = [t for t in attention_types if t not in available]
  if unknown or not attention_types:
    raise ValueError(
        f'attention_types={attention_types!r}: this {type(model).__name__} has '
        f'attention types {available}; name one or more of them.'
    )

  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  templates, specs, errors = {}, {}, {}
  for attention_type in attention_types:
    layer_specs = []
    for site in model.attention_sites():
      if site.attention_type != attention_type:
        continue
      path, layer = _path(site), site.layer
      try:
        new_params, spec, errors[path] = convert_layer(layer.kernel_params(), layer.spec)
      except ValueError as e:
        raise ValueError(f'{path}: {e}') from None
      _set_subtree(params, path, new_params)
      layer_specs.append((path, spec))
    field = f'{attention_type}_attention'
    templates[field] = _template(getattr(model.cfg, field), layer_specs)
    specs[attention_type] = layer_specs
  cfg = dataclasses.replace(model.cfg, **templates)
  for attention_type, layer_specs in specs.items():  # the config builds exactly these layers
    for i, (path, spec) in enumerate(layer_specs):
      if cfg.attention(attention_type, i) != spec:
        raise ValueError(
            f'{path}: the converted layer {spec} differs from what the converted '
            f'config builds, {cfg.attention(attention_type, i)}.'
        )
  return Converted(_build(model, cfg, params), cfg, errors)


def _path(site: models.transformer.AttentionSite) -> str:
  """'encoder/layers/0/self_attention': a site's parameter path, as errors name layers."""
  return '/'.join(map(str, site.path))


def _template(template: AttentionSpec, layer_specs) -> AttentionSpec:
  """The config template of one attention type whose layers converted to `layer_specs`.

  A template holds one kind, key width and logit scale for all layers of its type; per-layer
  head counts (a tuple) stay as they are.
  """
  for field in ('kind', 'key_dim', 'logit_scale'):
    values = {path: getattr(spec, field) for path, spec in layer_specs}
    if len(set(values.values())) > 1:
      raise ValueError(
          f'the converted layers differ in {field} ({values}); a model config '
          'holds one per attention type.'
      )
  _, first = layer_specs[0]
  return dataclasses.replace(
      template, kind=first.kind, key_dim=first.key_dim, logit_scale=first.logit_scale
  )


def _set_subtree(tree: dict, path: str, value: dict) -> None:
  *parents, name = [int(k) if k.isdigit() else k for k in path.split('/')]
  for key in parents:
    tree = tree[key]
  tree[name] = dict(value)


def _flatten(tree: dict, prefix: str = '') -> dict[str, object]:
  out = {}
  for key, value in tree.items():
    path = f'{prefix}{key}'
    out.update(_flatten(value, path + '/') if isinstance(value, dict) else {path: value})
  return out


def _build(model: nnx.Module, cfg: models.TransformerConfig, params: dict) -> nnx.Module:
  """A model of `model`'s class built from `cfg` (no initialisation computed), holding `params`.

  Every parameter of the new model must be in `params` with its shape: nothing is left at an
  initial value by accident.
  """
  # The constructor's arguments besides the config (a task's model may take its own).
  extra = model.constructor_kwargs() if hasattr(model, 'constructor_kwargs') else {}
  abstract = nnx.eval_shape(lambda: type(model)(cfg, rngs=nnx.Rngs(0), **extra))
  graphdef, state, *rest = nnx.split(abstract, nnx.Param, ...)
  if any(jax.tree.leaves(r) for r in rest):
    raise ValueError(f'{type(model).__name__} holds non-parameter state {rest}.')
  wanted = _flatten(nnx.to_pure_dict(state))
  given = _flatten(params)
  missing, extra_names = sorted(set(wanted) - set(given)), sorted(set(given) - set(wanted))
  misfit = [
      f'{name} {np.shape(given[name])} != {wanted[name].shape}'
      for name in wanted
      if name in given and tuple(np.shape(given[name])) != tuple(wanted[name].shape)
  ]
  if missing or extra_names or misfit:
    raise ValueError(
        f'converted parameters do not fit the converted config: missing '
        f'{missing}, unexpected {extra_names}, wrong shapes {misfit}.'
    )
  # Copies: the new model shares no buffer with the original (donating one must not delete
  # the other's).
  nnx.replace_by_pure_dict(
      state,
      jax.tree.map(
          lambda value, target: jnp.array(value, target.dtype, copy=True),
          params,
          nnx.to_pure_dict(state),
      ),
  )
  return nnx.merge(graphdef, state, *rest)
