"""The training command line, held in one phase until a signal arrives (for test_preemption.py).

    python tests/train/phase_worker.py PHASE STEP [lowrank_attn.main flags]

PHASE, at step STEP:
  train      before the training step that makes step STEP;
  save       right after the save of step STEP has started (its commit may be in flight);
  eval       in the periodic evaluation at step STEP, before its first batch is computed;
  final      in the final evaluation, before its first batch;
  translate  in the final evaluation's translation (BLEU), before its first search batch;
  bleu       in the periodic evaluation's translation (BLEU, `decode.bleu`) at step STEP,
             before its first beam-search batch (the loss evaluation before it is done);
  glue_eval  in the periodic evaluation's GLUE predictions (`GlueEvaluator`) at step STEP,
             before its first batch is predicted (the loss evaluation before it is done);
  glue_final in the final evaluation's GLUE predictions, before its first batch.
The worker prints 'HELD <phase> <step>' and waits until the run's own signal handler has seen
a signal, then lets the run go on: what the run does next is what it does when a signal lands
in that phase. No clock is involved.
"""

import os
import sys
import threading
import time

HELD = threading.Event()  # the hold happened (once)
RECEIVED = threading.Event()  # the run's handler saw the signal


def main():
  phase, step = sys.argv[1], int(sys.argv[2])
  sys.argv = [sys.argv[0], *sys.argv[3:]]
  sys.path.insert(0, os.getcwd())
  from absl import app

  from lowrank_attn import main as main_lib
  from lowrank_attn.tasks import glue
  from lowrank_attn.train import checkpoints, decode, state as state_lib, train

  def hold():
    if HELD.is_set():
      return
    HELD.set()
    print(f'HELD {phase} {step}', flush=True)
    while not RECEIVED.is_set():  # the handler runs in this (main) thread, between sleeps
      time.sleep(0.01)

  handle = checkpoints.PreemptionWatcher._handle

  def handle_and_tell(self, signum, frame):
    handle(self, signum, frame)
    RECEIVED.set()

  checkpoints.PreemptionWatcher._handle = handle_and_tell

  current = {'phase': 'train', 'step': 0}  # what the run is doing
  evaluate_all, evaluate_final = train._evaluate_all, train._evaluate_final

  def in_periodic_eval(*args, **kwargs):
    current['phase'] = 'eval'
    try:
      return evaluate_all(*args, **kwargs)
    finally:
      current['phase'] = 'train'

  def in_final_eval(*args, **kwargs):
    current['phase'] = 'final'
    return evaluate_final(*args, **kwargs)

  train._evaluate_all, train._evaluate_final = in_periodic_eval, in_final_eval
  compile_steps = state_lib.compile_steps

  def held_steps(*args, **kwargs):
    train_step, eval_step = compile_steps(*args, **kwargs)

    def held_train_step(state, batch, key):
      current['step'] += 1
      if phase == 'train' and current['step'] == step:
        hold()
      return train_step(state, batch, key)

    def held_eval_step(params, batch):
      if phase == current['phase'] and current['step'] >= step and phase in ('eval', 'final'):
        hold()
      return eval_step(params, batch)

    return held_train_step, held_eval_step

  state_lib.compile_steps = held_steps
  save = checkpoints.Checkpointer.save

  def held_save(self, at, *args, **kwargs):
    started = save(self, at, *args, **kwargs)
    if phase == 'save' and at == step:
      hold()
    return started

  checkpoints.Checkpointer.save = held_save
  compiled_search = decode.Translator._compiled_search

  def held_search(self, shape):
    if phase == 'translate' and current['phase'] == 'final':
      hold()
    return compiled_search(self, shape)

  decode.Translator._compiled_search = held_search
  translate = decode.translate  # the periodic BLEU's search (`decode.bleu` looks it up here)

  def held_translate(*args, **kwargs):
    if phase == 'bleu' and current['phase'] == 'eval' and current['step'] >= step:
      hold()
    return translate(*args, **kwargs)

  decode.translate = held_translate
  glue_init = glue.GlueEvaluator.__init__

  def held_glue_init(self, context):
    glue_init(self, context)
    predict = self._predict  # one batch of `_predict_split`, after its stop check

    def held_predict(params, batch):
      if phase == f'glue_{current["phase"]}' and current['step'] >= step:
        hold()
      return predict(params, batch)

    self._predict = held_predict

  glue.GlueEvaluator.__init__ = held_glue_init

  def resumed_at(s, *args):  # the step counter starts where the run resumes
    state, start = start_(s, *args)
    current['step'] = start
    return state, start

  start_ = train._start
  train._start = resumed_at
  app.run(main_lib.main, flags_parser=main_lib.parse_flags)


if __name__ == '__main__':
  main()
