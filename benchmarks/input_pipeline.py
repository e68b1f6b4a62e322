"""Input pipeline of Multi30k translation: padding, throughput, and the training step it feeds.

    LOWRANK_ATTN_DATA=../shared/data taskset -c 0 .venv/bin/python benchmarks/input_pipeline.py \
        [--global_batch_size=64] [--max_length=64] [--num_workers=0] [--num_batches=300] \
        [--out=benchmarks/results/input_pipeline.md]

Prints, and writes as a table to --out (with the command, machine and date):
  1. the one-time preparation: preparing Multi30k and training the tokenizer, then encoding
     the training split once for packing (cached in the workdir; later runs load it);
  2. padding: the share of padding tokens in training batches, one pair per row (padded) vs
     several pairs per row (packed, `data.packing=True`), at each of --padding_lengths, with
     the pairs per row and the share of training pairs too long for the row (dropped);
  3. throughput of the training pipeline of one process, padded (grain, for each
     --num_workers) and packed (examples encoded once, vectorised first fit, in-process:
     `data/packing.py`): pairs and real tokens per second of wall time, and pairs per second of
     this process's CPU time (steadier on a shared machine; `taskset -c 0` keeps it one core);
  4. the rate of the training step it feeds, on padded and on packed batches: the nmt model of
     `configs/nmt.py` (Transformer-base; `--model=tiny` for the tiny one), through the training
     loop's own compiled step on one device, and pipeline pairs/s over step pairs/s.
"""

import dataclasses
import datetime
import importlib.util
import os
import pathlib
import platform
import sys
import tempfile
import time

from absl import app
from absl import flags
import numpy as np

from lowrank_attn import tasks
from lowrank_attn import data

_BATCH = flags.DEFINE_integer('global_batch_size', 64, 'Rows per batch.')
_MAX_LENGTH = flags.DEFINE_integer('max_length', 64, 'Tokens per side (throughput, step).')
_PADDING_LENGTHS = flags.DEFINE_multi_integer(
    'padding_lengths', [64, 32], 'max_length values of the padding table.'
)
_PADDING_BATCHES = flags.DEFINE_integer('padding_batches', 100, 'Batches per padding row.')
_VOCAB = flags.DEFINE_integer('vocab_size', 8000, 'SentencePiece vocabulary.')
_WORKERS = flags.DEFINE_multi_integer(
    'num_workers', [0, 2], 'grain worker processes; one measurement per value.'
)
_BATCHES = flags.DEFINE_integer('num_batches', 300, 'Batches timed per measurement.')
_MODEL = flags.DEFINE_enum(
    'model',
    'base',
    ['base', 'tiny', 'none'],
    'configs/nmt.py variant whose training step is timed; none: skip.',
)
_STEPS = flags.DEFINE_integer('train_steps', 5, 'Training steps timed (after one to compile).')
_WORKDIR = flags.DEFINE_string(
    'workdir', None, 'Tokenizer cache and prepared data; None: a fresh temporary directory.'
)
_OUT = flags.DEFINE_string(
    'out', 'benchmarks/results/input_pipeline.md', 'Where the report goes; empty: not written.'
)


_ROWS = {False: 'padded', True: 'packed'}  # data.packing -> how rows hold pairs


@dataclasses.dataclass(frozen=True)
class Throughput:
  batches: int
  pairs: int
  tokens: int  # real (non-padding) tokens of inputs and targets
  seconds: float
  cpu_seconds: float | None = None  # this process's CPU time (all its threads)

  @property
  def pairs_per_s(self) -> float:
    return self.pairs / self.seconds

  @property
  def tokens_per_s(self) -> float:
    return self.tokens / self.seconds

  @property
  def pairs_per_cpu_s(self) -> float | None:
    return None if self.cpu_seconds is None else self.pairs / self.cpu_seconds

  def __str__(self):
    cpu = '' if self.cpu_seconds is None else f', {self.pairs_per_cpu_s:,.0f} pairs/CPU-s'
    return (
        f'{self.pairs_per_s:10,.0f} pairs/s {self.tokens_per_s:12,.0f} real tokens/s '
        f'({self.batches} batches in {self.seconds:.2f} s{cpu})'
    )


def count_pairs(batch) -> int:
  """Translation pairs in a batch: one per row with weight, or the segments of packed rows."""
  if 'targets_segment_ids' in batch:
    return int(batch['targets_segment_ids'].max(axis=1).sum())
  return int(batch['weights'].any(axis=1).sum())


def count_tokens(batch) -> int:
  return int(np.count_nonzero(batch['inputs']) + np.count_nonzero(batch['targets']))


def measure(batches, *, num_batches: int, warmup_batches: int = 10) -> Throughput:
  """Times `num_batches` batches of an iterator of batches (after `warmup_batches`)."""
  iterator = iter(batches)
  for _ in range(warmup_batches):  # worker start-up and first-read latency are not throughput
    next(iterator)
  pairs = tokens = 0
  start, cpu_start = time.perf_counter(), time.process_time()
  for _ in range(num_batches):
    batch = next(iterator)
    pairs += count_pairs(batch)
    tokens += count_tokens(batch)
  return Throughput(
      num_batches, pairs, tokens, time.perf_counter() - start, time.process_time() - cpu_start
  )


def translation_pipeline(
    workdir: str, *, num_workers: int = 0, packing: bool = False, max_length: int | None = None
) -> data.Pipeline:
  config = data.default_data_config(
      name='multi30k',
      task='nmt',
      tokenizer='sentencepiece',
      vocab_size=_VOCAB.value,
      max_length=max_length or _MAX_LENGTH.value,
      packing=packing,
      num_workers=num_workers,
  )
  return tasks.make_pipeline(
      config, split='train', seed=0, global_batch_size=_BATCH.value, train=True, workdir=workdir
  )


def dropped_share(pipeline: data.Pipeline) -> float:
  """Share of training pairs with a side longer than max_length (training drops them)."""
  encode = pipeline._encoder(truncate=False)  # pylint: disable=protected-access
  source = pipeline.data_source
  too_long = sum(
      max(len(v) for v in encode(example).values()) > pipeline.max_length
      for example in source.__getitems__(range(len(source)))
  )
  return too_long / len(source)


def padding_table(workdir: str, say) -> None:
  say(
      '',
      f'Padding share of training batches (first {_PADDING_BATCHES.value} batches of '
      f'{_BATCH.value} rows):',
      '',
      '| max_length | rows | padding of inputs | padding of targets | pairs per row | '
      'pairs too long (dropped) |',
      '|---|---|---|---|---|---|',
  )
  for max_length in _PADDING_LENGTHS.value:
    for packing in (False, True):
      pipeline = translation_pipeline(workdir, packing=packing, max_length=max_length)
      fraction = pipeline.padding_fraction(_PADDING_BATCHES.value)
      batches = [next(pipeline) for _ in range(10)]
      per_row = sum(count_pairs(b) for b in batches) / (10 * pipeline.batch_size)
      say(
          f'| {max_length} | {_ROWS[packing]} | {100 * fraction["inputs"]:.1f}% | '
          f'{100 * fraction["targets"]:.1f}% | {per_row:.2f} | '
          f'{100 * dropped_share(pipeline):.2f}% |'
      )


def measure_train_step(pipeline: data.Pipeline, variant: str, num_steps: int) -> Throughput:
  """Pairs/s of the real nmt training step on this pipeline's batches (one device)."""
  import jax  # pylint: disable=g-import-not-at-top
  from lowrank_attn import train  # pylint: disable=g-import-not-at-top

  path = pathlib.Path(__file__).resolve().parents[1] / 'configs' / 'nmt.py'
  spec = importlib.util.spec_from_file_location('nmt_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(variant)
  config.per_device_batch_size = _BATCH.value
  config.data.max_length = _MAX_LENGTH.value
  config.data.packing = pipeline.config.packing
  config.mesh.data = 1
  tokenizer = pipeline.tokenizer
  s = train.setup(
      config, vocab_size=tokenizer.vocab_size, bos_id=tokenizer.bos_id, devices=jax.devices()[:1]
  )
  state = train.create_state(s)
  # Compiled from the element spec, before any batch is read (as the training loop does).
  step, _ = train.compile_steps(s, pipeline.element_spec)
  key = jax.random.key(0)
  host = [next(pipeline) for _ in range(num_steps + 1)]
  batches = [s.global_batch(b) for b in host]
  with s.activate():
    state, metrics = step(state, batches[0], key)  # the first step is not timed
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for batch in batches[1:]:
      state, metrics = step(state, batch, key)
    jax.block_until_ready(metrics)
  seconds = time.perf_counter() - start
  return Throughput(
      num_steps, sum(map(count_pairs, host[1:])), sum(map(count_tokens, host[1:])), seconds
  )


def main(argv):
  del argv
  workdir = _WORKDIR.value or tempfile.mkdtemp(prefix='input_pipeline_bench_')
  lines = []

  def say(*new_lines):
    print(*new_lines, sep='\n', flush=True)
    lines.extend(new_lines)

  usable = sorted(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else []
  cores = len(usable) or os.cpu_count()
  # How it was run, as far as this process can see: the data directory and the CPU pinning.
  prefix = (
      [f'{data.DATA_DIR_ENV}={os.environ[data.DATA_DIR_ENV]}']
      if (data.DATA_DIR_ENV in os.environ)
      else []
  )
  if usable and len(usable) < os.cpu_count():
    prefix.append(f'taskset -c {",".join(map(str, usable))}')
  say(
      f'Multi30k en→de training pipeline of one process: SentencePiece {_VOCAB.value}, global '
      f'batch {_BATCH.value}, max_length {_MAX_LENGTH.value}, {_BATCHES.value} batches timed '
      'after 10.',
      f'Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs '
      f'({cores} usable by this process), load average '
      f'{", ".join(f"{x:.1f}" for x in os.getloadavg())} at the start; '
      f'{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC.',
      'Command: ' + ' '.join([*prefix, os.path.basename(sys.executable), *sys.argv]),
      '',
  )
  start = time.perf_counter()
  translation_pipeline(workdir)  # prepares the dataset, trains the tokenizer
  prepared = time.perf_counter() - start
  start = time.perf_counter()
  translation_pipeline(workdir, packing=True)  # encodes the split once, cached in the workdir
  encoded = time.perf_counter() - start
  start = time.perf_counter()
  translation_pipeline(workdir, packing=True)
  say(
      f'One-time preparation: Multi30k and the tokenizer {prepared:.1f} s (nothing when '
      f'--workdir has them), encoding the training split for packing {encoded:.1f} s; a packed '
      f'pipeline from the cache builds in {time.perf_counter() - start:.1f} s.'
  )
  padding_table(workdir, say)
  say(
      '',
      f'Throughput at max_length {_MAX_LENGTH.value}:',
      '',
      '| rows | num_workers | pairs/s | pairs per CPU-second | real tokens/s | batches in |',
      '|---|---|---|---|---|---|',
  )
  fastest = {}  # packing -> the fastest pipeline measurement
  for packing in (False, True):
    # Packed rows come from the in-process packed stream: worker processes play no part.
    for num_workers in _WORKERS.value if not packing else [0]:
      pipeline = translation_pipeline(workdir, num_workers=num_workers, packing=packing)
      result = measure(pipeline, num_batches=_BATCHES.value)
      pipeline.close()
      print(f'  {_ROWS[packing]}, num_workers={num_workers}: {result}')
      cpu = f'{result.pairs_per_cpu_s:,.0f}' if not num_workers else 'n/a (work in other processes)'
      lines.append(
          f'| {_ROWS[packing]} | {num_workers} | {result.pairs_per_s:,.0f} | {cpu} | '
          f'{result.tokens_per_s:,.0f} | {result.seconds:.2f} s |'
      )
      if packing not in fastest or result.pairs_per_s > fastest[packing].pairs_per_s:
        fastest[packing] = result
  if _MODEL.value != 'none':
    say('')
    for packing in (False, True):
      step = measure_train_step(
          translation_pipeline(workdir, packing=packing), _MODEL.value, _STEPS.value
      )
      say(
          f'Training step (configs/nmt.py:{_MODEL.value}, {_ROWS[packing]} batches, '
          f'1 device): {step}; the pipeline keeps '
          f'{fastest[packing].pairs_per_s / step.pairs_per_s:.0f}x ahead (pairs/s).'
      )
  if _OUT.value:
    with open(_OUT.value, 'w') as f:
      f.write('\n'.join(lines) + '\n')
    print(f'wrote {_OUT.value}')


if __name__ == '__main__':  # grain worker processes re-import this module
  app.run(main)
