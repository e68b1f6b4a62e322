r"""Encoder-decoder translation, English -> German on Multi30k.

Every field is documented once, in `lowrank_attn/train/config.py` (`base_config`); this file
only sets what differs for the task. Variants: `configs/nmt.py:<variant>`.

  tiny  2+2 layers, D=128, SentencePiece 2,000 (shared vocabulary), 100 steps of 32
        sentence pairs; eval on the validation split, BLEU of 64 greedy translations.
        python -m lowrank_attn.main --config=configs/nmt.py:tiny --workdir=runs/nmt_tiny
        Measured: 35-50 s wall on 2 shared CPU cores (1 device, tokenizer training
        included); train loss 8.31 at step 1, eval loss 4.41 (perplexity 82) at step 100,
        greedy BLEU 1.7 (100 steps only teach the frequent words).
  base  Transformer-base (6+6 layers, D=512, 8 heads), label smoothing 0.1, beam 4;
        20,000 steps of 128 sentence pairs (2.4 TFLOP per step, 48 PFLOP in all).
        python -m lowrank_attn.main --config=configs/nmt.py --workdir=runs/nmt
        Estimated from those FLOPs: ~3 days on this CPU, about an hour on one accelerator.
        Result: not measured yet.

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
  config.data.packing = False
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

  if variant == 'tiny':
    config_lib.shrink(config, length=32)
    config.data.vocab_size = 2_000
    config.model.max_length = 48
    config.decode.max_length = 40
    config.decode.beam_size = 1  # greedy
    config.decode.num_examples = 64
  elif variant != 'base':
    raise ValueError(f'configs/nmt.py: unknown variant {variant!r}; valid: base, tiny.')
  return config
