"""Re-parametrizations of trained attention layers.

- `collaborative_factors`: the CP decomposition of a concat layer's per-head bilinear forms
  W_Q^(i) W_K^(i)T into shared query/key projections and per-head mixing (Cordonnier et al.
  2020), computed from the factors, without the dense tensor.
- `concat_to_collaborative`, `per_head_svd`: the conversions of a layer's parameter dict that
  use it (collaborative at any key width) and the fair low-rank baseline at equal key width.
"""

from lowrank_attn.attention.convert import concat_to_collaborative, per_head_svd
from lowrank_attn.reparam.cp import CollaborativeFactors, collaborative_factors
