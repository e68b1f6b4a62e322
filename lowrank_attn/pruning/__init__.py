"""Head pruning: physically smaller models, and pruned copies of trained runs.

- `prune_heads(model, keep)`: a new model without the heads where `keep` is False; its
  outputs equal `model(..., head_masks=keep)`, and its config records the heads per layer.
- `keep_from_gates(model)`: the heads whose evaluation gate is above 0 (Voita et al. 2019).
- `prune_run(dir, keep, new_dir)`: a run directory's pruned copy as a warm-start run for the
  training command line (fine-tuning, evaluation). Reading runs: `lowrank_attn.runs.RunDir`.

Head importance and roles, which choose what to prune, are in `lowrank_attn.analysis`. A
model's attention layers by type: `model.attention_layers()` (with paths:
`model.attention_sites()`).
"""

from lowrank_attn.pruning.heads import (
    Keep,
    check_keep,
    head_counts,
    keep_from_gates,
    prune_heads,
    pruned_config,
)
from lowrank_attn.pruning.runs import prune_run
