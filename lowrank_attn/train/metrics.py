"""Metrics out of a run: TensorBoard events, a JSON-lines file, a progress line, MFU.

TensorBoard files are written with tensorboard's own `EventFileWriter` (no TensorFlow needed)
and read back by `tensorboard` or `EventAccumulator`. `<workdir>/metrics.jsonl` has one
`{"step", "split", ...}` object per line; a resumed run appends, so a reader should keep the
last line per (split, step).
"""

from collections.abc import Mapping
import json
import math
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.plugins.hparams import summary_v2 as hparams_summary
from tensorboard.summary.writer.event_file_writer import EventFileWriter

METRICS_FILE = 'metrics.jsonl'
TENSORBOARD_DIR = 'tensorboard'


def flatten(tree: Mapping[str, Any], prefix: str = '') -> dict[str, Any]:
  out = {}
  for key, value in tree.items():
    name = f'{prefix}{key}'
    if isinstance(value, Mapping):
      out.update(flatten(value, name + '.'))
    else:
      out[name] = value
  return out


class MetricWriter:
  """Scalars to TensorBoard and metrics.jsonl; hyper-parameters once. Process 0 only."""

  def __init__(self, workdir: str):
    self.active = jax.process_index() == 0
    if not self.active:
      return
    self._events = EventFileWriter(os.path.join(workdir, TENSORBOARD_DIR))
    self._jsonl = open(os.path.join(workdir, METRICS_FILE), 'a')

  def write_hparams(self, hparams: Mapping[str, Any]) -> None:
    if not self.active:
      return
    flat = {k: v if isinstance(v, (bool, int, float, str)) else str(v)
            for k, v in flatten(hparams).items()}
    self._events.add_event(event_pb2.Event(
        wall_time=time.time(), step=0, summary=hparams_summary.hparams_pb(flat)))
    self._jsonl.write(json.dumps({'step': 0, 'split': 'hparams', **flat}) + '\n')
    self.flush()

  def write_scalars(self, step: int, split: str, scalars: Mapping[str, float]) -> None:
    if not self.active:
      return
    values = [summary_pb2.Summary.Value(tag=f'{split}/{k}', simple_value=float(v))
              for k, v in scalars.items()]
    self._events.add_event(event_pb2.Event(
        wall_time=time.time(), step=int(step), summary=summary_pb2.Summary(value=values)))
    line = {'step': int(step), 'split': split, 'time': round(time.time(), 3)}
    line.update({k: float(v) for k, v in scalars.items()})
    self._jsonl.write(json.dumps(line) + '\n')

  def flush(self) -> None:
    if self.active:
      self._events.flush()
      self._jsonl.flush()

  def close(self) -> None:
    if self.active:
      self._events.close()
      self._jsonl.close()
      self.active = False


def measure_peak_flops_per_device(dtype=jnp.float32, size: int = 1024, repeats: int = 5) -> float:
  """Matmul FLOP/s per device, measured with every local device busy at once.

  Devices are loaded together because virtual CPU devices share the host's cores: their
  combined throughput, not one device's, is what a sharded step can reach.
  """
  devices = jax.local_devices()
  mesh = jax.sharding.Mesh(np.array(devices), ('d',))
  sharding = NamedSharding(mesh, P('d'))
  x = jax.device_put(jnp.ones((len(devices), size, size), dtype), sharding)
  matmul = jax.jit(lambda a: jnp.einsum('bij,bjk->bik', a, a), out_shardings=sharding)
  matmul(x).block_until_ready()  # compile
  best = math.inf
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(x).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2 * size ** 3 / best


def say(line: str) -> None:
  """A user-facing line: stdout on process 0 (absl logs go to stderr / log files)."""
  if jax.process_index() == 0:
    if sys.stderr.isatty():  # erase the progress bar first
      sys.stderr.write('\r\033[K')
      sys.stderr.flush()
    print(line, flush=True)


class Progress:
  """Throughput bookkeeping and the periodic progress line.

  Time spent in compilation (the first step of a process), evaluation and checkpointing is
  excluded (`pause` / `resume`), so steps/s, tokens/s and MFU describe training steps only.
  """

  def __init__(self, *, num_train_steps: int, tokens_per_step: int, flops_per_step: float,
               peak_flops: float, every_secs: float):
    self.num_train_steps = num_train_steps
    self.tokens_per_step = tokens_per_step
    self.flops_per_step = flops_per_step
    self.peak_flops = peak_flops
    self.every_secs = every_secs
    self.interactive = sys.stderr.isatty()
    self._timed_steps = 0
    self._timed_secs = 0.0
    self._window_steps = 0
    self._window_secs = 0.0
    self._start = None  # perf_counter() while the clock runs
    self._last_line = time.time()

  def resume(self) -> None:
    if self._start is None:
      self._start = time.perf_counter()

  def pause(self) -> None:
    if self._start is not None:
      elapsed = time.perf_counter() - self._start
      self._timed_secs += elapsed
      self._window_secs += elapsed
      self._start = None

  def count(self, steps: int = 1) -> None:
    """`steps` steps ran while the clock was running."""
    self._timed_steps += steps
    self._window_steps += steps

  def rates(self, window: bool = True) -> dict[str, float]:
    steps, secs = ((self._window_steps, self._window_secs) if window
                   else (self._timed_steps, self._timed_secs))
    if self._start is not None:
      secs += time.perf_counter() - self._start
    if steps == 0 or secs <= 0:
      return {}
    steps_per_sec = steps / secs
    return {'steps_per_sec': steps_per_sec,
            'tokens_per_sec': steps_per_sec * self.tokens_per_step,
            'mfu': steps_per_sec * self.flops_per_step / self.peak_flops}

  def due(self, step: int) -> bool:
    """Whether a progress line is due (`every_secs` since the last one); redraws the bar."""
    if self.interactive:
      self._bar(step)
    return time.time() - self._last_line >= self.every_secs

  def take_window(self) -> dict[str, float]:
    """Rates since the previous call, then starts a new window."""
    running = self._start is not None
    self.pause()
    rates = self.rates()
    self._window_steps, self._window_secs = 0, 0.0
    if running:
      self.resume()
    return rates

  def show(self, step: int, loss: float, rates: Mapping[str, float]) -> None:
    self._last_line = time.time()
    line = f'step {step}/{self.num_train_steps}  loss {loss:.4f}'
    if rates:
      line += (f'  {rates["steps_per_sec"]:.2f} steps/s  {rates["tokens_per_sec"]:,.0f} tokens/s'
               f'  MFU {100 * rates["mfu"]:.1f}%')
    say(line)

  def _bar(self, step: int) -> None:
    """A one-line bar on interactive terminals, redrawn in place between progress lines."""
    width = 30
    filled = int(width * min(step / max(self.num_train_steps, 1), 1.0))
    sys.stderr.write(f'\r[{"#" * filled}{"." * (width - filled)}] {step}/{self.num_train_steps}')
    sys.stderr.flush()
