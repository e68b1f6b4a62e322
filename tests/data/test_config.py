"""The data config: one dataclass, the ConfigDict derived from it, validation that names fields."""

import dataclasses

import pytest

from lowrank_attn import data


def test_the_config_dict_holds_every_field_at_its_default():
  config = data.default_data_config()
  defaults = {f.name: f.default for f in dataclasses.fields(data.DataConfig)}
  assert {k: config[k] for k in config.keys()} == defaults
  assert data.as_data_config(config) == data.DataConfig()


def test_overrides_from_code_and_command_line_reach_the_dataclass():
  config = data.default_data_config(task='nmt', packing=False)
  config.data_dir = '/raw'  # typed placeholder: a string where the default is None
  config.max_length = 32
  assert data.as_data_config(config) == data.DataConfig(
      task='nmt', packing=False, data_dir='/raw', max_length=32
  )
  with pytest.raises(TypeError):
    config.max_length = 'long'
  # A plain dict may leave fields out: they take their defaults.
  assert data.as_data_config({'task': 'mlm'}) == data.DataConfig(task='mlm')
  assert data.as_data_config(data.DataConfig(task='mlm')) == data.DataConfig(task='mlm')


@pytest.mark.parametrize(
    'values, message',
    [
        (dict(task=''), r"task='' must be a non-empty string"),
        (dict(tokenizer='bytes'), r"tokenizer='bytes' is not one of \('char', 'sentencepiece'"),
        (dict(sentencepiece_model_type='char'), r"sentencepiece_model_type='char' is not one of"),
        (dict(max_length=1), r'max_length=1 must be an int >= 2'),
        (dict(num_workers=True), r'num_workers=True must be an int >= 0'),
        (dict(max_length=64.0), r'max_length=64.0 must be an int >= 2'),
        (dict(num_workers=-1), r'num_workers=-1 must be an int >= 0'),
        (dict(tokenizer_max_corpus_chars=0), r'tokenizer_max_corpus_chars=0 must be an int >= 1'),
        (dict(tokenizer='sentencepiece', vocab_size=261), r'vocab_size=261 is too small'),
        (dict(mlm_probability=1.0), r'mlm_probability=1.0 must be in \(0, 1\)'),
        (dict(packing='yes'), r"packing='yes' must be True or False"),
        (dict(name=''), r"name='' must be a non-empty string"),
        (dict(name='multi30k_captions'), r"name='multi30k_captions' is a retrieval test set"),
        (dict(data_dir=3), r'data_dir=3 must be a path or None'),
        (
            dict(task='nmt', extra_test_files='a.en:a.de:a.fr'),
            r"extra_test_files='a.en:a.de:a.fr': entry 'a.en:a.de:a.fr' must be PATH or SOURCE:TARGET",
        ),
        (
            dict(extra_test_files='a.en:'),
            r"extra_test_files='a.en:': entry 'a.en:' must be PATH or SOURCE:TARGET",
        ),
        (
            dict(task='nmt', extra_test_files='x/a.en:a.de,y/a.en.gz:a.de'),
            r"extra_test_files='x/a.en:a.de,y/a.en.gz:a.de': two entries are named 'a'",
        ),
    ],
)
def test_invalid_values_name_the_field_the_value_and_what_is_valid(values, message):
  with pytest.raises(ValueError, match='^config.data: ' + message):
    data.as_data_config(values)
  with pytest.raises(ValueError, match='^config.data: ' + message):
    data.default_data_config(**values)


def test_unknown_fields_are_refused_with_the_valid_ones():
  message = r"config.data has unknown fields \['max_len'\]; valid: .*'max_length'"
  with pytest.raises(ValueError, match=message):
    data.as_data_config({'max_len': 32})


def test_extra_test_files_are_named_after_their_first_file():
  config = data.DataConfig(
      task='nmt', extra_test_files='x/test_2017_flickr.en.gz:x/test_2017_flickr.de.gz, b.en:b.de'
  )
  assert config.extra_test_splits(num_files=2) == {
      'test_2017_flickr': 'file:x/test_2017_flickr.en.gz:x/test_2017_flickr.de.gz',
      'b': 'file:b.en:b.de',
  }
  assert data.DataConfig(extra_test_files='poems.txt').extra_test_splits(num_files=1) == {
      'poems': 'file:poems.txt'
  }
  assert data.DataConfig().extra_test_splits(num_files=1) == {}
