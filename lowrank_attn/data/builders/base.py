"""Shared plumbing of our TFDS builders: raw files from a local directory or the web."""

from __future__ import annotations

import dataclasses
import inspect
import os
import pathlib

from etils import epath
import tensorflow_datasets as tfds

from lowrank_attn.data import raw_files

VERSION = tfds.core.Version('1.0.0')


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
  """How a named data set is built and which features hold its text.

  Every builder module declares its names in a module-level `DATASETS = {name: DatasetSpec}`;
  `lowrank_attn.data.builders` collects them, so a new data set is one builder module.

  Attributes:
    builder_cls: our TFDS builder; None for an official TFDS dataset (looked up by name).
    config: builder config name, if any.
    text_feature: feature with the text of one document (lm/mlm); None for parallel corpora,
      where `source_lang` selects the side.
    languages: features of a parallel corpus, one per language (nmt).
    splits: the split names it may have.
  """

  builder_cls: type | None
  config: str | None = None
  text_feature: str | None = None
  languages: tuple[str, ...] = ()
  splits: tuple[str, ...] = ('train', 'validation', 'test')


class RawFileBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """A generator builder whose raw files come through `raw_files.fetch`.

  Datasets are written as ArrayRecord (readable by `as_data_source` without TensorFlow),
  with `disable_shuffling` so record i of a split is example i of the raw file: positions in
  tests and in `load_data_source` mean the same thing as line numbers upstream.
  """

  VERSION = VERSION

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:
    # TFDS's own lookup goes through `importlib_resources` (not installed) for packages
    # installed in editable mode; the file of the class is all it needs.
    return epath.Path(inspect.getfile(cls))

  def __init__(self, *, raw_data_dir: str | os.PathLike | None = None, **kwargs):
    """`raw_data_dir`: a directory laid out like ../shared/data; None → $LOWRANK_ATTN_DATA →
    download from the public URLs. Other arguments go to `tfds.core.DatasetBuilder`."""
    self._raw_data_dir = raw_data_dir
    kwargs.setdefault('file_format', 'array_record')
    super().__init__(**kwargs)

  def _dataset_info(self, *, description: str, features, homepage: str, citation: str = ''):
    return tfds.core.DatasetInfo(
        builder=self,
        description=description,
        features=features,
        homepage=homepage,
        citation=citation,
        disable_shuffling=True,
    )

  def _fetch_splits(
      self, split_files: dict[str, list[raw_files.RawFile]], dl_manager
  ) -> dict[str, list[pathlib.Path]]:
    """Verified paths per split; a split with a file missing from the local dir is skipped."""
    local_dir = raw_files.resolve_local_data_dir(self._raw_data_dir)
    download_dir = pathlib.Path(dl_manager.download_dir) / 'lowrank_attn'
    found = {}
    for split, files in split_files.items():
      paths = [raw_files.fetch(f, local_dir=local_dir, download_dir=download_dir) for f in files]
      missing = [f for f, p in zip(files, paths) if p is None]
      if missing:
        raw_files.warn_missing_split(self.name, split, missing[0], local_dir)
        continue
      found[split] = paths
    if not found:
      wanted = ', '.join(str(local_dir / f.relpath) for fs in split_files.values() for f in fs)
      raise FileNotFoundError(
          f'{self.name}: none of its raw files is in the local data directory {local_dir} '
          f'(looked for {wanted}). Point data.data_dir / ${raw_files.DATA_DIR_ENV} at a '
          'directory laid out like ../shared/data, or unset both to download.'
      )
    return found
