"""One of two processes preparing the same fresh TFDS directory and tokenizer file.

    python prepare_worker.py PROCESS_ID PORT WORKDIR

Prints PREPARED / TRAINED when this process prepared the data set / trained the tokenizer,
then VOCAB <size>. Started by test_pipeline.py::test_two_jax_processes_prepare_once.
"""

import sys

import jax

jax.config.update('jax_cpu_collectives_implementation', 'gloo')

from lowrank_attn import tasks  # pylint: disable=g-import-not-at-top
from lowrank_attn import data  # pylint: disable=g-import-not-at-top
from lowrank_attn.data import datasets, tokenizers  # pylint: disable=g-import-not-at-top


def main(process_id: str, port: str, workdir: str):
  jax.distributed.initialize(f'localhost:{port}', num_processes=2, process_id=int(process_id))
  prepare, train = datasets._prepare, tokenizers.CharTokenizer.train.__func__

  def announced_prepare(*args):
    print('PREPARED', flush=True)
    return prepare(*args)

  def announced_train(cls, texts):
    print('TRAINED', flush=True)
    return train(cls, texts)

  datasets._prepare = announced_prepare
  tokenizers.CharTokenizer.train = classmethod(announced_train)
  config = data.default_data_config(
      name='tiny_shakespeare', task='lm', tokenizer='char', max_length=64
  )
  pipeline = tasks.make_pipeline(
      config,
      split='train',
      seed=0,
      global_batch_size=4,
      train=True,
      workdir=workdir,
      process_index=jax.process_index(),
      process_count=jax.process_count(),
  )
  print('VOCAB', pipeline.tokenizer.vocab_size, flush=True)
  jax.distributed.shutdown()


if __name__ == '__main__':
  main(*sys.argv[1:])
