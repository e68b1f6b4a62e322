"""lowrank_attn/chips.py: the TPU chip table and gcloud's accelerator types."""

import pytest

from lowrank_attn import chips


@pytest.mark.parametrize('accelerator_type, chip, num_chips, num_hosts', [
    ('v4-8', 'v4', 4, 1), ('v4-32', 'v4', 16, 4), ('v5litepod-16', 'v5e', 16, 4),
    ('v5e-8', 'v5e', 8, 1), ('v5p-32', 'v5p', 16, 4), ('v6e-8', 'v6e', 8, 1),
    ('v6e-16', 'v6e', 16, 4)])
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
