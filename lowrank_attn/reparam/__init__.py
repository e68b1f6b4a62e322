"""Re-parametrizations of trained attention layers and models.

- `collaborative_factors`: the CP decomposition of a concat layer's per-head bilinear forms
  W_Q^(i) W_K^(i)T into shared query/key projections and per-head mixing (Cordonnier et al.
  2020), computed from the factors, without the dense tensor.
- `concat_to_collaborative`, `per_head_svd`: the conversions of a layer's parameter dict that
  use it (collaborative at any key width) and the fair low-rank baseline at equal key width.
  For NNX layers (`convert.from_flax`, `convert.layer_to_collaborative`):
  `MultiHeadAttention.from_flax(..., kind='collaborative', key_dim=k)` and
  `layer.to_collaborative(k)`.
- `to_collaborative`, `to_low_rank_concat`: the same for every attention layer of chosen types
  of a whole model, with the per-layer errors; `write_run` saves a converted model as a run
  that the training CLI fine-tunes (`--config.init_from`).
"""

from lowrank_attn.reparam.convert import concat_to_collaborative, per_head_svd
from lowrank_attn.reparam.cp import CollaborativeFactors, collaborative_factors
from lowrank_attn.reparam.models import (
    Converted,
    model_attention_types,
    to_collaborative,
    to_low_rank_concat,
)
from lowrank_attn.reparam.runs import write_run
