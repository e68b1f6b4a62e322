"""The task registry, and the promise it makes: nothing outside `lowrank_attn/tasks/` branches
on a task's name, so a task is one module, one builder and one config."""

import pathlib
import re

import numpy as np
import pytest

from lowrank_attn import tasks
from lowrank_attn.train import config as config_lib

PACKAGE = pathlib.Path(tasks.__file__).parents[1]
# `task == 'nmt'`, `config.task in ('lm', 'mlm')`, `{'nmt': ...}[task]`, `if self.task != 'lm'`.
_BRANCH = re.compile(
    r"""(task|\.name)\s*(==|!=|\bin\b|\bnot in\b)\s*[(\[{]?\s*['"](%s)['"]"""
    r"""|['"](%s)['"]\s*:.*\}\s*\[\s*[\w.]*task"""
)


def test_every_module_of_the_package_is_a_task_found_by_its_name():
  modules = sorted(
      p.stem
      for p in pathlib.Path(tasks.__file__).parent.glob('*.py')
      if p.stem not in ('__init__', 'base')
  )
  assert sorted(tasks.TASKS) == modules == ['glue', 'lm', 'mlm', 'nmt']
  for name, task in tasks.TASKS.items():
    assert task.name == name == task.data_format.name
  with pytest.raises(ValueError, match=r"task='seq2seq' is not one of \('glue', 'lm'"):
    tasks.get('seq2seq')


def test_no_code_outside_the_tasks_package_branches_on_a_task_name():
  names = '|'.join(tasks.TASKS)
  pattern = re.compile(_BRANCH.pattern % (names, names))
  assert pattern.search("if c.task == 'nmt':") and pattern.search("x = {'nmt': 1}[self.task]")
  offenders = []
  for path in sorted(PACKAGE.rglob('*.py')):
    if 'tasks' in path.relative_to(PACKAGE).parts:
      continue
    for number, line in enumerate(path.read_text().splitlines(), 1):
      if pattern.search(line.split('#')[0]):
        offenders.append(f'{path.relative_to(PACKAGE)}:{number}: {line.strip()}')
  assert not offenders, 'task-name branches outside lowrank_attn/tasks/:\n' + '\n'.join(offenders)


def test_a_task_adds_its_own_config_groups_and_only_those():
  assert 'decode' in config_lib.base_config('nmt') and 'glue' not in config_lib.base_config('nmt')
  assert 'glue' in config_lib.base_config('glue') and 'decode' not in config_lib.base_config('lm')
  config = config_lib.base_config('nmt')
  config.data.task = 'nmt'
  config.decode.beam_size = 0
  with pytest.raises(ValueError, match=r'config.decode: beam_size=0 is invalid'):
    config_lib.validate(config)


@pytest.mark.parametrize(
    'task, files, message',
    [
        ('lm', 'a.en:a.de', r"entry 'a.en:a.de' must be PATH"),
        ('nmt', 'a.en', r"entry 'a.en' must be SOURCE:TARGET"),
    ],
)
def test_extra_test_files_take_one_file_per_feature_of_the_task(task, files, message):
  config = config_lib.load(f'configs/{task}.py:tiny')
  config.data.extra_test_files = files
  with pytest.raises(ValueError, match=message):
    config_lib.validate(config)


def test_a_translation_config_with_one_language_is_refused():
  config = config_lib.load('configs/nmt.py:tiny')
  config.data.target_lang = config.data.source_lang
  with pytest.raises(ValueError, match=r'config.data: source_lang and target_lang are both'):
    config_lib.validate(config)


@pytest.mark.parametrize('task', ['lm', 'mlm'])
def test_packed_evaluation_announces_the_batches_it_yields(task, tmp_path):
  """`num_batches` (the format's `num_rows`: concat-then-split rows) is what a pass yields;
  every process relies on it to stop together."""
  pipeline = tasks.make_pipeline(
      {'name': 'tiny_shakespeare', 'task': task, 'tokenizer': 'char', 'max_length': 64},
      split='validation',
      seed=0,
      global_batch_size=8,
      train=False,
      workdir=tmp_path,
  )
  assert pipeline.num_batches == sum(1 for _ in pipeline) > 1


# ------------------------------------------------------------- unpacked rows, written by hand


def _unpacked_rows(task, documents, max_length):
  """The rows of `task`'s format for `documents`, one document per row (no packing)."""
  import grain
  from lowrank_attn import data
  from lowrank_attn.data import CharTokenizer

  tokenizer = CharTokenizer.train(['abcdefgh'])
  config = data.as_data_config(
      data.default_data_config(task=task, packing=False, max_length=max_length)
  )
  fmt = tasks.get(task).data_format
  encode = fmt.encoder(tokenizer, ('text',), config, truncate=True)
  ds = grain.MapDataset.source([{'text': d.encode()} for d in documents]).map(encode)
  rows = fmt.rows(ds, config, batch_size=1, train=True)
  return tokenizer, [rows[i] for i in range(len(documents))]


def test_unpacked_lm_rows_are_bos_text_and_text_eos_from_position_0():
  tok, (short, long) = _unpacked_rows('lm', ['abc', 'abcdefgh'], 6)
  a, b, c, d, e, f = tok.encode('abcdef')
  bos, eos = tok.bos_id, tok.eos_id
  want_short = {
      'inputs': [bos, a, b, c, 0, 0],
      'targets': [a, b, c, eos, 0, 0],
      'weights': [1, 1, 1, 1, 0, 0],
      'segment_ids': [1, 1, 1, 1, 0, 0],
      'positions': [0, 1, 2, 3, 0, 0],
  }
  # Cut to max_length: the first 6 next-token pairs, no EOS.
  want_long = {
      'inputs': [bos, a, b, c, d, e],
      'targets': [a, b, c, d, e, f],
      'weights': [1] * 6,
      'segment_ids': [1] * 6,
      'positions': [0, 1, 2, 3, 4, 5],
  }
  for row, want in ((short, want_short), (long, want_long)):
    assert set(row) == set(want)
    for key, value in want.items():
      np.testing.assert_array_equal(row[key], value, err_msg=key)


def test_unpacked_mlm_rows_are_cls_text_sep_from_position_0():
  tok, (short, long) = _unpacked_rows('mlm', ['abc', 'abcdefgh'], 6)
  a, b, c, d = tok.encode('abcd')
  bos, eos = tok.bos_id, tok.eos_id
  want_short = {
      'tokens': [bos, a, b, c, eos, 0],
      'segment_ids': [1, 1, 1, 1, 1, 0],
      'positions': [0, 1, 2, 3, 4, 0],
  }
  # Cut so that [CLS] text [SEP] fits: 4 text tokens.
  want_long = {
      'tokens': [bos, a, b, c, d, eos],
      'segment_ids': [1] * 6,
      'positions': [0, 1, 2, 3, 4, 5],
  }
  for row, want in ((short, want_short), (long, want_long)):
    assert set(row) == set(want)
    for key, value in want.items():
      np.testing.assert_array_equal(row[key], value, err_msg=key)
