"""Tasks: one module per task, each defining `TASK` (a `base.Task`), found by name.

    from lowrank_attn import tasks
    task = tasks.get(config.task)             # 'lm', 'mlm', 'nmt', 'glue', ...
    pipeline = tasks.make_pipeline(config.data, split='train', seed=0, global_batch_size=64,
                                   train=True, workdir=workdir)

A module's task owns everything task-specific: its data format (encoding, packing, batch
keys), model factory and forward pass, loss, real-token count, evaluators and config groups.
The pipeline, the training loop and the config know no task by name. Adding a task is one
module here, one data builder (`lowrank_attn/data/builders/`) and one config (`configs/`).
"""

import importlib
import pkgutil

from lowrank_attn import data as data_lib
from lowrank_attn.tasks.base import (
    EvalContext,
    Evaluator,
    FinalResult,
    LossEvaluator,
    Task,
    cross_entropy,
    token_summary,
)

_NOT_TASKS = ('base',)


def _collect() -> dict[str, Task]:
  found = {}
  for module_info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if module_info.name in _NOT_TASKS:
      continue
    module = importlib.import_module(f'{__name__}.{module_info.name}')
    task = getattr(module, 'TASK', None)
    if not isinstance(task, Task):
      raise TypeError(f'{module.__name__} defines no TASK (a lowrank_attn.tasks.Task).')
    if task.name in found:
      raise ValueError(f'task {task.name!r} is defined twice.')
    found[task.name] = task
  return found


TASKS: dict[str, Task] = _collect()


def get(name: str) -> Task:
  """The task called `name`; ValueError listing the valid names."""
  if name not in TASKS:
    raise ValueError(f'task={name!r} is not one of {tuple(TASKS)}.')
  return TASKS[name]


def make_pipeline(data_config, **kwargs) -> data_lib.Pipeline:
  """`data.make_pipeline` with the format of the task `data_config.task` names."""
  task = get(data_lib.as_data_config(data_config).task)
  return data_lib.make_pipeline(data_config, format=task.data_format, **kwargs)


def load_tokenizer(data_config, workdir):
  """`data.load_tokenizer` of a finished run, with its task's format."""
  task = get(data_lib.as_data_config(data_config).task)
  return data_lib.load_tokenizer(data_config, workdir, format=task.data_format)


__all__ = [
    'EvalContext',
    'Evaluator',
    'FinalResult',
    'LossEvaluator',
    'TASKS',
    'Task',
    'cross_entropy',
    'get',
    'load_tokenizer',
    'make_pipeline',
    'token_summary',
]
