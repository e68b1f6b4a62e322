"""Honest MFU: the peak says where it came from; every MFU is printed with achieved GFLOP/s."""

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


def test_tpu_peak_is_the_published_chip_figure():
  v5e = types.SimpleNamespace(platform='tpu', device_kind='TPU v5 lite')
  peak = metrics.peak_flops_per_device(device=v5e)
  assert float(peak) == 197e12
  assert 'published bf16 peak of v5e' in peak.source and 'cloud.google.com' in peak.source
  assert peak.spread is None


@pytest.mark.integration  # starts Python
def test_the_chip_table_travels_with_the_package(tmp_path):
  """An installed (not editable) package has no tpu/ folder beside it; the peak is still found."""
  shutil.copytree(PACKAGE, tmp_path / 'lowrank_attn',
                  ignore=shutil.ignore_patterns('__pycache__'))
  code = ('import types; from lowrank_attn.train import metrics; '
          "v5e = types.SimpleNamespace(platform='tpu', device_kind='TPU v5 lite'); "
          'print(metrics.__file__); print(metrics.peak_flops_per_device(device=v5e).source)')
  env = {**os.environ, 'PYTHONPATH': str(tmp_path), 'JAX_PLATFORMS': 'cpu'}
  out = subprocess.run([sys.executable, '-c', code], cwd=tmp_path, env=env, check=True,
                       capture_output=True, text=True, timeout=120).stdout.splitlines()
  assert out[-2].startswith(str(tmp_path))  # the copy, not this checkout
  assert out[-1].startswith('published bf16 peak of v5e'), out[-1]


def test_measured_peak_is_the_best_sample_with_its_spread(monkeypatch):
  durations = iter([0.0, 1.0, 1.0, 1.5, 1.5, 3.5])  # samples of 1 s, 0.5 s, 2 s
  monkeypatch.setattr(metrics.time, 'perf_counter', lambda: next(durations))
  peak = metrics.measure_peak_flops_per_device(size=256, repeats=3)
  flop = 2 * 256**3
  assert float(peak) == flop / 0.5
  assert peak.spread == (flop / 2.0, flop / 0.5)
  assert peak.source.startswith(f'measured: best of 3 256^3 float32 matmuls on '
                                f'{jax.local_device_count()} cpu device(s)')
  # Still a float where the training loop multiplies it by the device count.
  assert type(peak * 8) is float and peak * 8 == 8 * flop / 0.5
  assert pickle.loads(pickle.dumps(peak)).source == peak.source


def test_progress_line_shows_achieved_gflops_beside_mfu(capsys, monkeypatch):
  progress = metrics.Progress(num_train_steps=10, tokens_per_step=100, flops_per_step=3e9,
                              peak_flops=metrics.PeakFlops(2e10, 'given'), every_secs=1.0)
  clock = iter([0.0, 2.0])  # 4 steps in 2 s
  monkeypatch.setattr(metrics.time, 'perf_counter', lambda: next(clock))
  progress.resume()
  progress.count(4)
  progress.pause()
  rates = progress.rates()
  assert rates['flops_per_sec'] == pytest.approx(6e9)
  assert rates['mfu'] == pytest.approx(0.3)
  progress.show(4, 1.5, rates)
  assert '6 GFLOP/s = MFU 30.0%' in capsys.readouterr().out


def test_training_loop_divides_by_the_chips_published_peak(monkeypatch):
  """train.py's peak: on TPU the chip's figure (not a matmul probe), with its source."""
  from lowrank_attn.train import config as config_lib, train
  v5e = types.SimpleNamespace(platform='tpu', device_kind='TPU v5 lite')
  monkeypatch.setattr(jax, 'local_devices', lambda: [v5e])
  config = config_lib.base_config('lm')
  peak = train._peak_flops(config, jax.numpy.float32)
  assert float(peak) == jax.device_count() * 197e12
  assert peak.source.startswith(f'{jax.device_count()} x 197,000 GFLOP/s, published bf16 peak '
                                'of v5e (https://cloud.google.com/tpu/docs/v5e)')
  config.peak_flops_per_device = 1e11
  peak = train._peak_flops(config, jax.numpy.float32)
  assert float(peak) == jax.device_count() * 1e11
  assert peak.source.endswith('config.peak_flops_per_device')
