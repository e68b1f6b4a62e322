"""The sharded training loop (`train_and_evaluate`), its pure steps, configs and checkpoints.

    from lowrank_attn.train import train_and_evaluate
    from configs import lm                    # or load any config file
    train_and_evaluate(lm.get_config('tiny'), '/tmp/lm_tiny')
"""

from lowrank_attn.train.config import base_config, model_config, validate
from lowrank_attn.train.train import (
    NonFiniteError,
    Preempted,
    eval_step,
    train_and_evaluate,
    train_step,
)
