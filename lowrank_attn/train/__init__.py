"""The sharded training loop (`train_and_evaluate`), its pure steps, configs and checkpoints.

    from lowrank_attn.train import train_and_evaluate
    from configs import lm                    # or load any config file
    train_and_evaluate(lm.get_config('tiny'), '/tmp/lm_tiny')

Modules: `config` (the schema of a run), `state` (config -> mesh,
sharded state, compiled steps), `steps` (the pure train/eval steps), `train` (the loop),
`checkpoints` (Orbax), `decode` (beam search, BLEU), `metrics`, `optim`. What a task is
(data format, model, loss, evaluators) lives in `lowrank_attn.tasks`.
"""

from lowrank_attn.train.config import base_config, model_config, shrink, validate
from lowrank_attn.train.state import Setup, compile_steps, create_state, setup
from lowrank_attn.train.steps import StepOptions, cross_entropy, eval_step, train_step
from lowrank_attn.train.train import NonFiniteError, Preempted, train_and_evaluate
