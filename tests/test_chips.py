"""lowrank_attn/chips.py: the TPU chip table, gcloud's accelerator types, the GPU table."""

import pytest

from lowrank_attn import chips


@pytest.mark.parametrize(
    'accelerator_type, chip, num_chips, num_hosts',
    [
        ('v4-8', 'v4', 4, 1),
        ('v4-32', 'v4', 16, 4),
        ('v5litepod-16', 'v5e', 16, 4),
        ('v5e-8', 'v5e', 8, 1),
        ('v5p-32', 'v5p', 16, 4),
        ('v6e-8', 'v6e', 8, 1),
        ('v6e-16', 'v6e', 16, 4),
    ],
)
def test_accelerator_types(accelerator_type, chip, num_chips, num_hosts):
  slice_ = chips.parse_accelerator_type(accelerator_type)
  assert (slice_.chip.name, slice_.num_chips, slice_.num_hosts) == (chip, num_chips, num_hosts)


def test_chip_table():
  assert chips.chip_of('TPU v5 lite').peak_bf16_flops == 197e12
  assert chips.chip_of('TPU v4').hbm_bytes == 32 * 2**30
  assert chips.chip_of('cpu') is None
  for chip in chips.CHIPS.values():
    assert chip.source.startswith('https://cloud.google.com/tpu/docs/')
    assert 100e12 < chip.peak_bf16_flops < 1e15 and 16 * 2**30 <= chip.hbm_bytes


@pytest.mark.parametrize(
    'device_kind, gpu, tflops',
    [
        # jax's device_kind is the CUDA device name.
        ('NVIDIA H100 80GB HBM3', 'h100_sxm', 989.5),
        ('NVIDIA H100 PCIe', 'h100_pcie', 756.5),
        ('NVIDIA H100 NVL', 'h100_nvl', 835.5),
        ('NVIDIA H200', 'h200_sxm', 989.5),
        ('NVIDIA H200 NVL', 'h200_nvl', 835.5),
        ('NVIDIA A100-SXM4-80GB', 'a100', 312),
        ('NVIDIA A100-PCIE-40GB', 'a100', 312),
        ('NVIDIA A100 80GB PCIe', 'a100', 312),
    ],
)
def test_gpu_table(device_kind, gpu, tflops):
  """Dense bf16 peaks: half the datasheets' "with sparsity" figures (A100's 312 is dense)."""
  found = chips.gpu_of(device_kind)
  assert (found.name, found.peak_bf16_flops) == (gpu, tflops * 1e12)
  assert found.source.startswith('https://www.nvidia.com/en-us/data-center/')


def test_unknown_devices_have_no_published_peak():
  for kind in ('NVIDIA GeForce RTX 4090', 'Tesla V100-SXM2-16GB', 'cpu', 'TPU v5 lite'):
    assert chips.gpu_of(kind) is None
