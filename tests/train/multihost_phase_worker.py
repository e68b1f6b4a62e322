"""One process of a simulated 2-host run (2 CPU devices each, gloo collectives) of the real
command line, held in one phase until the test lets it go (for test_multihost.py).

    python tests/train/multihost_phase_worker.py PHASE STEP RELEASE [lowrank_attn.main flags]

PHASE, at step STEP:
  train  before the training step that makes step STEP;
  eval   in the periodic evaluation at step STEP (or its rerun when the run resumes at STEP),
         before its first batch is computed (that batch's stop check done);
  none   never held.
The worker prints 'HELD <phase> <step>' and waits until the file RELEASE exists. JAX's
preemption service catches SIGTERM in C++ and no Python hook says when it has seen it, so
(unlike phase_worker.py) the test sends the signal while every process is held, waits a fixed
time for the notice to reach every process and for them to agree on the sync point, then
creates RELEASE. Each periodic evaluation prints 'EVAL <step> batches <n> in <secs> s' when
it ends or stops (<n>: the batches it computed; <secs> includes a hold).
"""

import os
import sys
import time

os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=2'

import jax  # pylint: disable=g-import-not-at-top

jax.config.update('jax_cpu_collectives_implementation', 'gloo')


def main():
  phase, step, release = sys.argv[1], int(sys.argv[2]), sys.argv[3]
  sys.argv = [sys.argv[0], *sys.argv[4:]]
  sys.path.insert(0, os.getcwd())
  from absl import app  # pylint: disable=g-import-not-at-top

  from lowrank_attn import main as main_lib  # pylint: disable=g-import-not-at-top
  from lowrank_attn.train import state as state_lib, train  # pylint: disable=g-import-not-at-top

  held = []

  def hold():
    if held:
      return
    held.append(True)
    print(f'HELD {phase} {step}', flush=True)
    while not os.path.exists(release):
      time.sleep(0.01)

  current = {'phase': 'train', 'step': 0, 'batches': 0}  # what the run is doing
  evaluate_all = train._evaluate_all

  def in_periodic_eval(*args, **kwargs):
    current['phase'], current['batches'] = 'eval', 0
    started = time.monotonic()
    try:
      return evaluate_all(*args, **kwargs)
    finally:
      current['phase'] = 'train'
      secs = time.monotonic() - started
      print(f'EVAL {current["step"]} batches {current["batches"]} in {secs:.1f} s', flush=True)

  train._evaluate_all = in_periodic_eval
  compile_steps = state_lib.compile_steps

  def held_steps(*args, **kwargs):
    train_step, eval_step = compile_steps(*args, **kwargs)

    def held_train_step(state, batch, key):
      current['step'] += 1
      if phase == 'train' and current['step'] == step:
        hold()
      return train_step(state, batch, key)

    def held_eval_step(params, batch):
      if phase == 'eval' == current['phase'] and current['step'] >= step:
        hold()
      current['batches'] += 1
      return eval_step(params, batch)

    return held_train_step, held_eval_step

  state_lib.compile_steps = held_steps
  start = train._start

  def resumed_at(*args):  # the step counter starts where the run resumes
    state, first = start(*args)
    current['step'] = first
    return state, first

  train._start = resumed_at
  app.run(main_lib.main, flags_parser=main_lib.parse_flags)


if __name__ == '__main__':
  main()
