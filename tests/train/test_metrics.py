"""Honest utilisation figures: MFU only against a published peak that says where it came from,
always beside the achieved GFLOP/s; on CPU achieved GFLOP/s only."""

import os
import pathlib
import pickle
import shutil
import subprocess
import sys
import types

import jax
import pytest

from lowrank_attn.train import metrics

PACKAGE = pathlib.Path(metrics.__file__).resolve().parents[1]
V5E = types.SimpleNamespace(platform='tpu', device_kind='TPU v5 lite')
H100 = types.SimpleNamespace(platform='gpu', device_kind='NVIDIA H100 80GB HBM3')


def test_tpu_peak_is_the_published_chip_figure():
  peak = metrics.peak_flops_per_device(device=V5E)
  assert float(peak) == 197e12
  assert 'published bf16 peak of v5e' in peak.source and 'cloud.google.com' in peak.source
  assert pickle.loads(pickle.dumps(peak)).source == peak.source


def test_gpu_peak_is_the_datasheets_dense_bf16_figure():
  peak = metrics.peak_flops_per_device(device=H100)
  assert float(peak) == 989.5e12  # half the datasheet's 1,979 TFLOPS "with sparsity"
  assert 'h100_sxm' in peak.source and 'nvidia.com' in peak.source
  a100 = types.SimpleNamespace(platform='gpu', device_kind='NVIDIA A100-SXM4-40GB')
  assert float(metrics.peak_flops_per_device(device=a100)) == 312e12


def test_no_published_peak_no_mfu():
  """CPU (and a GPU not in the table): no peak, so no MFU, whatever the machine's speed."""
  assert metrics.peak_flops_per_device() is None  # this machine's CPU devices
  unknown = types.SimpleNamespace(platform='gpu', device_kind='NVIDIA GeForce RTX 4090')
  assert metrics.peak_flops_per_device(device=unknown) is None
  assert metrics.describe_peak(None, 'cpu').startswith('no published peak for cpu devices')


@pytest.mark.integration  # starts Python
def test_the_chip_table_travels_with_the_package(tmp_path):
  """An installed (not editable) package has no tpu/ folder beside it; the peak is still found."""
  shutil.copytree(PACKAGE, tmp_path / 'lowrank_attn', ignore=shutil.ignore_patterns('__pycache__'))
  code = (
      'import types; from lowrank_attn.train import metrics; '
      "v5e = types.SimpleNamespace(platform='tpu', device_kind='TPU v5 lite'); "
      'print(metrics.__file__); print(metrics.peak_flops_per_device(device=v5e).source)'
  )
  env = {**os.environ, 'PYTHONPATH': str(tmp_path), 'JAX_PLATFORMS': 'cpu'}
  out = subprocess.run(
      [sys.executable, '-c', code],
      cwd=tmp_path,
      env=env,
      check=True,
      capture_output=True,
      text=True,
      timeout=120,
  ).stdout.splitlines()
  assert out[-2].startswith(str(tmp_path))  # the copy, not this checkout
  assert out[-1].startswith('published bf16 peak of v5e'), out[-1]


def progress_after(monkeypatch, peak, steps=4, secs=2.0):
  progress = metrics.Progress(
      num_train_steps=10, tokens_per_step=100, flops_per_step=3e9, peak_flops=peak, every_secs=1.0
  )
  clock = iter([0.0, secs])
  monkeypatch.setattr(metrics.time, 'perf_counter', lambda: next(clock))
  progress.resume()
  progress.count(steps)
  progress.pause()
  return progress


def test_progress_line_shows_achieved_gflops_beside_mfu(capsys, monkeypatch):
  progress = progress_after(monkeypatch, metrics.PeakFlops(2e10, 'given'))  # 4 steps in 2 s
  rates = progress.rates()
  assert rates['flops_per_sec'] == pytest.approx(6e9)
  assert rates['mfu'] == pytest.approx(0.3)
  progress.show(4, 1.5, rates)
  assert '6 GFLOP/s = MFU 30.0%' in capsys.readouterr().out


def test_without_a_peak_only_gflops_are_shown(capsys, monkeypatch):
  progress = progress_after(monkeypatch, None)
  rates = progress.rates()
  assert rates['flops_per_sec'] == pytest.approx(6e9) and 'mfu' not in rates
  progress.show(4, 1.5, rates)
  out = capsys.readouterr().out
  assert '6 GFLOP/s' in out and 'MFU' not in out


def test_an_mfu_above_100_percent_says_its_peak_is_wrong(monkeypatch):
  progress = progress_after(monkeypatch, metrics.PeakFlops(5e9, 'config.peak_flops_per_device'))
  assert metrics.format_throughput(progress.rates()) == (
      '6 GFLOP/s = MFU 120.0% (above 100%: the peak it divides by is too low)'
  )


def test_training_loop_divides_by_the_published_peak_or_none(monkeypatch):
  """train.py's peak: the device's published figure (not a matmul probe), with its source;
  none on CPU; the config's when given."""
  from lowrank_attn.train import config as config_lib, train

  config = config_lib.base_config('lm')
  n = jax.device_count()
  assert train._peak_flops(config, jax.numpy.float32, n) is None  # CPU
  config.peak_flops_per_device = 1e11
  peak = train._peak_flops(config, jax.numpy.float32, n)
  assert float(peak) == n * 1e11
  assert float(train._peak_flops(config, jax.numpy.float32, 1)) == 1e11  # a run on one device
  assert peak.source.endswith('config.peak_flops_per_device')
  config.peak_flops_per_device = None
  monkeypatch.setattr(jax, 'local_devices', lambda: [V5E])
  peak = train._peak_flops(config, jax.numpy.float32, n)
  assert float(peak) == n * 197e12
  assert peak.source.startswith(
      f'{n} x 197,000 GFLOP/s, published bf16 peak '
      'of v5e (https://cloud.google.com/tpu/docs/v5e)'
  )
