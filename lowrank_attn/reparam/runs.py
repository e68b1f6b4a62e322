"""A converted model as a run directory, for the training CLI to fine-tune from.

    overrides = write_run(converted, '/work/runs/x/kd64', config)  # config: the original's
    python -m lowrank_attn.main --config=configs/nmt.py:multi30k --workdir=/work/runs/x/kd64-ft \
        --config.init_from=/work/runs/x/kd64 --config.model.encoder_attention.kind=collaborative ...

`overrides` are those `--config.<field>=<value>` settings: the attention fields that make the
training config build the converted model (kind, key_dim, logit_scale per attention type).
The directory is a model written as a run (`lowrank_attn.runs.RunDir.write_model`: the
parameters as checkpoint step 0, the converted training config in `config.json`) plus
`conversion.json`; it is a warm-start source, not a run to resume (it has no optimizer state).
"""

import json
import os
from typing import Any

import ml_collections

from lowrank_attn import runs
from lowrank_attn.reparam.models import Converted

# Re-exported by `lowrank_attn.reparam` (their home is `lowrank_attn.runs`).

CONVERSION_FILE = 'conversion.json'


def write_run(
    converted: Converted, workdir: str | os.PathLike, config: ml_collections.ConfigDict
) -> dict[str, Any]:
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
  (`lowrank_attn.runs.RunDir(source_workdir).data_overrides()` gives it).
  """
  if converted.model.cfg != converted.config:
    raise ValueError('converted.model was not built from converted.config.')
  run = runs.RunDir(workdir)
  overrides = run.write_model(converted.model, config)
  # Written last and whole: its presence marks a finished conversion.
  runs.write_atomic(
      os.path.join(run.path, CONVERSION_FILE),
      json.dumps({'overrides': overrides, 'relative_errors': converted.relative_errors}, indent=2),
  )
  return overrides
