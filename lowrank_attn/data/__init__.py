"""Real text data: TFDS builders (ArrayRecord, no TensorFlow), tokenizers, grain pipelines.

The only package that imports tensorflow_datasets and grain.

    from lowrank_attn import data
    pipeline = data.make_pipeline(config.data, format=task.data_format, split='train', seed=0,
                                  global_batch_size=64, train=True, workdir=workdir)
    source = data.load_data_source('ud_english_ewt', 'validation')   # raw examples

Layout: `config.py` (the `DataConfig` schema), `datasets.py` (data sets by name, local text
files), `builders/` (our TFDS builders), `raw_files.py` (where raw files come from, their
checksums), `tokenizers.py`, `transforms.py` (per-example steps), `format.py` (`RowFormat`: the
steps a task chooses), `packing.py` (packed training rows from examples encoded once),
`pipeline.py` (`Pipeline`).
"""

from lowrank_attn.data.config import (
    DataConfig,
    as_data_config,
    default_data_config,
)
from lowrank_attn.data.datasets import (
    DATASETS,
    OFFICIAL_DATASETS,
    TextFiles,
    default_tfds_data_dir,
    load_builder,
    load_data_source,
    load_text_files,
)
from lowrank_attn.data.format import ArraySpec, FirstFitPacking, RowFormat
from lowrank_attn.data.pipeline import Pipeline, load_tokenizer, make_pipeline
from lowrank_attn.data.raw_files import DATA_DIR_ENV, MissingSplitWarning
from lowrank_attn.data.tokenizers import (
    CharTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    WordPieceTokenizer,
)
from lowrank_attn.data.transforms import mask_tokens

__all__ = [
    'ArraySpec',
    'CharTokenizer',
    'DATASETS',
    'DATA_DIR_ENV',
    'DataConfig',
    'FirstFitPacking',
    'MissingSplitWarning',
    'OFFICIAL_DATASETS',
    'Pipeline',
    'SentencePieceTokenizer',
    'RowFormat',
    'TextFiles',
    'Tokenizer',
    'WordPieceTokenizer',
    'as_data_config',
    'default_data_config',
    'default_tfds_data_dir',
    'load_builder',
    'load_data_source',
    'load_text_files',
    'load_tokenizer',
    'make_pipeline',
    'mask_tokens',
]
