"""Accelerators' published peaks: Cloud TPU chips (memory, peak bf16 FLOP/s, how gcloud names
their slices) and NVIDIA data-centre GPUs (peak dense bf16 FLOP/s).

    chip = chips.chip_of(jax.devices()[0].device_kind)   # 'TPU v5 lite' -> CHIPS['v5e']
    slice_ = chips.parse_accelerator_type('v5litepod-16')  # 16 chips on 4 hosts
    gpu = chips.gpu_of('NVIDIA H100 80GB HBM3')           # GPUS['h100_sxm']

Peak, memory and memory bandwidth per chip are Google's published figures (the `source` of
each entry: the "Peak compute per chip (bf16)", HBM capacity and HBM bandwidth rows of the
Cloud TPU system-architecture pages, read 2025). HBM is stored in GiB: the pages write "GB",
and a chip's HBM is a power of two GiB, except v5p's 95. These peaks are what MFU divides by
on TPU (`lowrank_attn.train.metrics`); the scripts of tpu/ (launch, AOT compile) read the
slice names and HBM from here too. GPU peaks are NVIDIA's datasheet figures for dense bf16
Tensor Core math (the datasheets print "with sparsity" figures, twice these). A device in
neither table has no published peak here: the training loop then prints achieved FLOP/s and
no MFU. Plain Python, no JAX: importing it costs nothing.
"""

import dataclasses
import re

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
  name: str  # our short name: 'v4', 'v5e', 'v5p', 'v6e'
  hbm_bytes: int  # per chip
  peak_bf16_flops: float  # per chip, dense matrix units
  hbm_bytes_per_sec: float  # per chip: the roofline of a memory-bound step (tpu/compile.py)
  cores_per_chip: int  # TensorCores; v4/v5p accelerator types count cores, v5e/v6e chips
  chips_per_host: int  # in a multi-host slice (one TPU VM per host)
  max_single_host_chips: int  # the largest slice on one VM
  accelerator_prefix: str  # gcloud --accelerator-type is '<prefix>-<count>'
  runtime_version: str  # gcloud --version / --runtime-version for JAX on this chip
  device_kinds: tuple[str, ...]  # jax Device.device_kind strings
  source: str
  chip_counts: tuple[int, ...] | None = None  # the slice sizes there are, if a short list


CHIPS = {
    'v4': Chip(
        'v4',
        32 * GIB,
        275e12,
        hbm_bytes_per_sec=1200e9,
        cores_per_chip=2,
        chips_per_host=4,
        max_single_host_chips=4,
        accelerator_prefix='v4',
        runtime_version='tpu-ubuntu2204-base',
        device_kinds=('TPU v4',),
        source='https://cloud.google.com/tpu/docs/v4',
    ),
    'v5e': Chip(
        'v5e',
        16 * GIB,
        197e12,
        hbm_bytes_per_sec=819e9,
        cores_per_chip=1,
        chips_per_host=4,
        max_single_host_chips=8,
        accelerator_prefix='v5litepod',
        runtime_version='v2-alpha-tpuv5-lite',
        device_kinds=('TPU v5 lite', 'TPU v5e'),
        source='https://cloud.google.com/tpu/docs/v5e',
        chip_counts=(1, 4, 8, 16, 32, 64, 128, 256),
    ),
    'v5p': Chip(
        'v5p',
        95 * GIB,
        459e12,
        hbm_bytes_per_sec=2765e9,
        cores_per_chip=2,
        chips_per_host=4,
        max_single_host_chips=4,
        accelerator_prefix='v5p',
        runtime_version='v2-alpha-tpuv5',
        device_kinds=('TPU v5', 'TPU v5p'),
        source='https://cloud.google.com/tpu/docs/v5p',
    ),
    'v6e': Chip(
        'v6e',
        32 * GIB,
        918e12,
        hbm_bytes_per_sec=1640e9,
        cores_per_chip=1,
        chips_per_host=4,
        max_single_host_chips=8,
        accelerator_prefix='v6e',
        runtime_version='v2-alpha-tpuv6e',
        device_kinds=('TPU v6 lite', 'TPU v6e'),
        source='https://cloud.google.com/tpu/docs/v6e',
        chip_counts=(1, 4, 8, 16, 32, 64, 128, 256),
    ),
}
# What people write for the v5e prefix.
_PREFIX_ALIASES = {'v5e': 'v5litepod', 'v5lite': 'v5litepod', 'v6litepod': 'v6e'}


def chip_of(device_kind: str) -> Chip | None:
  """The chip of a jax `Device.device_kind` ('TPU v4', 'TPU v5 lite', ...), or None."""
  for chip in CHIPS.values():
    if device_kind in chip.device_kinds:
      return chip
  return None


@dataclasses.dataclass(frozen=True)
class Slice:
  accelerator_type: str  # as gcloud spells it, e.g. 'v5litepod-16'
  chip: Chip
  num_chips: int
  num_hosts: int  # TPU VM workers: what `--worker=all` reaches


def parse_accelerator_type(accelerator_type: str) -> Slice:
  """'v4-32' -> 16 v4 chips on 4 hosts; 'v5e-16' or 'v5litepod-16' -> 16 chips on 4 hosts."""
  match = re.fullmatch(r'(v\d+[a-z]*)-(\d+)', accelerator_type.strip())
  prefixes = {chip.accelerator_prefix: chip for chip in CHIPS.values()}
  prefix = match and _PREFIX_ALIASES.get(match.group(1), match.group(1))
  if not match or prefix not in prefixes:
    valid = ', '.join(f'{p}-N' for p in prefixes)
    raise ValueError(
        f'accelerator type {accelerator_type!r} is not one of {valid} '
        "(e.g. 'v4-8', 'v5litepod-16', 'v5p-32', 'v6e-8')."
    )
  chip, count = prefixes[prefix], int(match.group(2))
  if count % chip.cores_per_chip:
    raise ValueError(
        f'{accelerator_type!r}: {chip.name} types count TensorCores, '
        f'{chip.cores_per_chip} per chip; use a multiple of {chip.cores_per_chip}.'
    )
  num_chips = count // chip.cores_per_chip
  if chip.chip_counts and num_chips not in chip.chip_counts:
    raise ValueError(
        f'{accelerator_type!r}: {chip.name} slices have '
        f"{', '.join(map(str, chip.chip_counts))} chips."
    )
  if num_chips <= chip.max_single_host_chips:
    num_hosts = 1
  elif num_chips % chip.chips_per_host:
    raise ValueError(
        f'{accelerator_type!r}: a multi-host {chip.name} slice has a multiple of '
        f'{chip.chips_per_host} chips.'
    )
  else:
    num_hosts = num_chips // chip.chips_per_host
  return Slice(f'{prefix}-{count}', chip, num_chips, num_hosts)


# ------------------------------------------------------------------------------ GPUs


@dataclasses.dataclass(frozen=True)
class Gpu:
  name: str  # our short name: 'h100_sxm', 'a100', ...
  peak_bf16_flops: float  # dense bf16 Tensor Core FLOP/s (the datasheet's sparse figure / 2)
  device_kind: str  # regular expression over jax's `Device.device_kind` (the CUDA name)
  source: str


GPUS = {
    'h100_sxm': Gpu(
        'h100_sxm',
        989.5e12,
        r'H100 (80GB HBM3|SXM)',
        'https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM: BF16 Tensor '
        'Core 1,979 TFLOPS with sparsity)',
    ),
    'h100_pcie': Gpu(
        'h100_pcie',
        756.5e12,
        r'H100 PCIe',
        'https://www.nvidia.com/en-us/data-center/h100/ (H100 PCIe: BF16 Tensor '
        'Core 1,513 TFLOPS with sparsity)',
    ),
    'h100_nvl': Gpu(
        'h100_nvl',
        835.5e12,
        r'H100 NVL',
        'https://www.nvidia.com/en-us/data-center/h100/ (H100 NVL: BF16 Tensor '
        'Core 1,671 TFLOPS with sparsity)',
    ),
    'h200_sxm': Gpu(
        'h200_sxm',
        989.5e12,
        r'H200(?! NVL)',
        'https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM: BF16 Tensor '
        'Core 1,979 TFLOPS with sparsity)',
    ),
    'h200_nvl': Gpu(
        'h200_nvl',
        835.5e12,
        r'H200 NVL',
        'https://www.nvidia.com/en-us/data-center/h200/ (H200 NVL: BF16 Tensor '
        'Core 1,671 TFLOPS with sparsity)',
    ),
    'a100': Gpu(
        'a100',
        312e12,
        r'A100',  # SXM and PCIe, 40 and 80 GB
        'https://www.nvidia.com/en-us/data-center/a100/ (A100: BF16 Tensor Core '
        '312 TFLOPS, 624 with sparsity)',
    ),
}


def gpu_of(device_kind: str) -> Gpu | None:
  """The GPU of a jax `Device.device_kind` ('NVIDIA H100 80GB HBM3', 'NVIDIA A100-SXM4-40GB',
  ...), or None for one not in `GPUS`."""
  for gpu in GPUS.values():
    if re.search(gpu.device_kind, device_kind):
      return gpu
  return None
