r"""Encoder-decoder translation, English -> German on Multi30k.

Every field is documented once, in `lowrank_attn/train/config.py` (`base_config`); this file
only sets what differs for the task. Variants: `configs/nmt.py:<variant>`.

  tiny  2+2 layers, D=128, SentencePiece 2,000 (shared vocabulary, learnt from the first 1M
        characters of train), 100 steps of 32 sentence pairs; eval on the validation split,
        BLEU of 64 greedy translations.
        python -m lowrank_attn.main --config=configs/nmt.py:tiny --workdir=runs/nmt_tiny
        Measured: 93 s wall (2026-11-30) on 2 CPU cores beside two training runs (1 device,
        tokenizer training included); train loss 8.32 at step 1, eval loss 4.10 (perplexity 60)
        at step 100, greedy BLEU 4.0 on the 64 sentences, 3.7 on the whole validation split
        (100 steps only teach the frequent words).
  multi30k  The translation baseline of the experiments: 3+3 layers, D=256, 8 heads of 32,
        MLP 1024, shared SentencePiece 6,000, packed rows of 64 tokens per side (64 rows, ~250
        sentence pairs, ~7,400 real tokens per step), AdamW 2e-3, 300 warmup steps then cosine
        to 0, dropout 0.1, label smoothing 0.1, 1,800 steps (~15 epochs); beam 4 with length
        penalty 1.0.
        python -m lowrank_attn.main --config=configs/nmt.py:multi30k --workdir=runs/multi30k
        python -m lowrank_attn.translate --workdir=runs/multi30k --average_last=3 \
            --length_penalty=1.0 \
            --input=$LOWRANK_ATTN_DATA/multi30k/test_2016_flickr.en.gz \
            --reference=$LOWRANK_ATTN_DATA/multi30k/test_2016_flickr.de.gz
        Measured (seed 0, 2-core CPU): 70 min of training steps (4,221 s, evaluations
        excluded) on a CPU shared with other jobs; undisturbed the step runs at 0.50-0.55
        steps/s (~100 GFLOP/s), i.e. 55-60 min. Validation BLEU 21.5 / 30.1 / 33.7 / 34.8 /
        34.9 / 35.1 at steps 300-1800 (experiments/multi30k/README.md has the curve).
        test_2016_flickr, beam 4: last checkpoint 34.7 (length penalty 0.6) / 35.0 (1.0); the
        average of the last 3 checkpoints (1200, 1500, 1800) 35.06 BLEU, chrF 60.3, chosen on
        validation (35.58 there vs 35.12 for the last checkpoint at 0.6).
  base  Transformer-base (6+6 layers, D=512, 8 heads), label smoothing 0.1, beam 4;
        20,000 steps of 128 sentence pairs (2.4 TFLOP per step, 48 PFLOP in all).
        python -m lowrank_attn.main --config=configs/nmt.py --workdir=runs/nmt
        Estimated from those FLOPs: ~3 days on this CPU, about an hour on one accelerator.
        Result: not measured yet.
  transformer_big  Transformer-big of Vaswani et al. (2017, table 3) at its WMT14 En-De
        batch, for sizing a TPU run (the paper-scale row of the issue for Cordonnier et al.):
        6+6 layers, D=1024, 16 heads of 64, MLP 4096 (ReLU), post-LayerNorm, sinusoidal
        positions, residual dropout 0.3, label smoothing 0.1, a shared SentencePiece 32k
        vocabulary (the paper's BPE had ~37k) with tied embeddings; packed rows of 256 tokens
        per side, 6 rows per chip: on 16 chips (v5p-32) 96 x 256 = 24,576 token slots per
        side, the paper's ~25k source + 25k target tokens (on N chips set
        per_device_batch_size = 96 / N); AdamW(0.9, 0.98, 1e-9), 4,000 warmup steps to 4.9e-4
        (= 1024^-0.5 x 4000^-0.5, the paper's peak) then inverse square root; 300,000 steps
        as the paper's big model; beam 4, alpha 0.6.
        Data: the official TFDS `wmt14_translate/de-en` (4.5M pairs; `tfds build` it first,
        see lowrank_attn/data/datasets.py). No pipeline at this scale is shipped or tested
        here: packing 4.5M pairs through our Python pipeline is untried, and this variant has
        never been trained. `python tpu/compile.py --table` compiles it with the pipeline's
        element_spec only (no data read): fit, step time and the chip-hours of the 300k steps
        are in tpu/compile_table.md.
        python -m lowrank_attn.main --config=configs/nmt.py:transformer_big --workdir=...
        Result: not measured.

Per attention type, e.g. collaborative keys in the encoder only, gates on all three:
  --config.model.encoder_attention.kind=collaborative --config.model.attention.gated=True
"""

from lowrank_attn.train import config as config_lib


def get_config(variant: str = 'base'):
  config = config_lib.base_config('nmt')
  config.data.name = 'multi30k'
  config.data.source_lang = 'en'
  config.data.target_lang = 'de'
  config.data.tokenizer = 'sentencepiece'
  config.data.vocab_size = 8_000  # shared source/target vocabulary
  config.data.max_length = 64  # tokens per side, EOS included (longer pairs are dropped)
  config.model.max_length = 128
  config.decode.max_length = 80
  config.num_train_steps = 20_000
  config.per_device_batch_size = 128
  config.learning_rate = 1e-3
  config.lr_schedule = 'inverse_sqrt'
  config.warmup_steps = 4_000
  config.label_smoothing = 0.1
  config.eval_every_steps = 2_000
  config.checkpoint_every_steps = 2_000
  config.decode.beam_size = 4
  config.decode.num_examples = -1  # the whole validation split (1,014 sentences)

  if variant == 'multi30k':
    # A small Transformer sized to train in 60 minutes on a 2-core CPU (see the docstring).
    config.data.vocab_size = 6_000
    config.data.packing = True
    config.data.max_length = 64
    config.model.emb_dim = 256
    config.model.mlp_dim = 1024
    config.model.num_encoder_layers = 3
    config.model.num_decoder_layers = 3
    config.model.attention.num_heads = 8
    config.model.max_length = 64
    config.model.dropout_rate = 0.1
    config.per_device_batch_size = 64  # packed rows of 64 tokens per side (~4 pairs each)
    config.learning_rate = 2e-3
    config.lr_schedule = 'cosine'
    config.warmup_steps = 300
    config.num_train_steps = 1_800
    config.eval_every_steps = 300
    config.checkpoint_every_steps = 300
    config.decode.max_length = 64
    config.decode.length_penalty = 1.0  # chosen on validation (see the docstring)
  elif variant == 'tiny':
    config_lib.shrink(config, length=32)
    config.data.vocab_size = 2_000
    # A quarter of train's 3.8M characters: SentencePiece learns in ~2 s instead of ~9.
    config.data.tokenizer_max_corpus_chars = 1_000_000
    config.model.max_length = 48
    config.decode.max_length = 40
    config.decode.beam_size = 1  # greedy
    config.decode.num_examples = 64
  elif variant == 'transformer_big':
    config.data.name = 'wmt14_translate/de-en'
    config.data.vocab_size = 32_000  # shared source/target SentencePiece
    config.data.packing = True
    config.data.max_length = 256  # tokens per side of a packed row
    config.model.max_length = 256
    config.model.emb_dim = 1024
    config.model.mlp_dim = 4096
    config.model.attention.num_heads = 16
    config.model.norm = 'post'  # Vaswani et al.'s layout: LN(x + f(x))
    config.model.activation = 'relu'
    config.model.positions = 'sinusoidal'
    config.model.dropout_rate = 0.3  # the paper's P_drop for big on En-De
    config.per_device_batch_size = 6  # x 16 chips x 256 = 24,576 tokens per side
    config.num_train_steps = 300_000
    config.learning_rate = 4.9e-4  # 1024^-0.5 x 4000^-0.5: the paper's rate at the warmup's end
    config.lr_schedule = 'inverse_sqrt'
    config.warmup_steps = 4_000
    config.eval_every_steps = 10_000
    config.checkpoint_every_steps = 5_000
    config.decode.max_length = 256
    config.decode.length_penalty = 0.6
    config.decode.num_examples = 256
  elif variant != 'base':
    raise ValueError(
        f'configs/nmt.py: unknown variant {variant!r}; valid: base, multi30k, tiny, '
        'transformer_big.'
    )
  return config
