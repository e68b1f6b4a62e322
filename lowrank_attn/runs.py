"""Run directories: the one place that knows what a run holds and how to read and write one.

    run = RunDir('/work/runs/multi30k/base')
    run.config, run.tokenizer, run.steps()      # config.json on the schema, its vocabulary
    model = run.model()                         # the latest checkpoint's model, on the host
    s = run.setup()                             # the config's sharded set-up on these devices
    params = run.averaged_params(run.last_steps(3), s.abstract_state['params'])
    overrides = RunDir('/work/runs/x/pruned').write_model(pruned_model, run.config)

Layout (what `lowrank_attn.train` writes):
  config.json                the training config (`train.config.to_dict`);
  checkpoints/<step>/        Orbax checkpoints (`train.checkpoints`, the only Orbax user); a
                             half-written save has another name and is not a step;
  tokenizers/                the vocabulary the run trained (unless it reads a shared one);
  tfds/                      its prepared data (unless `data.tfds_data_dir` is elsewhere;
                             a remote run's is on each machine: `files.local_dir`).

A run directory may be remote (`gs://BUCKET/...`): every file is read and written through
`lowrank_attn.files` (epath for remote paths), Orbax reads gs:// itself, and a remote step
directory counts once Orbax's `commit_success.txt` is in it (GCS has no atomic rename).

A model written as a run (`RunDir.write_model`) holds its parameters as checkpoint step 0 and,
in config.json, the training config that builds it: it is a warm-start source for the
training command line (`--config.init_from=DIR`), not a run to resume (no optimizer state).

This module's top imports only the standard library and `lowrank_attn.files` (the same):
checking a directory fails fast (`python -m lowrank_attn.translate`), and `train.checkpoints`
takes `write_atomic` and the layout names from here. What reads arrays (JAX, Orbax, the data package) is imported where used.
"""

import copy
import dataclasses
import functools
import json
import os
from typing import TYPE_CHECKING, Any

from lowrank_attn import files

# `write_atomic` is `files.write_atomic` (local: write then rename; remote: one object write),
# imported from here by `train.checkpoints` and the research code.
from lowrank_attn.files import write_atomic  # pylint: disable=unused-import

if TYPE_CHECKING:
  from flax import nnx
  import ml_collections

  from lowrank_attn import models
  from lowrank_attn.data import Tokenizer
  from lowrank_attn.train import state as state_lib

CONFIG_FILE = 'config.json'
CHECKPOINT_DIR = 'checkpoints'
TOKENIZER_DIR = 'tokenizers'
TFDS_DIR = 'tfds'
# Orbax's mark of a committed step where there is no atomic rename (GCS): `<step>/` is written
# in place and committed by this file (`orbax.checkpoint`'s CommitFileTemporaryPath).
COMMIT_FILE = 'commit_success.txt'


def with_overrides(
    config: 'ml_collections.ConfigDict', overrides: dict[str, Any] | None = None, /, **more: Any
) -> 'ml_collections.ConfigDict':
  """A validated copy of training config `config` with `{'a.b.c': value}` set, as
  `--config.a.b.c=value` would set it (`config` is not changed).

      with_overrides(config, {'model.encoder_attention.kind': 'collaborative'}, seed=1)

  Raises ValueError naming a field the config does not have, a value of the wrong type, or
  (`train.config.validate`) the first invalid field of the result.
  """
  import ml_collections

  from lowrank_attn.train import config as config_lib

  config = copy.deepcopy(config)
  for path, value in {**(overrides or {}), **more}.items():
    parts = path.split('.')
    node, where = config, 'config'
    for i, part in enumerate(parts):
      if not isinstance(node, ml_collections.ConfigDict) or part not in node:
        fields = sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
        raise ValueError(
            f'config.{path}: {where} has no field {part!r}; its fields are ' f'{fields}.'
        )
      if i < len(parts) - 1:
        node, where = node[part], f'{where}.{part}'
    try:
      node[parts[-1]] = value
    except (TypeError, ValueError) as e:
      raise ValueError(f'config.{path}={value!r}: {e}') from None
  config_lib.validate(config)
  return config


def mean_params(trees: list[Any]) -> Any:
  """The element-wise mean of parameter trees (checkpoint averaging)."""
  import jax

  return jax.tree.map(lambda *p: sum(p) / len(p), *trees)


def training_overrides(
    config: 'ml_collections.ConfigDict', model_cfg: 'models.TransformerConfig'
) -> dict[str, Any]:
  """`{'model.<type>_attention.<field>': value}`: what turns training config `config` into one
  whose model config is `model_cfg` (a converted or pruned model's, from the original's config).

  Raises ValueError naming the differing model fields if no attention override can do it
  (`config` is not the training config of the model `model_cfg` came from).
  """
  from lowrank_attn import schema
  from lowrank_attn.train import config as config_lib

  overrides = {}
  for attention_type in _task(config.task).attention_types:
    current = config_lib.attention_options(config, attention_type)
    wanted = getattr(model_cfg, f'{attention_type}_attention').options()
    for field, value in wanted.items():
      if schema.values_of({field: current.get(field)}) != schema.values_of({field: value}):
        overrides[f'model.{attention_type}_attention.{field}'] = value
  built = config_lib.model_config(with_overrides(config, overrides), model_cfg.vocab_size)
  if built != model_cfg:
    raise ValueError(
        f'config (task {config.task!r}) does not build the model: '
        f'{"; ".join(_differences(built, model_cfg))} (config vs model). Pass the '
        'training config of the original model.'
    )
  return overrides


class RunDir:
  """A run directory (see the module docstring): its config, tokenizer, checkpoints, model.

  Nothing is read at construction; `steps()`, `is_run()` and `check_step()` read no arrays
  and import no JAX. A `RunDir` is path-like: `os.path.join(run, 'x')` works. `path` may be
  remote (`gs://...`; `files.is_remote`): kept as given, read through `lowrank_attn.files`.
  """

  def __init__(self, path: str | os.PathLike):
    path = os.fspath(path)
    self.path = files.resolve(path if files.is_remote(path) else os.path.expanduser(path))

  def __fspath__(self) -> str:
    return self.path

  def __repr__(self) -> str:
    return f'RunDir({self.path!r})'

  @property
  def config_path(self) -> str:
    return os.path.join(self.path, CONFIG_FILE)

  @property
  def checkpoint_dir(self) -> str:
    return os.path.join(self.path, CHECKPOINT_DIR)

  def is_run(self) -> bool:
    """Whether the directory holds a run's config.json."""
    return files.isfile(self.config_path)

  # ---------------------------------------------------------------------------- checkpoints

  def steps(self) -> list[int]:
    """Committed checkpoint steps, ascending: `checkpoints/<step>` directories (a half-written
    save has another name; remote, where a save is written in place, a step directory
    without Orbax's commit file is not a step either)."""
    if not files.isdir(self.checkpoint_dir):
      return []
    remote = files.is_remote(self.checkpoint_dir)
    steps = []
    for name in files.listdir(self.checkpoint_dir):
      step_dir = os.path.join(self.checkpoint_dir, name)
      if not name.isdigit() or not files.isdir(step_dir):
        continue
      if remote and not files.exists(os.path.join(step_dir, COMMIT_FILE)):
        continue
      steps.append(int(name))
    return sorted(steps)

  def latest_step(self) -> int | None:
    steps = self.steps()
    return steps[-1] if steps else None

  def last_steps(self, count: int, up_to: int | None = None) -> list[int]:
    """The last `count` checkpoint steps (fewer if the run has fewer), none after `up_to`."""
    if count < 1:
      raise ValueError(f'count={count}: average at least 1 checkpoint.')
    return [k for k in self.steps() if up_to is None or k <= up_to][-count:]

  def check_step(self, step: int | None = None) -> int:
    """`step`, or the latest if None; FileNotFoundError if the run has no checkpoint,
    ValueError naming the steps it has if it has not that one."""
    steps = self.steps()
    if not steps:
      raise FileNotFoundError(f'{self.path} has no checkpoint in {self.checkpoint_dir}.')
    if step is None:
      return steps[-1]
    if step not in steps:
      raise ValueError(
          f'{self.path} has no checkpoint of step {step}; it has ' f'{", ".join(map(str, steps))}.'
      )
    return step

  def params(self, step: int | None = None) -> dict:
    """The parameters of checkpoint `step` (default: the latest) as host numpy arrays, in the
    `nnx.to_pure_dict` layout (layer indices as ints)."""
    from lowrank_attn.train import checkpoints

    _, state = checkpoints.load_state(self.path, self.check_step(step))
    return state['params']

  def restore_params(self, step: int, abstract_params: Any) -> Any:
    """Only the parameters of checkpoint `step` (no optimizer state is read), laid out as
    `abstract_params`' shardings (e.g. `self.setup().abstract_state['params']`: any mesh)."""
    from lowrank_attn.train import checkpoints

    return checkpoints.restore_params(self.path, step, abstract_params)

  def averaged_params(self, steps: list[int], abstract_params: Any) -> Any:
    """The mean of the parameters of checkpoints `steps` (checkpoint averaging), laid out as
    `abstract_params`; one step: that checkpoint's parameters, unchanged."""
    return mean_params([self.restore_params(k, abstract_params) for k in steps])

  # ------------------------------------------------------------------------ config, model

  @property
  def config(self) -> 'ml_collections.ConfigDict':
    """The run's training config: config.json on the current schema (fields added since the
    run was made keep their defaults; see `train.config.from_dict`). A new copy each time."""
    from lowrank_attn.train import config as config_lib

    if not self.is_run():
      raise ValueError(f'{self.path} is not a run directory: it has no {CONFIG_FILE}.')
    return config_lib.from_dict(json.loads(files.read_text(self.config_path)))

  @functools.cached_property
  def tokenizer(self) -> 'Tokenizer':
    """The vocabulary the run trained (or read); FileNotFoundError naming the file if absent."""
    from lowrank_attn import tasks as tasks_lib

    return tasks_lib.load_tokenizer(self.config.data, self.path)

  def model_config(
      self, config: 'ml_collections.ConfigDict | None' = None
  ) -> 'models.TransformerConfig':
    """The `TransformerConfig` of the run's config (or of `config`) and vocabulary."""
    from lowrank_attn.train import config as config_lib

    return config_lib.model_config(
        self.config if config is None else config, self.tokenizer.vocab_size
    )

  def setup(self, config: 'ml_collections.ConfigDict | None' = None) -> 'state_lib.Setup':
    """The sharded set-up (mesh, abstract state, compiled-step options) of the run's config,
    or of `config` (the run's, changed: another mesh, say), with the run's vocabulary."""
    from lowrank_attn.train import state as state_lib

    return state_lib.setup(
        self.config if config is None else config,
        vocab_size=self.tokenizer.vocab_size,
        bos_id=self.tokenizer.bos_id,
    )

  def model(self, step: int | None = None) -> 'nnx.Module':
    """The model of checkpoint `step` (default: the latest), built from the run's config and
    holding the checkpoint's parameters, on the host."""
    from flax import nnx
    import jax
    import jax.numpy as jnp

    config = self.config
    task = _task(config.task)
    model_cfg = self.model_config(config)
    bos_id = self.tokenizer.bos_id
    params = self.params(step)
    abstract = nnx.eval_shape(lambda: task.create_model(config, model_cfg, bos_id, nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract, nnx.Param)
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
    return nnx.merge(graphdef, state)

  def data_overrides(self) -> dict[str, Any]:
    """`{'data.tokenizer_path': ..., 'data.tfds_data_dir': ...}`: what makes another run read
    this run's vocabulary and prepared data (a warm start needs the same vocabulary)."""
    data = self.config.data
    tokenizer_path = data.tokenizer_path
    if tokenizer_path is None and data.tokenizer != 'wordpiece':
      directory = os.path.join(self.path, TOKENIZER_DIR)
      names = files.listdir(directory) if files.isdir(directory) else []
      # (as glob's '*': no dot files, so a writer's temporary file is not a tokenizer)
      found = sorted(os.path.join(directory, n) for n in names if not n.startswith('.'))
      if len(found) != 1:
        raise ValueError(
            f'{self.path}/{TOKENIZER_DIR} holds {len(found)} files {found}; '
            "expected the run's one trained tokenizer."
        )
      tokenizer_path = found[0]
    return {
        'data.tokenizer_path': tokenizer_path,
        # A remote run's prepared data is on each machine that ran it (`files.local_dir`).
        'data.tfds_data_dir': data.tfds_data_dir
        or os.path.join(files.local_dir(self.path), TFDS_DIR),
    }

  # ---------------------------------------------------------------------------- writing

  def write_config(self, config: 'ml_collections.ConfigDict') -> str:
    """Writes `config` as the run's config.json (primary process only); returns its path."""
    from lowrank_attn.train import checkpoints, config as config_lib

    return checkpoints.save_config(self.path, config_lib.to_dict(config))

  def write_model(self, model: 'nnx.Module', config: 'ml_collections.ConfigDict') -> dict[str, Any]:
    """Writes any model (converted, pruned) as a warm-start run; returns the config overrides
    that build it.

    The directory must hold no checkpoint: `checkpoints/0` gets the parameters (step 0, no
    optimizer state) and config.json the training config that builds `model`: `config`, the
    training config of the model it came from, with the returned overrides (see
    `training_overrides`). Train or evaluate it with the original command plus
    `--config.init_from=<this directory>` and the overrides.
    """
    from flax import nnx

    overrides = training_overrides(config, model.cfg)
    if self.latest_step() is not None:
      raise ValueError(
          f'{self.path} already holds checkpoint step '
          f'{self.latest_step()}; write a model to a new directory.'
      )
    self._save_params(0, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    self.write_config(with_overrides(config, overrides))
    return overrides

  def write_slim_copy(
      self, dest: str | os.PathLike, step: int | None = None, dtype: Any = None
  ) -> 'RunDir':
    """A copy that fits where the run's checkpoints do not (the 64 MiB a call to an accelerator
    machine carries): config.json, metrics.jsonl, the trained vocabulary (`tokenizers/`), the
    final evaluations (`final_eval/`) and checkpoint `step` (default: the latest) with the
    parameters alone, under the same step number. Enough to warm-start from (`init_from`),
    evaluate or analyse, as the run itself; not to resume (no optimizer state). Local only.

    dtype: the floating-point parameters cast to it (`float16` halves a float32 copy: a
    rounding, not a copy of the run; `float32` casts such a copy back); others kept as they are.
    """
    import shutil

    import jax
    import numpy as np

    if files.is_remote(self.path) or files.is_remote(dest):
      raise ValueError(f'write_slim_copy copies local runs only ({self.path} -> {dest}).')
    step = self.check_step(step)
    copy_ = RunDir(dest)
    if os.path.exists(copy_.path) and os.listdir(copy_.path):
      raise ValueError(f'{copy_.path} is not empty; a slim copy goes to a new directory.')
    os.makedirs(copy_.path, exist_ok=True)
    for name in (CONFIG_FILE, 'metrics.jsonl'):
      if os.path.isfile(os.path.join(self.path, name)):
        shutil.copy2(os.path.join(self.path, name), copy_.path)
    for name in (TOKENIZER_DIR, 'final_eval'):
      if os.path.isdir(os.path.join(self.path, name)):
        shutil.copytree(os.path.join(self.path, name), os.path.join(copy_.path, name))
    params = self.params(step)
    if dtype is not None:
      params = jax.tree.map(
          lambda x: np.asarray(x, dtype) if np.issubdtype(x.dtype, np.floating) else x, params
      )
    copy_._save_params(step, params)
    return copy_

  def _save_params(self, step: int, params: Any) -> None:
    """Checkpoint `step` holding the parameters alone (no optimizer state): a warm-start source."""
    import jax.numpy as jnp

    from lowrank_attn.train import checkpoints

    checkpointer = checkpoints.Checkpointer(self.path, keep=1, async_save=False)
    try:
      checkpointer.save(step, {'step': jnp.asarray(step, jnp.int32), 'params': params}, {})
    finally:
      checkpointer.close()


# ------------------------------------------------------------------------------ internals


def _task(name: str):
  """The task record of `config.task`."""
  from lowrank_attn import tasks as tasks_lib

  return tasks_lib.get(name)


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
