"""Universal Dependencies English Web Treebank (CoNLL-U, gold heads and relations).

Splits: `train` (12.5k sentences; only from the URL, skipped with a warning when a local
directory without it is used), `validation` (upstream `dev`, 2,001), `test` (2,077).

Each example is one sentence of syntactic words: multiword-token lines (`3-4`) and empty
nodes of the enhanced graph (`8.1`) are dropped, so `heads[i]` is the 1-based index of word
i's head in `tokens` (0 for the root) and the heads form a tree.
"""

from __future__ import annotations

from collections.abc import Iterator
import dataclasses

import numpy as np
import tensorflow_datasets as tfds

from lowrank_attn.data import raw_files
from lowrank_attn.data.builders import base

_SPLIT_FILES = {'train': 'train', 'validation': 'dev', 'test': 'test'}
_CITATION = """@inproceedings{silveira14gold,
  title = {A Gold Standard Dependency Corpus for {E}nglish},
  author = {Silveira, Natalia and Dozat, Timothy and de Marneffe, Marie-Catherine and Bowman,
            Samuel and Connor, Miriam and Bauer, John and Manning, Christopher D.},
  booktitle = {Proceedings of LREC 2014}, year = {2014}}"""


@dataclasses.dataclass
class Sentence:
  sent_id: str
  text: str
  tokens: list[str]
  lemmas: list[str]
  upos: list[str]
  xpos: list[str]
  heads: list[int]
  deprels: list[str]


def parse_conllu(path) -> Iterator[Sentence]:
  """Yields the sentences of a CoNLL-U file (basic dependencies only)."""
  with open(path, encoding='utf-8') as f:
    lines = f.read().split('\n')
  comments: dict[str, str] = {}
  words: list[list[str]] = []
  for line_number, line in enumerate(lines, 1):
    if line.startswith('#'):
      key, sep, value = line[1:].partition('=')
      if sep:
        comments[key.strip()] = value.strip()
    elif line.strip():
      columns = line.split('\t')
      if len(columns) != 10:
        raise ValueError(f'{path}:{line_number}: expected 10 tab-separated columns, got {line!r}')
      if columns[0].isdigit():  # skip multiword tokens "3-4" and empty nodes "8.1"
        words.append(columns)
    elif words:
      yield _make_sentence(path, line_number, comments, words)
      comments, words = {}, []
  if words:
    yield _make_sentence(path, len(lines), comments, words)


def _make_sentence(path, line_number, comments, words) -> Sentence:
  ids = [int(w[0]) for w in words]
  if ids != list(range(1, len(words) + 1)):
    raise ValueError(f'{path}: sentence ending at line {line_number} has word ids {ids}')
  heads = [int(w[6]) for w in words]
  if any(not 0 <= h <= len(words) for h in heads):
    raise ValueError(f'{path}: sentence ending at line {line_number} has heads {heads}')
  return Sentence(
      sent_id=comments.get('sent_id', ''),
      text=comments.get('text', ' '.join(w[1] for w in words)),
      tokens=[w[1] for w in words],
      lemmas=[w[2] for w in words],
      upos=[w[3] for w in words],
      xpos=[w[4] for w in words],
      heads=heads,
      deprels=[w[7] for w in words],
  )


class UdEnglishEwt(base.RawFileBuilder):
  """UD English-EWT with gold basic dependencies, one example per sentence."""

  name = 'ud_english_ewt'

  def _info(self):
    strings = tfds.features.Tensor(shape=(None,), dtype=np.str_)
    return self._dataset_info(
        description=(
            'Universal Dependencies English Web Treebank: sentences with gold tokens, lemmas, '
            'POS tags, heads (1-based, 0 = root) and dependency relations.'
        ),
        features=tfds.features.FeaturesDict(
            {
                'sent_id': tfds.features.Text(),
                'text': tfds.features.Text(),
                'tokens': strings,
                'lemmas': strings,
                'upos': strings,
                'xpos': strings,
                'heads': tfds.features.Tensor(shape=(None,), dtype=np.int32),
                'deprels': strings,
            }
        ),
        homepage='https://github.com/UniversalDependencies/UD_English-EWT',
        citation=_CITATION,
    )

  def _split_generators(self, dl_manager):
    split_files = {
        split: [raw_files.ud_english_ewt_file(stem)] for split, stem in _SPLIT_FILES.items()
    }
    found = self._fetch_splits(split_files, dl_manager)
    return {split: self._generate_examples(paths[0]) for split, paths in found.items()}

  def _generate_examples(self, path):
    for i, sentence in enumerate(parse_conllu(path)):
      yield i, dataclasses.asdict(sentence)


DATASETS = {'ud_english_ewt': base.DatasetSpec(UdEnglishEwt, text_feature='text')}
