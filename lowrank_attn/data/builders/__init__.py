"""Our TFDS builders, one module per raw data set. Importing this package imports every module
in it, which registers its builders with TFDS by name (`multi30k`, `shakespeare/tiny`, ...; so
`tfds.data_source(name, data_dir=..., builder_kwargs={'raw_data_dir': ...})` works too) and
collects the data set names each declares in its `DATASETS` into `DATASETS` here."""

import importlib
import pkgutil

from lowrank_attn.data.builders.base import DatasetSpec
from lowrank_attn.data.builders.multi30k import Multi30k, Multi30kCaptions
from lowrank_attn.data.builders.shakespeare import Shakespeare
from lowrank_attn.data.builders.ud_english_ewt import UdEnglishEwt, parse_conllu


def _collect() -> dict[str, DatasetSpec]:
  found = {}
  for module_info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if module_info.name == 'base':
      continue
    module = importlib.import_module(f'{__name__}.{module_info.name}')
    for name, spec in getattr(module, 'DATASETS', {}).items():
      if name in found:
        raise ValueError(f'data set {name!r} is declared by two builder modules.')
      found[name] = spec
  return found


DATASETS: dict[str, DatasetSpec] = _collect()

__all__ = [
    'DATASETS',
    'DatasetSpec',
    'Multi30k',
    'Multi30kCaptions',
    'Shakespeare',
    'UdEnglishEwt',
    'parse_conllu',
]
