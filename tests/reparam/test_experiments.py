"""The collaborative experiments' own logic: the retrieval metric on a hand-built case, the
caption files' checks, and the from-scratch grid's configs (concat heads keep frozen mixing)."""

import gzip

import numpy as np
import pytest

from experiments.collaborative import from_scratch, reparametrize_minilm
from lowrank_attn.runs import with_overrides
from lowrank_attn.train import config as config_lib, state as state_lib


def test_retrieval_metrics_on_three_images():
  """Files 0-3 describe image i by e_i; file 4 swaps the captions of images 0 and 1.

  Between files 0-3 (12 ordered pairs) every query ranks first. From or to file 4 (8 pairs)
  images 0 and 1 rank second (one wrong caption scores 1 > 0; the tie with image 2's caption
  at 0 does not count against them), image 2 first: recall 1/3, MRR (1/2 + 1/2 + 1) / 3.
  """
  identity = np.eye(3)
  files = [identity] * 4 + [identity[[1, 0, 2]]]
  metrics = reparametrize_minilm.retrieval_metrics(files)
  assert metrics['recall_at_1'] == pytest.approx((12 + 8 / 3) / 20)
  assert metrics['mrr'] == pytest.approx((12 + 8 * 2 / 3) / 20)


def write_captions(directory, lengths):
  paths = []
  for i, length in enumerate(lengths):
    path = directory / f'captions.{i}.en.gz'
    with gzip.open(path, 'wt') as f:
      f.writelines(f'caption {j} of file {i}\n' for j in range(length))
    paths.append(str(path))
  return paths


def test_caption_files_are_checked(tmp_path):
  captions = reparametrize_minilm.read_captions(write_captions(tmp_path, [3] * 5))
  assert captions[4][2] == 'caption 2 of file 4'
  with pytest.raises(ValueError, match='needs 5 files.*got 4'):
    reparametrize_minilm.read_captions(write_captions(tmp_path, [3] * 4))
  with pytest.raises(ValueError, match=r'the same number each; got .*: 2'):
    reparametrize_minilm.read_captions(write_captions(tmp_path, [3, 3, 2, 3, 3]))


def test_from_scratch_configs():
  base = from_scratch.load_config('configs/nmt.py:multi30k')
  concat = from_scratch.training_fields('concat', 256, 256, 600)
  assert not any(k.startswith('model.attention') for k in concat)  # the baseline layer
  narrow = {
      kind: with_overrides(base, from_scratch.training_fields(kind, 64, 256, 600))
      for kind in from_scratch.KINDS
  }
  for kind, config in narrow.items():
    config_lib.validate(config)
    spec = config_lib.model_config(config, 100).attention('cross', 0)
    assert (spec.kind, spec.key_dim, spec.head_dim) == ('collaborative', 64, 32)
    assert spec.logit_scale == pytest.approx(1 / np.sqrt(64 / 8))
  assert narrow['concat'].model.attention.mixing_init == 'concatenate'
  assert narrow['collaborative'].model.attention.mixing_init == 'random'
  # Concat heads: only the mixing is frozen.
  params = {
      'encoder': {'layers': {0: {'self_attention': {'mixing': 0, 'query_kernel': 0}}}},
      'tokens': {'embed': {'embedding': 0}},
  }
  labels = state_lib.trainable_labels(params, narrow['concat'].trainable)
  assert labels['encoder']['layers'][0]['self_attention'] == {
      'mixing': 'frozen',
      'query_kernel': 'train',
  }
  assert labels['tokens']['embed']['embedding'] == 'train'
  assert narrow['collaborative'].trainable is None
