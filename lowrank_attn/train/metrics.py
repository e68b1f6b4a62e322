"""Metrics out of a run: TensorBoard events, a JSON-lines file, a progress line, MFU.

Throughput is achieved matmul FLOP/s (`flops_per_sec`, every log line). MFU divides it by a
published peak that says where it came from (`peak_flops_per_device`): a TPU chip's bf16 peak
or an NVIDIA GPU's dense bf16 peak (lowrank_attn.chips), or the one config.peak_flops_per_device
gives. Without one (CPU, unknown devices) there is no `mfu` field and none is printed. Every
MFU is printed beside the achieved GFLOP/s it came from, so a reader can redo the division
with another peak.

TensorBoard files are written with tensorboard's own `EventFileWriter` (no TensorFlow needed)
and read back by `tensorboard` or `EventAccumulator`. `<workdir>/metrics.jsonl` has one
`{"step", "split", ...}` object per line; a resumed run appends, so a reader should keep the
last line per (split, step). A remote workdir (gs://) gets both through a local mirror,
uploaded whole at every flush (`MetricWriter`).
"""

from collections.abc import Mapping
import json
import math
import os
import shutil
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.plugins.hparams import summary_v2 as hparams_summary
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from lowrank_attn import chips, files

METRICS_FILE = 'metrics.jsonl'
TENSORBOARD_DIR = 'tensorboard'
# A remote run's metric files are written in <files.local_dir(workdir)>/metrics_mirror first.
MIRROR_DIR = 'metrics_mirror'


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
  """Scalars to TensorBoard and metrics.jsonl; hyper-parameters once. Process 0 only.

  A remote workdir (gs://: an object cannot be appended to) is written through a local
  mirror, `files.local_dir(workdir)/metrics_mirror/`: the files are written there as they
  would be in a local workdir, and every `flush` (after each logged step or evaluation) and
  `close` uploads each file that grew, whole (metrics.jsonl holds a line per logged step, an
  events file about as much: small). The mirror starts from the workdir's metrics.jsonl, so
  a resumed run, on any machine, appends to the history instead of replacing it, and with no
  TensorBoard file: each process writes an events file of its own, as it does locally, and
  the earlier ones stay in the workdir as uploaded. A failed upload is reported on stdout and
  retried at the next flush (training goes on); what a kill takes is what is not yet uploaded,
  as a local workdir loses what is not yet flushed.
  """

  def __init__(self, workdir: str):
    self.active = jax.process_index() == 0
    if not self.active:
      return
    self._workdir = workdir
    self._remote = files.is_remote(workdir)
    self._local = workdir
    self._uploaded: dict[str, int] = {}  # mirror file -> its size at its last upload
    if self._remote:
      self._local = os.path.join(files.local_dir(workdir), MIRROR_DIR)
      shutil.rmtree(self._local, ignore_errors=True)  # a former run's mirror on this machine
      os.makedirs(self._local)
      jsonl = os.path.join(self._local, METRICS_FILE)
      if files.download(os.path.join(workdir, METRICS_FILE), jsonl):
        self._uploaded[METRICS_FILE] = os.path.getsize(jsonl)
    self._events = EventFileWriter(os.path.join(self._local, TENSORBOARD_DIR))
    self._jsonl = open(os.path.join(self._local, METRICS_FILE), 'a')

  def write_hparams(self, hparams: Mapping[str, Any]) -> None:
    if not self.active:
      return
    flat = {
        k: v if isinstance(v, (bool, int, float, str)) else str(v)
        for k, v in flatten(hparams).items()
    }
    self._events.add_event(
        event_pb2.Event(wall_time=time.time(), step=0, summary=hparams_summary.hparams_pb(flat))
    )
    self._jsonl.write(json.dumps({'step': 0, 'split': 'hparams', **flat}) + '\n')
    self.flush()

  def write_scalars(self, step: int, split: str, scalars: Mapping[str, float]) -> None:
    if not self.active:
      return
    values = [
        summary_pb2.Summary.Value(tag=f'{split}/{k}', simple_value=float(v))
        for k, v in scalars.items()
    ]
    self._events.add_event(
        event_pb2.Event(
            wall_time=time.time(), step=int(step), summary=summary_pb2.Summary(value=values)
        )
    )
    line = {'step': int(step), 'split': split, 'time': round(time.time(), 3)}
    line.update({k: float(v) for k, v in scalars.items()})
    self._jsonl.write(json.dumps(line) + '\n')

  def flush(self) -> None:
    if self.active:
      self._events.flush()
      self._jsonl.flush()
      self._upload()

  def close(self) -> None:
    if self.active:
      self._events.close()
      self._jsonl.close()
      self.active = False
      self._upload()

  def _upload(self) -> None:
    """Remote workdir: every mirror file that changed since its last upload, whole."""
    if not self._remote:
      return
    names = [METRICS_FILE] + [
        os.path.join(TENSORBOARD_DIR, name)
        for name in sorted(os.listdir(os.path.join(self._local, TENSORBOARD_DIR)))
    ]
    for name in names:
      local = os.path.join(self._local, name)
      size = os.path.getsize(local)
      if self._uploaded.get(name) == size:
        continue
      try:
        files.upload(local, os.path.join(self._workdir, name))
      except Exception as e:  # pylint: disable=broad-except  (retried at the next flush)
        reason = (str(e).strip().splitlines() or [''])[0][:200]
        say(
            f'uploading {name} to {self._workdir} failed ({type(e).__name__}: {reason}); '
            f'retried at the next flush (the local copy: {local})'
        )
        continue
      self._uploaded[name] = size


class PeakFlops(float):
  """FLOP/s per device: a float (so existing arithmetic keeps working) that also says where
  it came from (`source`)."""

  source: str

  def __new__(cls, value: float, source: str):
    peak = super().__new__(cls, value)
    peak.source = source
    return peak

  def __reduce__(self):
    return PeakFlops, (float(self), self.source)


def peak_flops_per_device(dtype=jnp.float32, device=None) -> PeakFlops | None:
  """The published peak MFU divides by, with its source; None where there is none.

  TPU: the chip's published bf16 peak; NVIDIA GPU: its datasheet's dense bf16 Tensor Core
  peak (`lowrank_attn.chips`). MFU is conventionally quoted against that figure whatever the
  computation `dtype` (a float32 program runs at a fraction of it). CPU and any device not in
  those tables: None, and no MFU is printed, only achieved FLOP/s: a peak measured by a
  start-up matmul probe depends on the machine's load at that moment (on a loaded 2-core
  machine one read 48 GFLOP/s, and training then printed "MFU 115%").
  """
  del dtype  # the convention: the bf16 dense peak for every dtype
  device = device or jax.local_devices()[0]
  if device.platform == 'tpu':
    chip = chips.chip_of(device.device_kind)
    if chip is not None:
      return PeakFlops(chip.peak_bf16_flops, f'published bf16 peak of {chip.name} ({chip.source})')
  if device.platform == 'gpu':
    gpu = chips.gpu_of(device.device_kind)
    if gpu is not None:
      return PeakFlops(
          gpu.peak_bf16_flops, f'published dense bf16 peak of {gpu.name} ({gpu.source})'
      )
  return None


def describe_peak(peak: PeakFlops | None, platform: str | None = None) -> str:
  """'peak 1,579,000 GFLOP/s (source)', or why there is no MFU."""
  if peak is None:
    platform = platform or jax.local_devices()[0].platform
    return (
        f'no published peak for {platform} devices: achieved GFLOP/s only, no MFU '
        '(config.peak_flops_per_device sets one)'
    )
  return f'peak {peak / 1e9:,.0f} GFLOP/s ({peak.source})'


def say(line: str) -> None:
  """A user-facing line: stdout on process 0 (absl logs go to stderr / log files)."""
  if jax.process_index() == 0:
    if sys.stderr.isatty():  # erase the progress bar first
      sys.stderr.write('\r\033[K')
      sys.stderr.flush()
    print(line, flush=True)


def format_throughput(rates: Mapping[str, float]) -> str:
  """'1,234 GFLOP/s = MFU 41.1%': the achieved rate beside every MFU, so it can be re-divided;
  '1,234 GFLOP/s' without a peak. An MFU above 100% can only come from a peak set too low
  (config.peak_flops_per_device), and says so."""
  line = f'{rates["flops_per_sec"] / 1e9:,.0f} GFLOP/s'
  if 'mfu' in rates:
    line += f' = MFU {100 * rates["mfu"]:.1f}%'
    if rates['mfu'] > 1:
      line += ' (above 100%: the peak it divides by is too low)'
  return line


class Progress:
  """Throughput bookkeeping and the periodic progress line.

  Time spent in compilation (the first step of a process), evaluation and checkpointing is
  excluded (`pause` / `resume`), so steps/s, tokens/s and MFU describe training steps only.
  """

  def __init__(
      self,
      *,
      num_train_steps: int,
      tokens_per_step: int,
      flops_per_step: float,
      peak_flops: float | None,
      every_secs: float,
  ):
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
    """steps/s, tokens/s, achieved matmul FLOP/s (all devices) and, where there is a peak,
    MFU = that / peak."""
    steps, secs = (
        (self._window_steps, self._window_secs) if window else (self._timed_steps, self._timed_secs)
    )
    if self._start is not None:
      secs += time.perf_counter() - self._start
    if steps == 0 or secs <= 0:
      return {}
    steps_per_sec = steps / secs
    flops_per_sec = steps_per_sec * self.flops_per_step
    rates = {
        'steps_per_sec': steps_per_sec,
        'tokens_per_sec': steps_per_sec * self.tokens_per_step,
        'flops_per_sec': flops_per_sec,
    }
    if self.peak_flops is not None:
      rates['mfu'] = flops_per_sec / self.peak_flops
    return rates

  @property
  def train_secs(self) -> float:
    """Seconds of timed training steps so far in this process (the x-axis of learning curves)."""
    return self._timed_secs + (
        time.perf_counter() - self._start if self._start is not None else 0.0
    )

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
      line += (
          f'  {rates["steps_per_sec"]:.2f} steps/s  {rates["tokens_per_sec"]:,.0f} tokens/s'
          f'  {format_throughput(rates)}'
      )
    say(line)

  def _bar(self, step: int) -> None:
    """A one-line bar on interactive terminals, redrawn in place between progress lines."""
    width = 30
    filled = int(width * min(step / max(self.num_train_steps, 1), 1.0))
    sys.stderr.write(f'\r[{"#" * filled}{"." * (width - filled)}] {step}/{self.num_train_steps}')
    sys.stderr.flush()
