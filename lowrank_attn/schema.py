"""Frozen dataclasses as the one schema of a group of settings, and ConfigDicts derived from them.

A group of settings (an attention layer's options, a data pipeline's fields) is declared once,
as a frozen dataclass whose `__post_init__` validates it. The command-line config is derived
from it, and a config is validated by building the dataclass:

    config.model.attention = schema.config_dict(AttentionOptions)   # every field, its default
    options = schema.build(AttentionOptions, config.model.attention, 'model.attention')

so adding an option is one dataclass field (plus its use), and a bad value fails with
`config.model.attention: <what the dataclass said>`.
"""

from collections.abc import Mapping
import dataclasses
import types
import typing
from typing import Any

import ml_collections
from ml_collections import config_dict as ml_config_dict


def _field_type(annotation) -> type | None:
  """The ConfigDict field type of an annotation: `int | None` -> int; unions -> object.

  `object` accepts any value (config_flags then parses the override as a Python literal), which
  is what `int | tuple[int, ...]` needs; a plain type keeps ml_collections' type checking.
  """
  if isinstance(annotation, str):  # `from __future__ import annotations` is not used here
    raise TypeError(f'string annotation {annotation!r}: evaluate annotations first')
  origin = typing.get_origin(annotation)
  if origin in (typing.Union, types.UnionType):
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return _field_type(args[0]) if len(args) == 1 else object
  if origin is typing.Literal:
    return type(typing.get_args(annotation)[0])
  if origin is not None:  # tuple[float, float], dict[...]
    return origin
  return annotation if isinstance(annotation, type) else object


class Field(typing.NamedTuple):
  name: str
  type: Any
  default: Any  # None for a required field: the config must set it


def fields(cls, exclude: tuple[str, ...] = ()) -> list[Field]:
  """The init fields of dataclass `cls` with evaluated types and defaults."""
  hints = typing.get_type_hints(cls)
  out = []
  for f in dataclasses.fields(cls):
    if f.name in exclude or not f.init:
      continue
    default = f.default
    if default is dataclasses.MISSING:
      default = None if f.default_factory is dataclasses.MISSING else f.default_factory()
    out.append(Field(f.name, hints[f.name], default))
  return out


def config_dict(
    cls, *, exclude: tuple[str, ...] = (), inherit: bool = False, **values
) -> ml_collections.ConfigDict:
  """A ConfigDict with one entry per field of dataclass `cls`.

  Args:
    cls: the schema dataclass.
    exclude: fields the config does not set (e.g. sizes a model fills in).
    inherit: every entry starts as None, meaning "inherit from elsewhere" (per-type overrides).
    **values: starting values instead of the dataclass defaults (a mapping, or an instance,
      for a field whose type is itself a dataclass: it becomes a nested ConfigDict).
  """
  unknown = set(values) - {f.name for f in fields(cls, exclude)}
  if unknown:
    raise ValueError(f'{cls.__name__} has no fields {sorted(unknown)}.')
  entries = {}
  for field in fields(cls, exclude):
    value = None if inherit else values.get(field.name, field.default)
    kind = _field_type(field.type)
    if dataclasses.is_dataclass(kind) and not inherit:  # a nested group: a nested ConfigDict
      given = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value or {}
      entries[field.name] = config_dict(kind, **given)
    elif value is None or kind is object:
      entries[field.name] = ml_config_dict.FieldReference(value, field_type=kind)
    else:
      entries[field.name] = value
  return ml_collections.ConfigDict(entries)


def values_of(config: Mapping[str, Any] | None) -> dict[str, Any]:
  """The entries of a (Config)Dict as a plain dict; lists become tuples (JSON round trips)."""
  if config is None:
    return {}
  items = (
      config.items()
      if not isinstance(config, ml_collections.ConfigDict)
      else ((k, config[k]) for k in config.keys())
  )
  return {k: tuple(v) if isinstance(v, list) else v for k, v in items}


def build(cls, values: Mapping[str, Any], path: str, **extra):
  """`cls(**values, **extra)`; a bad value raises ValueError prefixed with `config.<path>`."""
  names = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(values) - names)
  if unknown:
    raise ValueError(f'config.{path} has unknown fields {unknown}; valid: {sorted(names)}.')
  try:
    return cls(**{**values, **extra})
  except (TypeError, ValueError) as e:
    raise ValueError(f'config.{path}: {e}') from None
