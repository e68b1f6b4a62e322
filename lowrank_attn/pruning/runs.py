"""A trained run's model pruned into a new run directory.

    overrides = prune_run('/work/runs/multi30k/base', keep, '/work/runs/heads/pruned')

The pruned directory is a model written as a run (`lowrank_attn.runs.RunDir.write_model`:
the pruned parameters as checkpoint step 0 and, in `config.json`, the training config that
builds the pruned model); it is a warm-start source. Fine-tune (or evaluate) the pruned model
with the normal command line plus its overrides:

    python -m lowrank_attn.main --config=configs/nmt.py:multi30k --workdir=/work/runs/x \
        --config.init_from=/work/runs/heads/pruned \
        --config.model.encoder_attention.num_heads='(8, 3, 1)' \
        --config.model.encoder_attention.head_dim=32 ...   # every override prune_run returned

Training a pruned model is training with fixed head masks: its outputs, and so its gradients,
are those of the unpruned model with `head_masks=keep`, while pruned heads cost nothing.
"""

import json
import os
from typing import Any

from flax import nnx
import numpy as np

from lowrank_attn.pruning.heads import Keep, check_keep, prune_heads
from lowrank_attn.runs import RunDir, with_overrides, write_atomic
from lowrank_attn.train import state as state_lib

PRUNING_FILE = 'pruning.json'


def prune_run(
    source: str | os.PathLike, keep: Keep, workdir: str | os.PathLike, step: int | None = None
) -> dict[str, Any]:
  """Prunes run `source`'s model (checkpoint `step`, default latest) into run dir `workdir`.

  Returns the `--config.<field>` overrides that, with the source's command and
  `--config.init_from=<workdir>`, train or evaluate the pruned model: the attention fields
  of the pruned types and the source's tokenizer and prepared data, and `trainable=None` where
  the source's `config.trainable` matches no parameter left (a gate fine-tune whose gates all
  closed). `workdir/pruning.json` records them, the source and `keep`.
  """
  run, target = RunDir(source), RunDir(workdir)
  step = run.check_step(step)
  model, config = run.model(step), run.config
  keep = check_keep(model, keep)
  pruned = prune_heads(model, keep)
  overrides = run.data_overrides()
  if not state_lib.trains_any(nnx.to_pure_dict(nnx.state(pruned, nnx.Param)), config.trainable):
    # E.g. a gate fine-tune (trainable='gate_log_alpha') whose gates all closed: the pruned
    # model has no gate left, and a pattern that matches nothing would refuse to build it.
    overrides['trainable'] = None
  config = with_overrides(config, overrides)
  overrides = {**overrides, 'init_from': target.path, **target.write_model(pruned, config)}
  record = {
      'source': run.path,
      'source_step': step,
      'overrides': overrides,
      'keep': {
          t: [np.asarray(k).astype(int).tolist() for k in layers] for t, layers in keep.items()
      },
  }
  write_atomic(os.path.join(target.path, PRUNING_FILE), json.dumps(record, indent=2))
  return overrides
