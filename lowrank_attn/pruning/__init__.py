"""Head pruning: physically smaller models, and pruned copies of trained runs.

- `prune_heads(model, keep)`: a new model without the heads where `keep` is False; its
  outputs equal `model(..., head_masks=keep)`, and its config records the heads per layer.
- `keep_from_gates(model)`: the heads whose evaluation gate is above 0 (Voita et al. 2019).
- `load_run(dir)`, `prune_run(dir, keep, new_dir)`: a run directory's model, and its pruned
  copy as a warm-start run for the training command line (fine-tuning, evaluation).

Head importance and roles, which choose what to prune, are in `lowrank_attn.analysis`.
"""

from lowrank_attn.pruning.heads import (
    Keep,
    attention_layers,
    attention_sites,
    check_keep,
    head_counts,
    keep_from_gates,
    prune_heads,
    pruned_config,
)
from lowrank_attn.pruning.runs import (
    LoadedRun,
    data_overrides,
    load_run,
    prune_run,
    write_model_run,
)
