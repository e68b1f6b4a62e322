"""Input-pipeline throughput: examples/s and tokens/s of the multi30k translation pipeline.

    LOWRANK_ATTN_DATA=../shared/data .venv/bin/python benchmarks/input_pipeline.py \
        [--global_batch_size=64] [--max_length=64] [--num_workers=0] [--num_batches=300]

Prints one line per measurement, then the rate of the training step it feeds: the nmt
model of `configs/nmt.py` (Transformer-base; `--model=tiny` for the tiny one) on the same
batches, through the training loop's own jitted step on one device. The pipeline must stay
well ahead of the step: the last line is pipeline examples/s over step examples/s.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time

from absl import app
from absl import flags

from lowrank_attn import data

_BATCH = flags.DEFINE_integer("global_batch_size", 64, "Rows per batch.")
_MAX_LENGTH = flags.DEFINE_integer("max_length", 64, "Tokens per side (nmt).")
_VOCAB = flags.DEFINE_integer("vocab_size", 8000, "SentencePiece vocabulary.")
_WORKERS = flags.DEFINE_multi_integer(
    "num_workers", [0, 2], "grain worker processes; one measurement per value.")
_BATCHES = flags.DEFINE_integer("num_batches", 300, "Batches timed per measurement.")
_MODEL = flags.DEFINE_enum("model", "base", ["base", "tiny", "none"],
                           "configs/nmt.py variant whose training step is timed; none: skip.")
_STEPS = flags.DEFINE_integer("train_steps", 5, "Training steps timed (after one to compile).")
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Tokenizer cache and prepared data; None: a fresh temporary directory.")


@dataclasses.dataclass(frozen=True)
class Throughput:
  batches: int
  examples: int
  tokens: int  # non-padding tokens of inputs and targets
  seconds: float

  @property
  def examples_per_s(self) -> float:
    return self.examples / self.seconds

  @property
  def tokens_per_s(self) -> float:
    return self.tokens / self.seconds

  def __str__(self):
    return (f"{self.examples_per_s:10,.0f} examples/s {self.tokens_per_s:12,.0f} tokens/s "
            f"({self.batches} batches in {self.seconds:.2f} s)")


def measure(batches, *, num_batches: int, warmup_batches: int = 10) -> Throughput:
  """Times `num_batches` batches of an iterator of batches (after `warmup_batches`)."""
  iterator = iter(batches)
  for _ in range(warmup_batches):  # worker start-up and first-read latency are not throughput
    next(iterator)
  examples = tokens = 0
  start = time.perf_counter()
  for _ in range(num_batches):
    batch = next(iterator)
    examples += int(batch["weights"].any(axis=1).sum())
    tokens += int((batch["inputs"] != 0).sum() + (batch["targets"] != 0).sum())
  return Throughput(num_batches, examples, tokens, time.perf_counter() - start)


def translation_pipeline(workdir: str, *, num_workers: int) -> data.Pipeline:
  config = data.default_data_config(
      name="multi30k", task="nmt", tokenizer="sentencepiece", vocab_size=_VOCAB.value,
      max_length=_MAX_LENGTH.value, packing=False, num_workers=num_workers)
  return data.make_pipeline(config, split="train", seed=0, global_batch_size=_BATCH.value,
                            train=True, workdir=workdir)


def measure_train_step(pipeline: data.Pipeline, variant: str, num_steps: int) -> Throughput:
  """Examples/s of the real nmt training step on this pipeline's batches (one device)."""
  import importlib.util
  import pathlib

  import jax
  from lowrank_attn.train import sharding, train

  path = pathlib.Path(__file__).resolve().parents[1] / "configs" / "nmt.py"
  spec = importlib.util.spec_from_file_location("nmt_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(variant)
  config.per_device_batch_size = _BATCH.value
  config.data.max_length = _MAX_LENGTH.value
  config.mesh.data = 1
  tokenizer = pipeline.tokenizer
  devices = jax.devices()[:1]
  s = train.setup(config, vocab_size=tokenizer.vocab_size, bos_id=tokenizer.bos_id,
                  devices=devices)
  state = train.create_state(s)
  batch = next(pipeline)
  step, _, shardings = train.compile_steps(s, {k: v.shape for k, v in batch.items()})
  key = jax.random.key(0)
  batches = [sharding.global_batch(next(pipeline), shardings, 1) for _ in range(num_steps + 1)]
  state, metrics = train._run_step(step, state, batches[0], key, s=s)  # compiles
  jax.block_until_ready(metrics)
  start = time.perf_counter()
  for batch in batches[1:]:
    state, metrics = train._run_step(step, state, batch, key, s=s)
  jax.block_until_ready(metrics)
  seconds = time.perf_counter() - start
  examples = sum(int(b["weights"].any(axis=1).sum()) for b in batches[1:])
  tokens = sum(int((b["inputs"] != 0).sum() + (b["targets"] != 0).sum()) for b in batches[1:])
  return Throughput(num_steps, examples, tokens, seconds)


def main(argv):
  del argv
  workdir = _WORKDIR.value or tempfile.mkdtemp(prefix="input_pipeline_bench_")
  print(f"multi30k en→de, sentencepiece {_VOCAB.value}, global batch {_BATCH.value}, "
        f"max_length {_MAX_LENGTH.value}, {os.cpu_count()} CPUs, workdir {workdir}")
  start = time.perf_counter()
  translation_pipeline(workdir, num_workers=0)  # prepares the dataset, trains the tokenizer
  print(f"setup (prepare multi30k + train tokenizer, first run only): "
        f"{time.perf_counter() - start:.1f} s")
  fastest = None
  for num_workers in _WORKERS.value:
    pipeline = translation_pipeline(workdir, num_workers=num_workers)
    result = measure(pipeline, num_batches=_BATCHES.value)
    pipeline.close()
    print(f"num_workers={num_workers}: {result}")
    if fastest is None or result.examples_per_s > fastest.examples_per_s:
      fastest = result
  if _MODEL.value != "none":
    pipeline = translation_pipeline(workdir, num_workers=0)
    step = measure_train_step(pipeline, _MODEL.value, _STEPS.value)
    print(f"training step (configs/nmt.py:{_MODEL.value}, 1 device): {step}")
    print(f"pipeline / training step: {fastest.examples_per_s / step.examples_per_s:.0f}x "
          "(examples/s; > 1: the input keeps ahead)")


if __name__ == "__main__":  # grain worker processes re-import this module
  app.run(main)
