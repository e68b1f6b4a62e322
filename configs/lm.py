r"""Decoder-only language model on Shakespeare (character level).

Every field is documented once, in `lowrank_attn/train/config.py` (`base_config`); this file
only sets what differs for the task. Variants: `configs/lm.py:<variant>`.

  tiny  2-layer, D=128 character LM on Shakespeare's complete works (the `shakespeare`
        package from the package index, so it runs on a fresh machine): the README's
        `make train`.
        python -m lowrank_attn.main --config=configs/lm.py:tiny --workdir=runs/lm_tiny
        Measured: 2 min 51 s wall on a fresh clone (2026-11-30; 2-core CPU beside two training
        runs, 1 device, 100 steps of 32 x 128 characters, 40 s of it data preparation and the
        vocabulary), LOWRANK_ATTN_DATA unset; eval loss 2.478 (perplexity 11.9, accuracy 28%)
        at step 100. With --config.data.name=tiny_shakespeare: loss 4.73 at step 1, eval loss
        2.39 (perplexity 10.9).
  base  6-layer, D=512 (Transformer-base) character LM on tiny Shakespeare, dropout 0.2,
        5,000 steps of 64 x 256 characters (2.0 TFLOP per step, 10 PFLOP in all).
        python -m lowrank_attn.main --config=configs/lm.py --workdir=runs/lm
        Estimated from those FLOPs: ~14 hours on this CPU, minutes on one accelerator.
        Result: not measured yet.
  bottleneck  The head-size sweep of Bhojanapalli et al. (2020) on Shakespeare's complete works
        (experiments/bottleneck/sweep.py sets heads, kind and head_dim): context n = 128,
        D = 256, 2 layers, sinusoidal positions, 16 x 128 characters per step, eval on the
        whole validation split.
        250 steps (512k characters): sized so that the sweep's 38 runs fit in 3 hours on the
        2-core CPU (estimate and measured time: experiments/bottleneck/README.md).

Attention variants are one line, e.g. collaborative heads with a shared key width of 128:
  --config.model.attention.kind=collaborative --config.model.attention.key_dim=128
"""

from lowrank_attn.train import config as config_lib


def get_config(variant: str = 'base'):
  config = config_lib.base_config('lm')
  config.data.name = 'tiny_shakespeare'
  config.data.tokenizer = 'char'  # ~65 characters: no tokenizer training
  config.data.max_length = 256
  config.model.max_length = 256
  config.model.dropout_rate = 0.2  # 1 MB of text overfits quickly
  # Untied output layer: with ~65 symbols it costs nothing, and a tied one starts by
  # predicting the input character (its own embedding dominates the residual stream).
  config.model.tie_embeddings = False
  config.num_train_steps = 5_000
  config.per_device_batch_size = 64
  config.learning_rate = 1e-3
  config.lr_schedule = 'cosine'
  config.warmup_steps = 200
  config.end_learning_rate_factor = 0.1
  config.weight_decay = 0.1
  config.eval_every_steps = 500
  config.checkpoint_every_steps = 500
  config.num_eval_steps = 20

  if variant == 'tiny':
    config_lib.shrink(config)
    config.data.name = 'shakespeare'  # installed from the package index: no data directory
  elif variant == 'bottleneck':
    config_lib.shrink(
        config, emb_dim=256, num_layers=2, num_heads=8, length=128, steps=250, batch=16
    )
    config.data.name = 'shakespeare'
    # Learned positions start at N(0, 0.02^2) next to unit-scale token embeddings: the model
    # sits at the bigram plateau for hundreds of steps before it finds them. Sinusoidal ones
    # are usable from step 0 (probe: train loss 2.33 after 150 steps; 2.46 after 130 of 300
    # with learned positions).
    config.model.positions = 'sinusoidal'
    config.warmup_steps = 30
    config.checkpoint_every_steps = 100
    config.num_eval_steps = -1  # bits per character on all of the validation split
  elif variant != 'base':
    raise ValueError(
        f'configs/lm.py: unknown variant {variant!r}; valid: base, tiny, ' 'bottleneck.'
    )
  return config
