r"""BERT-style masked language model (encoder only) on Shakespeare.

Every field is documented once, in `lowrank_attn/train/config.py` (`base_config`); this file
only sets what differs for the task. Variants: `configs/mlm.py:<variant>`.

  tiny  2-layer, D=128 encoder on tiny Shakespeare with a 1,000-piece SentencePiece
        vocabulary; 15% of tokens predicted (BERT's 80/10/10 corruption).
        python -m lowrank_attn.main --config=configs/mlm.py:tiny --workdir=runs/mlm_tiny
        Measured: 29 s wall on 2 shared CPU cores (2026-11-25; 1 device, 100 steps of 32 x 128
        tokens, tokenizer training included); masked-token loss 7.41 at step 1, eval loss
        5.17 (accuracy 13%) at step 100.
  base  BERT-style 6-layer, D=512, post-LayerNorm encoder on the complete works of
        Shakespeare with the uncased BERT WordPiece vocabulary (that of all-MiniLM-L6-v2,
        so pretrained BERT weights fit), token types, sequence length 128.
        python -m lowrank_attn.main --config=configs/mlm.py --workdir=runs/mlm
        50,000 steps of 256 x 128 tokens (7 TFLOP per step, 350 PFLOP in all): estimated
        a few hours to a day on one accelerator; not practical on this CPU.
        Result: not measured yet.
  bert_large  BERT-large of Devlin et al. (2019), for sizing a TPU run (the paper-scale row of
        the issue for Bhojanapalli et al.): 24 layers, D=1024, 16 heads of 64, MLP 4096,
        post-LayerNorm, erf GELU, the uncased WordPiece vocabulary (30,522) as base; rows of
        512 tokens, 256 sequences per step (16 per chip on 16 chips, v5p-32; on N chips set
        per_device_batch_size = 256 / N), 1,000,000 steps; AdamW 1e-4 (0.9, 0.999, 1e-6,
        weight decay 0.01), 10,000 warmup steps then linear decay; dropout 0.1. BERT itself
        ran 90% of the steps at L=128 and 10% at L=512: `--config.data.max_length=128
        --config.num_train_steps=900000` is the first phase (tpu/compile_table.md prices
        both phases and the 1M steps at 512).
        Data: BERT's corpus (BooksCorpus + English Wikipedia, 3.3B words) is not shipped and
        no pipeline at that scale is; the data set stays base's Shakespeare (a few MB), so a
        run of this variant as is would repeat Shakespeare for a million steps. It has never
        been trained. `python tpu/compile.py --table` compiles it with the pipeline's
        element_spec only (no data read).
        Result: not measured.

Gates on every encoder head with Voita et al.'s L0 penalty:
  --config.model.attention.gated=True --config.l0_penalty_weight=0.01
"""

from lowrank_attn.train import config as config_lib


def get_config(variant: str = 'base'):
  config = config_lib.base_config('mlm')
  config.data.name = 'shakespeare'
  config.data.tokenizer = 'wordpiece'  # BERT uncased vocabulary (30,522 pieces)
  config.data.max_length = 128
  config.data.mlm_probability = 0.15
  config.model.max_length = 512  # BERT's position table
  # The switches that make the architecture BERT's (TransformerConfig docstring).
  config.model.norm = 'post'
  config.model.scale_embeddings = False
  config.model.type_vocab_size = 2
  config.model.layer_norm_epsilon = 1e-12
  config.model.activation = 'gelu_exact'  # BERT's erf GELU
  config.num_train_steps = 50_000
  config.per_device_batch_size = 256
  config.learning_rate = 5e-4
  config.lr_schedule = 'linear'
  config.warmup_steps = 2_000
  config.weight_decay = 0.01
  config.adam_b2 = 0.999
  config.adam_eps = 1e-6
  config.eval_every_steps = 2_000
  config.checkpoint_every_steps = 2_000
  config.num_eval_steps = 50

  if variant == 'tiny':
    config_lib.shrink(config)
    config.data.name = 'tiny_shakespeare'
    config.data.tokenizer = 'sentencepiece'
    config.data.vocab_size = 1_000
    config.model.norm = 'pre'  # post-LN needs a long warmup; pre-LN learns in 100 steps
    config.model.scale_embeddings = True
    config.model.type_vocab_size = 0
    config.lr_schedule = 'cosine'
  elif variant == 'bert_large':
    config.data.max_length = 512
    config.model.emb_dim = 1024
    config.model.mlp_dim = 4096
    config.model.num_encoder_layers = 24
    config.model.attention.num_heads = 16
    config.per_device_batch_size = 16  # x 16 chips = BERT's 256 sequences
    config.num_train_steps = 1_000_000
    config.learning_rate = 1e-4
    config.warmup_steps = 10_000
    config.eval_every_steps = 10_000
    config.checkpoint_every_steps = 10_000
  elif variant != 'base':
    raise ValueError(f'configs/mlm.py: unknown variant {variant!r}; valid: base, tiny, bert_large.')
  return config
