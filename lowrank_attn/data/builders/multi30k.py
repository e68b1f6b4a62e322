"""Multi30k (Elliott et al. 2016): English–German image captions, raw text.

`multi30k`: task 1 translation pairs, splits train 29,000 / validation 1,014 /
test 1,000 (`test_2016_flickr`); features `en`, `de`.

`multi30k_captions`: task 2 test 2016, five independent English captions of each of the
1,000 test images; split `test` only; features `image_index`, `captions` (5 strings). Two
captions of the same image are paraphrases, which makes a retrieval test for sentence
encoders.
"""

from __future__ import annotations

import gzip

import numpy as np
import tensorflow_datasets as tfds

from lowrank_attn.data import raw_files
from lowrank_attn.data.builders import base

_HOMEPAGE = 'https://github.com/multi30k/dataset'
_CITATION = """@inproceedings{elliott-etal-2016-multi30k,
  title = {Multi30K: Multilingual English-German Image Descriptions},
  author = {Elliott, Desmond and Frank, Stella and Sima'an, Khalil and Specia, Lucia},
  booktitle = {Proceedings of the 5th Workshop on Vision and Language},
  year = {2016}, pages = {70--74}}"""

# Our split name → upstream file stem.
_TASK1_SPLITS = {'train': 'train', 'validation': 'val', 'test': 'test_2016_flickr'}
NUM_CAPTIONS = 5


def _read_lines(path) -> list[str]:
  with gzip.open(path, 'rt', encoding='utf-8') as f:
    # Upstream files end with a newline; a trailing empty string is not an example.
    return f.read().removesuffix('\n').split('\n')


class Multi30k(base.RawFileBuilder):
  """Multi30k task 1, English–German translation pairs (raw, untokenized)."""

  name = 'multi30k'

  def _info(self):
    return self._dataset_info(
        description='Multi30k task 1: English-German image caption translations, raw text.',
        features=tfds.features.FeaturesDict(
            {'en': tfds.features.Text(), 'de': tfds.features.Text()}
        ),
        homepage=_HOMEPAGE,
        citation=_CITATION,
    )

  def _split_generators(self, dl_manager):
    split_files = {
        split: [raw_files.multi30k_file(f'{stem}.{lang}.gz') for lang in ('en', 'de')]
        for split, stem in _TASK1_SPLITS.items()
    }
    found = self._fetch_splits(split_files, dl_manager)
    return {split: self._generate_examples(*paths) for split, paths in found.items()}

  def _generate_examples(self, en_path, de_path):
    english, german = _read_lines(en_path), _read_lines(de_path)
    if len(english) != len(german):
      raise ValueError(
          f'{en_path} has {len(english)} lines but {de_path} has {len(german)}; line i of '
          'one must translate line i of the other.'
      )
    for i, (en, de) in enumerate(zip(english, german)):
      yield i, {'en': en, 'de': de}


class Multi30kCaptions(base.RawFileBuilder):
  """Multi30k task 2 test 2016: five independent English captions per image."""

  name = 'multi30k_captions'

  def _info(self):
    return self._dataset_info(
        description=(
            'Multi30k task 2, test 2016: five independent English captions for each of the '
            '1,000 test images (paraphrase retrieval for sentence encoders).'
        ),
        features=tfds.features.FeaturesDict(
            {
                'image_index': np.int32,
                'captions': tfds.features.Tensor(shape=(NUM_CAPTIONS,), dtype=np.str_),
            }
        ),
        homepage=_HOMEPAGE,
        citation=_CITATION,
    )

  def _split_generators(self, dl_manager):
    files = [
        raw_files.multi30k_file(f'task2/test_2016.{i}.en.gz') for i in range(1, NUM_CAPTIONS + 1)
    ]
    found = self._fetch_splits({'test': files}, dl_manager)
    return {split: self._generate_examples(paths) for split, paths in found.items()}

  def _generate_examples(self, paths):
    per_file = [_read_lines(p) for p in paths]
    lengths = {len(lines) for lines in per_file}
    if len(lengths) != 1:
      raise ValueError(f'Caption files {paths} differ in length: {lengths}.')
    for i, captions in enumerate(zip(*per_file)):
      yield i, {'image_index': i, 'captions': list(captions)}


DATASETS = {
    'multi30k': base.DatasetSpec(Multi30k, languages=('en', 'de')),
    'multi30k_captions': base.DatasetSpec(Multi30kCaptions, splits=('test',)),
}
