"""`python -m lowrank_attn.translate`: bad input is one line and exit status 2, found before
anything is translated. On a run directory that looks finished but holds no arrays, so each
test shows its check comes before the model is needed (tests/train/test_translate.py trains a
real run)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from lowrank_attn import runs, translate
from lowrank_attn.train import config as config_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
READ_ONLY_DIR = '/sys/kernel'  # read-only to every user, root included


@pytest.fixture
def fake_run(tmp_path):
  """A translation run's config.json and an (empty) checkpoint of step 10."""
  workdir = tmp_path / 'run'
  os.makedirs(workdir / runs.CHECKPOINT_DIR / '10')
  config = config_lib.load(f'{ROOT}/configs/nmt.py:tiny')
  (workdir / runs.CONFIG_FILE).write_text(json.dumps(config_lib.to_dict(config)))
  source = tmp_path / 'in.en'
  source.write_text('A man sleeps.\n')
  return str(workdir), str(source)


@pytest.mark.parametrize(
    'output, says',
    [
        ('{tmp}', r'--output=.* is a directory; name a file'),
        (
            f'{READ_ONLY_DIR}/out.de',
            rf'--output={READ_ONLY_DIR}/out\.de: cannot write in '
            f'{READ_ONLY_DIR}: Permission denied',
        ),
        ('{tmp}/no/such/dir/out.de', r'--output=.*: no directory .*/no/such/dir'),
    ],
)
def test_a_bad_output_is_refused_before_translating(fake_run, tmp_path, monkeypatch, output, says):
  workdir, source = fake_run
  # Reaching the run's config means the output was accepted.
  monkeypatch.setattr(translate, 'run_config', lambda _: pytest.fail('went on to translate'))
  with pytest.raises(translate.UsageError, match=says):
    translate.translate_file(
        workdir, input_path=source, output_path=output.format(tmp=tmp_path), compilation_cache=''
    )


@pytest.mark.parametrize(
    'text, says',
    [
        ('{"task": "nmt", garbage', 'Expecting property name'),
        ('\x80\x81 binary', "can't decode"),
        ('[1, 2]', r'a config is a mapping of fields \(a JSON object\), not a list'),
        ('{"task": ["nmt"]}', r"config task=\['nmt'\] is not one of"),
        ('{"task": "nmt", "model": 5}', r'config\.model=5 is invalid: expected a group of fields'),
        (
            '{"task": "nmt", "model": {"emb_dim": "wide"}}',
            r"config\.model\.emb_dim='wide' is invalid",
        ),
        ('{"task": "nmt", "seed": {"a": 1}}', r"config\.seed=\{'a': 1\} is invalid"),
        ('{"task": "nmt", "modle": {}}', r'config\.modle is not a field of this schema'),
    ],
)
def test_a_garbage_config_json_is_one_line(fake_run, text, says):
  workdir, _ = fake_run
  with open(os.path.join(workdir, runs.CONFIG_FILE), 'w', encoding='latin-1') as f:
    f.write(text)
  with pytest.raises(translate.UsageError, match=says) as raised:
    translate.run_config(workdir)
  assert str(raised.value).startswith(f'{workdir}/config.json: ')
  assert '\n' not in str(raised.value)


@pytest.mark.integration
def test_the_command_refuses_a_directory_output_at_once(fake_run, tmp_path):
  workdir, source = fake_run
  done = subprocess.run(
      [
          sys.executable,
          '-m',
          'lowrank_attn.translate',
          f'--workdir={workdir}',
          f'--input={source}',
          f'--output={tmp_path}',
      ],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert done.returncode == 2, done.stderr
  assert done.stderr == (
      f'translate: --output={tmp_path} is a directory; name a file (in it, ' 'say).\n'
  )
