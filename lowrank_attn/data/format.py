"""`RowFormat`: how a task turns raw examples into fixed-shape batches.

The pipeline (`pipeline.py`) is generic: it reads a split, shards, shuffles, encodes, filters,
turns examples into rows, batches and (optionally) finishes each batch. Every step that
depends on the task is a method of its `RowFormat`, which the task module owns
(`lowrank_attn.tasks.<name>`); the data package only holds the reusable steps
(`transforms.py`) they are built from. Callable objects rather than closures: grain worker
processes pickle them.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import math
from typing import NamedTuple

import grain
import numpy as np

from lowrank_attn.data.config import DataConfig


class ArraySpec(NamedTuple):
  shape: tuple[int, ...]
  dtype: np.dtype


@dataclasses.dataclass(frozen=True)
class FirstFitPacking:
  """Training rows the pipeline packs itself (`packing.py`): the split encoded once, each
  epoch's examples placed by first fit on their lengths, rows gathered by index.

  Attributes:
    keys: the encoded sequences of an example; each fills its own row array, and all of them
      get the example's segment id (segment k of one key belongs to segment k of the others).
    finish: a batch of packed rows (`key`, `key_segment_ids`, `key_positions` per key, int32
      [rows, max_length]) -> the keys of `row_spec`. Elementwise over rows; picklable.
  """

  keys: tuple[str, ...]
  finish: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


class RowFormat:
  """The task-specific steps of a pipeline. Subclasses override what differs.

  Attributes:
    name: the task's name (recorded in the pipeline state: a state resumes only the same format).
    token_keys: output name -> row key of each token array (`Pipeline.padding_fraction`).
  """

  name: str = ''
  token_keys: dict[str, str] = {'inputs': 'inputs'}

  def check_config(self, config: DataConfig) -> None:
    """Raises ValueError for data fields this task cannot use (named, with what is valid)."""

  def file_features(self, config: DataConfig, text_feature: str | None) -> tuple[str, ...]:
    """The features of local text files ('file:...' splits), one file per feature.

    `text_feature`: the data set's document feature, if it has one.
    """
    return (text_feature or config.source_lang,)

  def text_fields(self, config: DataConfig, text_feature: str | None) -> tuple[str, ...]:
    """The features that hold an example's text; also what a tokenizer is trained on."""
    return self.file_features(config, text_feature)

  def encoder(self, tokenizer, fields: tuple[str, ...], config: DataConfig, *, truncate: bool):
    """`example -> dict of 1-D numpy arrays` (variable length). `truncate`: cut to fit rows
    (evaluation reads every example once, whole or cut, never dropped)."""
    raise NotImplementedError

  def train_filter(self, config: DataConfig):
    """A predicate over encoded examples that training keeps (None: keep all)."""
    return None

  def packed(self, config: DataConfig, *, train: bool) -> bool:
    """Whether rows hold several examples."""
    return False

  def first_fit_packing(self, config: DataConfig, *, train: bool) -> FirstFitPacking | None:
    """How the pipeline packs rows of several whole examples itself; None: `rows` makes them."""
    return None

  def rows(
      self, ds: grain.IterDataset, config: DataConfig, *, batch_size: int, train: bool
  ) -> grain.IterDataset:
    """Encoded examples -> fixed-length rows with the keys of `row_spec` (unless
    `first_fit_packing` gives the rows)."""
    raise NotImplementedError

  def row_spec(self, config: DataConfig, *, train: bool) -> dict[str, ArraySpec]:
    """Shape (without the batch dimension) and dtype of every array of a row."""
    raise NotImplementedError

  def element_spec(
      self, config: DataConfig, *, batch_size: int, train: bool
  ) -> dict[str, ArraySpec]:
    """Shape and dtype of every array of a finished batch (after `finish_batch`)."""
    return {
        k: ArraySpec((batch_size, *v.shape), v.dtype)
        for k, v in self.row_spec(config, train=train).items()
    }

  def finish_batch(
      self, batch: dict[str, np.ndarray], *, tokenizer, config: DataConfig, rng: np.random.Generator
  ) -> dict[str, np.ndarray]:
    """A batch of rows -> the batch the model reads (e.g. masked-LM corruption)."""
    return batch

  def num_rows(self, examples, encode, config: DataConfig) -> int:
    """Rows one evaluation pass over `examples` (a sequence) gives (one per example)."""
    del encode, config
    return len(examples)


def concat_rows(examples, encode, key: str, max_length: int) -> int:
  """Rows that concat-then-split packing makes of `examples` (every row full but the last),
  counting the tokens of `encode(example)[key]`."""
  tokens = sum(len(encode(examples[i])[key]) for i in range(len(examples)))
  return math.ceil(tokens / max_length)
