"""A converted model as a run directory, for the training CLI to fine-tune from.

    overrides = write_run(converted, '/work/runs/x/kd64', config)  # config: the original's
    python -m lowrank_attn.main --config=configs/nmt.py:multi30k --workdir=/work/runs/x/kd64-ft \
        --config.init_from=/work/runs/x/kd64 --config.model.encoder_attention.kind=collaborative ...

`overrides` are those `--config.<field>=<value>` settings: the attention fields that make the
training config build the converted model (kind, key_dim, logit_scale per attention type).
The directory holds the parameters as checkpoint step 0 and the converted training config in
`config.json`; it is a warm-start source, not a run to resume (it has no optimizer state).
"""

import copy
import dataclasses
import json
import os
from typing import Any

from flax import nnx
import jax.numpy as jnp
import ml_collections

from lowrank_attn import models, schema
from lowrank_attn.reparam.models import Converted
from lowrank_attn.train import checkpoints, config as config_lib, tasks

CONVERSION_FILE = 'conversion.json'


def training_overrides(config: ml_collections.ConfigDict,
                       model_cfg: models.TransformerConfig) -> dict[str, Any]:
  """`{'model.<type>_attention.<field>': value}`: what turns training config `config` into one
  whose model config is `model_cfg` (a converted model's, from the original's config).

  Raises ValueError naming the differing model fields if no attention override can do it
  (`config` is not the converted model's original config).
  """
  overrides = {}
  for attention_type in tasks.get(config.task).attention_types:
    current = config_lib.attention_options(config, attention_type)
    wanted = getattr(model_cfg, f'{attention_type}_attention').options()
    for field, value in wanted.items():
      if schema.values_of({field: current.get(field)}) != schema.values_of({field: value}):
        overrides[f'model.{attention_type}_attention.{field}'] = value
  built = config_lib.model_config(with_overrides(config, overrides), model_cfg.vocab_size)
  if built != model_cfg:
    raise ValueError(f'config (task {config.task!r}) does not build the model: '
                     f'{"; ".join(_differences(built, model_cfg))} (config vs model). Pass the '
                     'training config of the original model.')
  return overrides


def _differences(a, b, prefix: str = '') -> list[str]:
  """'field: value_a vs value_b' for every differing field of two dataclasses, nested."""
  out = []
  for field in a.__dataclass_fields__:
    x, y = getattr(a, field), getattr(b, field)
    if x == y:
      continue
    if dataclasses.is_dataclass(x) and dataclasses.is_dataclass(y):
      out += _differences(x, y, f'{prefix}{field}.')
    else:
      out.append(f'{prefix}{field}: {x!r} vs {y!r}')
  return out


def with_overrides(config: ml_collections.ConfigDict,
                   overrides: dict[str, Any]) -> ml_collections.ConfigDict:
  """A copy of `config` with `{'a.b.c': value}` set, as `--config.a.b.c=value` would."""
  config = copy.deepcopy(config)
  for path, value in overrides.items():
    *parents, name = path.split('.')
    node = config
    for part in parents:
      node = node[part]
    node[name] = value
  return config


def write_model_run(model: nnx.Module, workdir: str | os.PathLike,
                    config: ml_collections.ConfigDict) -> dict[str, Any]:
  """Writes any model as a warm-start run; returns the config overrides that build it.

  `workdir` must be new: `checkpoints/0` gets the parameters (step 0, no optimizer state) and
  `config.json` the training config that builds `model` (`config`, the training config of the
  model it came from, with the returned overrides; see `training_overrides`).
  """
  overrides = training_overrides(config, model.cfg)
  workdir = os.path.abspath(workdir)
  checkpointer = checkpoints.Checkpointer(workdir, keep=1, async_save=False)
  try:
    if checkpointer.latest_step() is not None:
      raise ValueError(f'{workdir} already holds checkpoint step {checkpointer.latest_step()}; '
                       'write a model to a new directory.')
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    checkpointer.save(0, {'step': jnp.zeros((), jnp.int32), 'params': params}, {})
  finally:
    checkpointer.close()
  checkpoints.save_config(workdir, config_lib.to_dict(with_overrides(config, overrides)))
  return overrides


def write_run(converted: Converted, workdir: str | os.PathLike,
              config: ml_collections.ConfigDict) -> dict[str, Any]:
  """Writes a converted model as a run to warm-start from; returns the config overrides.

  Args:
    converted: from `to_collaborative` or `to_low_rank_concat`.
    workdir: a new directory: `checkpoints/0` gets the parameters (step 0, no optimizer
      state), `config.json` the training config that builds the converted model, and
      `conversion.json` the overrides and the per-layer relative errors.
    config: the training config the original model was trained with.

  Fine-tune with the original command plus `--config.init_from=<workdir>` and the returned
  overrides (e.g. `runner.train_run(..., overrides={'init_from': workdir, **overrides})`).
  Keep the original vocabulary: set `data.tokenizer_path` to the source run's tokenizer file
  (`lowrank_attn.pruning.data_overrides(source_workdir, config)` gives it).
  """
  if converted.model.cfg != converted.config:
    raise ValueError('converted.model was not built from converted.config.')
  overrides = write_model_run(converted.model, workdir, config)
  with open(os.path.join(os.path.abspath(workdir), CONVERSION_FILE), 'w') as f:
    json.dump({'overrides': overrides, 'relative_errors': converted.relative_errors}, f,
              indent=2)
  return overrides
