"""Run directories in and out: a trained run's model, and a pruned copy as a new run.

    run = load_run('/work/runs/multi30k/base')                 # its config, model, tokenizer
    overrides = prune_run('/work/runs/multi30k/base', keep, '/work/runs/heads/pruned')

The pruned directory holds the pruned parameters as checkpoint step 0 and, in `config.json`,
the training config that builds the pruned model; it is a warm-start source. Fine-tune (or
evaluate) the pruned model with the normal command line plus its overrides:

    python -m lowrank_attn.main --config=configs/nmt.py:multi30k --workdir=/work/runs/x \
        --config.init_from=/work/runs/heads/pruned \
        --config.model.encoder_attention.num_heads='(8, 3, 1)' \
        --config.model.encoder_attention.head_dim=32 ...   # every override prune_run returned

Training a pruned model is training with fixed head masks: its outputs, and so its gradients,
are those of the unpruned model with `head_masks=keep`, while pruned heads cost nothing.
"""

import dataclasses
import glob
import json
import os
from typing import Any

from flax import nnx
import jax.numpy as jnp
import ml_collections
import numpy as np

from lowrank_attn import data as data_lib
from lowrank_attn.pruning.heads import Keep, check_keep, prune_heads
from lowrank_attn.reparam.runs import with_overrides, write_model_run
from lowrank_attn.train import checkpoints, config as config_lib, tasks
from lowrank_attn.train import state as state_lib

PRUNING_FILE = 'pruning.json'


@dataclasses.dataclass
class LoadedRun:
  """A run directory's training config, model (at `step`) and tokenizer."""

  workdir: str
  config: ml_collections.ConfigDict
  model: nnx.Module
  tokenizer: data_lib.Tokenizer
  step: int


def data_overrides(workdir: str | os.PathLike, config: ml_collections.ConfigDict) -> dict:
  """`{'data.tokenizer_path': ..., 'data.tfds_data_dir': ...}`: what makes another run read
  run `workdir`'s vocabulary and prepared data (a warm start needs the same vocabulary)."""
  workdir = os.path.abspath(workdir)
  tokenizer_path = config.data.tokenizer_path
  if tokenizer_path is None and config.data.tokenizer != 'wordpiece':
    found = sorted(glob.glob(os.path.join(workdir, 'tokenizers', '*')))
    if len(found) != 1:
      raise ValueError(f'{workdir}/tokenizers holds {len(found)} files {found}; expected the '
                       "run's one trained tokenizer.")
    tokenizer_path = found[0]
  return {'data.tokenizer_path': tokenizer_path,
          'data.tfds_data_dir': config.data.tfds_data_dir or os.path.join(workdir, 'tfds')}


def load_run(workdir: str | os.PathLike, step: int | None = None) -> LoadedRun:
  """The model of run `workdir` at checkpoint `step` (default: the latest), on the host."""
  workdir = os.path.abspath(workdir)
  path = os.path.join(workdir, checkpoints.CONFIG_FILE)
  if not os.path.exists(path):
    raise ValueError(f'{workdir} is not a run directory: it has no {checkpoints.CONFIG_FILE}.')
  with open(path) as f:
    config = config_lib.from_dict(json.load(f))
  tokenizer = data_lib.load_tokenizer(config.data, workdir)
  step, state = checkpoints.load_state(workdir, step)
  task = tasks.get(config.task)
  model_cfg = config_lib.model_config(config, tokenizer.vocab_size)
  abstract = nnx.eval_shape(
      lambda: task.create_model(model_cfg, tokenizer.bos_id, nnx.Rngs(0)))
  graphdef, params = nnx.split(abstract, nnx.Param)
  nnx.replace_by_pure_dict(params, _to_jax(state['params']))
  return LoadedRun(workdir, config, nnx.merge(graphdef, params), tokenizer, step)


def _to_jax(tree):
  if isinstance(tree, dict):
    return {k: _to_jax(v) for k, v in tree.items()}
  return jnp.asarray(tree)


def prune_run(source: str | os.PathLike, keep: Keep, workdir: str | os.PathLike,
              step: int | None = None) -> dict[str, Any]:
  """Prunes run `source`'s model (checkpoint `step`, default latest) into run dir `workdir`.

  Returns the `--config.<field>` overrides that, with the source's command and
  `--config.init_from=<workdir>`, train or evaluate the pruned model: the attention fields
  of the pruned types and the source's tokenizer and prepared data, and `trainable=None` where
  the source's `config.trainable` matches no parameter left (a gate fine-tune whose gates all
  closed). `workdir/pruning.json` records them, the source and `keep`.
  """
  run = load_run(source, step)
  keep = check_keep(run.model, keep)
  pruned = prune_heads(run.model, keep)
  overrides = data_overrides(source, run.config)
  if not state_lib.trains_any(nnx.to_pure_dict(nnx.state(pruned, nnx.Param)),
                              run.config.trainable):
    # E.g. a gate fine-tune (trainable='gate_log_alpha') whose gates all closed: the pruned
    # model has no gate left, and a pattern that matches nothing would refuse to build it.
    overrides['trainable'] = None
  config = with_overrides(run.config, overrides)
  overrides = {**overrides, 'init_from': os.path.abspath(workdir),
               **write_model_run(pruned, workdir, config)}
  record = {'source': run.workdir, 'source_step': run.step, 'overrides': overrides,
            'keep': {t: [np.asarray(k).astype(int).tolist() for k in layers]
                     for t, layers in keep.items()}}
  with open(os.path.join(os.path.abspath(workdir), PRUNING_FILE), 'w') as f:
    json.dump(record, f, indent=2)
  return overrides
