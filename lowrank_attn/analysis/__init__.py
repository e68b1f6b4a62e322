"""What attention heads do: importance, confidence and roles.

- `head_importance(model, batches)`: Michel et al. (2019)'s E|dL/d xi_h| per head, streamed
  over a data set (optionally L2-normalised per layer).
- `head_confidence(model, batches)`: Voita et al. (2019)'s mean maximum attention weight.
- `head_roles(model, tokenizer, sentences, counts)`: positional, syntactic (UD relations) and
  rare-word metrics of every encoder head on a CoNLL-U treebank; `classify` applies Voita et
  al.'s thresholds.

Pruning by these scores is `lowrank_attn.pruning.prune_heads`.
"""

from lowrank_attn.analysis.importance import head_confidence, head_importance, task_of
from lowrank_attn.analysis.roles import (
    DIRECTIONS,
    RELATIONS,
    classify,
    head_roles,
    read_treebank,
    roles_from_attention,
    word_attention,
    word_counts,
    word_pieces,
)
