"""Tokenizers: round trips on real text, special ids, caching and deterministic training."""

from etils import epath
import pytest

from lowrank_attn import data
from lowrank_attn.data import tokenizers

pytestmark = pytest.mark.filterwarnings('ignore::lowrank_attn.data.MissingSplitWarning')

ODD_TEXT = '  Two  spaces,\ttabs\nand lines — ünïcödé, 日本語, emoji 🎭 '


def _texts(name, split, feature, tfds_dir):
  source = data.load_data_source(name, split, tfds_data_dir=tfds_dir)
  return [example[feature].decode() for example in source.__getitems__(range(len(source)))]


@pytest.fixture(scope='module')
def multi30k_train(tfds_dir):
  return _texts('multi30k', 'train', 'en', tfds_dir) + _texts('multi30k', 'train', 'de', tfds_dir)


def test_char_tokenizer_round_trips_tiny_shakespeare(tfds_dir):
  tokenizer = tokenizers.CharTokenizer.train(_texts('tiny_shakespeare', 'train', 'text', tfds_dir))
  assert tokenizer.vocab_size == 5 + 65  # the 65 distinct characters of the corpus
  assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id, tokenizer.mask_id) == (0, 1, 2, 4)
  for text in _texts('tiny_shakespeare', 'validation', 'text', tfds_dir):
    ids = tokenizer.encode(text)
    assert len(ids) == len(text) and min(ids) >= tokenizer.first_regular_id
    assert tokenizer.decode(ids) == text
  assert tokenizer.decode(tokenizer.encode('Zé')) == 'Z\ufffd'  # unseen character → unk


# Unigram training prunes a large seed vocabulary, so a small vocabulary takes longer.
@pytest.mark.parametrize('model_type, vocab_size', [('unigram', 8000), ('bpe', 2000)])
def test_sentencepiece_round_trips_exactly(model_type, vocab_size, multi30k_train, tfds_dir):
  tokenizer = tokenizers.SentencePieceTokenizer.train(
      multi30k_train, vocab_size=vocab_size, model_type=model_type
  )
  assert tokenizer.vocab_size == vocab_size
  assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id, tokenizer.mask_id) == (0, 1, 2, 4)
  validation = _texts('multi30k', 'validation', 'en', tfds_dir) + _texts(
      'multi30k', 'validation', 'de', tfds_dir
  )
  for text in validation + [ODD_TEXT, '']:
    assert tokenizer.decode(tokenizer.encode(text)) == text
  ids = tokenizer.encode('A man in an orange hat.')
  assert len(ids) < len('A man in an orange hat.') / 2  # real subwords, not characters
  # decode reads model output: stops at eos, skips pad and bos.
  assert tokenizer.decode([tokenizer.bos_id, *ids, tokenizer.eos_id, *ids, 0, 0]) == (
      'A man in an orange hat.'
  )


def test_sentencepiece_training_is_deterministic_and_cached(tmp_path, multi30k_train):
  cache = tmp_path / 'spm.model'
  texts = multi30k_train[::6]  # a sixth of the corpus keeps the two trainings quick
  first = tokenizers.load_or_train(
      'sentencepiece', cache_path=cache, training_texts=iter(texts), vocab_size=4000
  )
  assert cache.read_bytes() == first.model_proto
  again = tokenizers.SentencePieceTokenizer.train(texts, vocab_size=4000)
  assert again.model_proto == first.model_proto
  # A second call loads the file and never touches the training texts.
  loaded = tokenizers.load_or_train('sentencepiece', cache_path=cache, training_texts=None)
  assert loaded.model_proto == first.model_proto


def test_wordpiece_matches_bert_uncased_and_round_trips_normalized_text():
  tokenizer = tokenizers.load_or_train('wordpiece', cache_path=None, training_texts=None)
  assert tokenizer.vocab_size == 30_522 and tokenizer.lowercase
  assert (
      tokenizer.pad_id,
      tokenizer.unk_id,
      tokenizer.bos_id,
      tokenizer.eos_id,
      tokenizer.mask_id,
  ) == (0, 100, 101, 102, 103)
  ids = tokenizer.encode('Hello, world! Unbelievable tokenization.')
  assert ids == [7592, 1010, 2088, 999, 23653, 19204, 3989, 1012]
  assert tokenizer.decode([101, *ids, 102, 0]) == 'hello, world! unbelievable tokenization.'
  for text in [
      'a man in an orange hat starring at something.',
      'two young, white males are outside near many bushes.',
  ]:
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_wordpiece_rejects_a_vocabulary_that_is_not_bert(tmp_path):
  vocab = tmp_path / 'vocab.txt'
  vocab.write_text('hello\nworld\n')
  with pytest.raises(ValueError, match='not a BERT vocabulary'):
    tokenizers.WordPieceTokenizer(vocab)
  with pytest.raises(FileNotFoundError, match='data.vocab_path'):
    tokenizers.WordPieceTokenizer(tmp_path / 'missing.txt')


def test_unknown_tokenizer_kind_is_named():
  with pytest.raises(ValueError, match=r"data.tokenizer='bytes'; valid: \('char', 'sentencepiece'"):
    tokenizers.load_or_train('bytes', cache_path=None, training_texts=[])


def test_an_interrupted_tokenizer_write_leaves_no_file_behind(tmp_path, monkeypatch):
  cache = tmp_path / 'tokenizers' / 'char.json'
  path_type = type(epath.Path(cache))
  write_bytes = path_type.write_bytes

  def crash_halfway(self, content):
    write_bytes(self, content[: len(content) // 2])
    raise OSError('disk full')

  monkeypatch.setattr(path_type, 'write_bytes', crash_halfway)
  with pytest.raises(OSError, match='disk full'):
    tokenizers.load_or_train('char', cache_path=cache, training_texts=['abc'])
  assert not list(cache.parent.iterdir())  # neither half a vocabulary nor a temporary file
  monkeypatch.undo()
  # So the next run trains again instead of loading half a file.
  assert tokenizers.load_or_train('char', cache_path=cache, training_texts=['abc']).chars == 'abc'
  assert tokenizers.CharTokenizer.from_bytes(cache.read_bytes()).chars == 'abc'


def test_sentencepiece_first_regular_id_follows_the_reserved_and_byte_pieces():
  """Read from the trained model's pieces, not from our constants: every id below
  `first_regular_id` is a control, unknown, [MASK] or byte piece, every id from it on a
  piece of text (what masked-LM corruption may draw)."""
  import re
  import numpy as np

  rng = np.random.default_rng(0)
  words = [''.join(rng.choice(list('abcdefghij'), rng.integers(2, 7))) for _ in range(60)]
  texts = [' '.join(rng.choice(words, 12)) for _ in range(400)]
  tokenizer = tokenizers.SentencePieceTokenizer.train(texts, vocab_size=320, model_type='bpe')
  processor = tokenizer._processor
  byte = re.compile(r'<0x[0-9A-F]{2}>')
  special = [
      processor.is_control(i)
      or processor.is_unknown(i)
      or processor.id_to_piece(i) == tokenizers.MASK_TOKEN
      or (processor.is_byte(i) and byte.fullmatch(processor.id_to_piece(i)))
      for i in range(tokenizer.vocab_size)
  ]
  first = special.index(False)
  assert not any(special[first:])  # the specials come first, all of them
  assert sum(bool(processor.is_byte(i)) for i in range(first)) == 256
  assert tokenizer.first_regular_id == first
  # And text encodes into regular pieces only.
  assert min(tokenizer.encode(texts[0])) >= first
