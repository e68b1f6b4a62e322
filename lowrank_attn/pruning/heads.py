"""Physical head pruning: a smaller model that computes what the head-masked model computes.

    keep = keep_from_gates(model)              # {type: bool [layers, heads]}: eval gate > 0
    small = prune_heads(model, keep)           # small.cfg records the heads kept per layer
    small(src, tgt)[0] == model(src, tgt, head_masks=keep)[0]    (up to float rounding)

What a head is, per kind (the heads that `head_masks` and gates address):
  concat, fixed_head  its query/key/value slices and its rows of the output projection;
  collaborative       its mixing row and content-bias column, its value slice and output rows;
                      the shared query/key projections keep their width key_dim;
  talking_heads       an output (value) head: its value slice, output rows and column of the
                      post-softmax mixing. Every output head mixes all logit heads, so those
                      stay (`AttentionSpec.num_logit_heads`);
  gated               any of these; the kept heads keep their gates.
A layer may keep no head: it then has only its output bias, which is what its attention adds.
"""

from collections.abc import Mapping, Sequence
import dataclasses
from typing import Any

from flax import nnx
import jax
import numpy as np

from lowrank_attn import models

# {attention type: bool [layers, heads]}, or per layer a bool [heads] where counts differ.
Keep = Mapping[str, Any]


def head_counts(model: nnx.Module) -> dict[str, tuple[int, ...]]:
  """{attention type: heads of each layer}."""
  return {t: tuple(a.num_heads for a in layers) for t, layers in model.attention_layers().items()}


def per_type(masks: Mapping[str, Sequence[np.ndarray]]) -> dict[str, Any]:
  """Per-layer masks as `[layers, heads]` arrays where every layer has as many heads."""
  return {t: np.stack(m) if len({len(x) for x in m}) == 1 else list(m) for t, m in masks.items()}


def check_keep(model: nnx.Module, keep: Keep) -> dict[str, list[np.ndarray]]:
  """`keep` as {type: per-layer bool arrays} for every attention type of the model.

  Types missing from `keep` keep all their heads. Raises ValueError naming an unknown type,
  a wrong shape or values that are not booleans (or 0/1).
  """
  counts = head_counts(model)
  unknown = sorted(set(keep) - set(counts))
  if unknown:
    raise ValueError(
        f'keep has attention types {unknown} that this model does not have; '
        f'its types are {sorted(counts)}.'
    )
  checked = {}
  for attention_type, heads in counts.items():
    if keep.get(attention_type) is None:
      checked[attention_type] = [np.ones(h, bool) for h in heads]
      continue
    given = keep[attention_type]
    layers = (
        [np.asarray(x) for x in np.atleast_1d(given)]
        if isinstance(given, (np.ndarray, jax.Array))
        else [np.asarray(x) for x in given]
    )
    shapes = [x.shape for x in layers]
    if shapes != [(h,) for h in heads]:
      expected = (
          f'[{len(heads)}, {heads[0]}]'
          if len(set(heads)) == 1
          else f'one [heads] array per layer with heads {list(heads)}'
      )
      raise ValueError(
          f"keep['{attention_type}'] has shape "
          f'{np.shape(given) if len(set(shapes)) <= 1 else shapes}, expected '
          f'{expected} (layers, heads).'
      )
    for i, x in enumerate(layers):
      if x.dtype != bool and not np.isin(x, (0, 1)).all():
        raise ValueError(
            f"keep['{attention_type}'] layer {i} = {x.tolist()}: expected booleans "
            '(True = keep the head) or 0/1.'
        )
    checked[attention_type] = [x.astype(bool) for x in layers]
  return checked


def keep_from_gates(model: nnx.Module) -> dict[str, Any]:
  """{type: bool [layers, heads]}: the heads whose evaluation gate is above 0 (Voita et al.).

  Ungated layers keep all their heads. A kept head's gate may still be below 1; `prune_heads`
  keeps the gates of kept heads, so the pruned model computes what the gated one does.
  """
  masks = {}
  for attention_type, layers in model.attention_layers().items():
    masks[attention_type] = [np.asarray(a.pruning_mask()) for a in layers]
  return per_type(masks)


def _head_axes(spec) -> dict[str, int]:
  """Axis of each parameter that indexes the output heads (what `head_masks` address)."""
  axes = {'value_kernel': 1, 'value_bias': 0, 'out_kernel': 0, 'gate_log_alpha': 0}
  if spec.kind == 'collaborative':
    return {**axes, 'mixing': 0, 'content_bias': 1}
  if spec.kind == 'talking_heads':
    return {**axes, 'post_softmax_mixing': 1}
  return {**axes, 'query_kernel': 1, 'query_bias': 0, 'key_kernel': 1, 'key_bias': 0}


def _prune_layer_params(
    params: dict[str, np.ndarray], spec, kept: np.ndarray, pruned_spec
) -> dict[str, np.ndarray]:
  """A layer's parameters without the heads `kept` drops (a layer left without heads keeps
  only its output bias: `pruned_spec.param_shapes()`)."""
  if kept.all():
    return params
  index = np.flatnonzero(kept)
  axes = _head_axes(spec)
  return {
      name: np.take(value, index, axis=axes[name]) if name in axes else value
      for name, value in params.items()
      if name in pruned_spec.param_shapes()
  }


def _pruned_template(template, attention_type: str, layers, kept: list[np.ndarray]):
  """The type's AttentionSpec template with per-layer head counts, sized so each kept head
  keeps its width and its layer's logit scale."""
  specs = [a.spec for a in layers]
  for name in ('head_dim', 'logit_scale', 'key_dim'):
    values = {getattr(s, name) for s in specs}
    if len(values) > 1:
      raise ValueError(
          f'{attention_type} attention has {name} {sorted(values)} differing by '
          'layer, which a pruned config cannot record (one value per type).'
      )
  if any(s.is_dot_product and s.num_kv_heads != s.num_heads for s in specs):
    raise ValueError(
        f'{attention_type} attention uses grouped keys/values (num_kv_heads='
        f'{specs[0].num_kv_heads} < num_heads): pruning single heads would leave '
        'groups of different sizes. Keep all its heads.'
    )
  changes = dict(
      num_heads=tuple(int(k.sum()) for k in kept),
      head_dim=specs[0].head_dim,
      qkv_features=None,
      logit_scale=specs[0].logit_scale,
  )
  if specs[0].kind == 'collaborative':
    changes['key_dim'] = specs[0].key_dim
  if specs[0].kind == 'talking_heads':  # every output head mixes all of the logit heads
    logit_heads = tuple(s.num_logit_heads for s in specs)
    changes['num_logit_heads'] = logit_heads if len(set(logit_heads)) > 1 else logit_heads[0]
  return dataclasses.replace(template, **changes)


def pruned_config(model: nnx.Module, keep: Keep) -> models.TransformerConfig:
  """The `TransformerConfig` of `prune_heads(model, keep)`."""
  keep = check_keep(model, keep)
  layers = model.attention_layers()
  changes = {}
  for attention_type, kept in keep.items():
    if all(k.all() for k in kept):
      continue
    field = f'{attention_type}_attention'
    changes[field] = _pruned_template(
        getattr(model.cfg, field), attention_type, layers[attention_type], kept
    )
  return dataclasses.replace(model.cfg, **changes)


def _get(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def prune_heads(model: nnx.Module, keep: Keep) -> nnx.Module:
  """A new, smaller model without the heads where `keep` is False.

  Args:
    model: a `DecoderLM`, `EncoderMLM`, `EncoderDecoder` or a task's subclass of one (e.g.
      GLUE's classifier), not modified.
    keep: {'encoder'|'decoder'|'cross': bool [layers, heads]} (True = keep), or per layer a
      bool [heads] where head counts differ; types left out keep every head.

  Returns:
    A model of the same class whose `cfg` records the heads kept per layer (tuple
    `num_heads`, with `head_dim` and `logit_scale` fixed so they do not follow the count).
    Its outputs equal `model(..., head_masks=keep)`; parameters and FLOPs shrink.
  """
  keep = check_keep(model, keep)
  cfg = pruned_config(model, keep)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  params = _numpy_tree(params)
  for attention_type, index, path, layer in model.attention_sites():
    parent, name = _get(params, path[:-1]), path[-1]
    parent[name] = _prune_layer_params(
        parent[name], layer.spec, keep[attention_type][index], cfg.attention(attention_type, index)
    )

  # The constructor's arguments besides the config (a task's model may take its own).
  extra = model.constructor_kwargs() if hasattr(model, 'constructor_kwargs') else {}
  abstract = nnx.eval_shape(lambda: type(model)(cfg, **extra, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract, nnx.Param)
  expected = nnx.to_pure_dict(state)
  _check_shapes(expected, params)
  nnx.replace_by_pure_dict(state, params)
  return nnx.merge(graphdef, state)


def _numpy_tree(tree):
  if isinstance(tree, Mapping):
    return {k: _numpy_tree(v) for k, v in tree.items()}
  return np.asarray(tree)


def _check_shapes(expected, actual, path=()):
  if isinstance(expected, Mapping):
    for key in expected:
      _check_shapes(expected[key], actual[key], path + (key,))
    return
  if tuple(expected.shape) != tuple(actual.shape):
    raise AssertionError(
        f'pruned parameter {"/".join(map(str, path))} has shape '
        f'{actual.shape}, the pruned model expects {expected.shape}'
    )
