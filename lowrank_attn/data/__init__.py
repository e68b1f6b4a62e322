"""Real text data: TFDS builders (ArrayRecord, no TensorFlow), tokenizers, grain pipelines.

The only package that imports tensorflow_datasets and grain.

    from lowrank_attn import data
    pipeline = data.make_pipeline(config.data, split="train", seed=0, global_batch_size=64,
                                  train=True, workdir=workdir)
    source = data.load_data_source("ud_english_ewt", "validation")   # raw examples
"""

from lowrank_attn.data.datasets import (
    DATASETS,
    OFFICIAL_DATASETS,
    default_tfds_data_dir,
    load_builder,
    load_data_source,
)
from lowrank_attn.data.pipeline import (
    DATA_CONFIG_DEFAULTS,
    TASKS,
    ArraySpec,
    Pipeline,
    default_data_config,
    make_pipeline,
    mask_tokens,
)
from lowrank_attn.data.raw_files import DATA_DIR_ENV, MissingSplitWarning
from lowrank_attn.data.tokenizers import (
    CharTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    WordPieceTokenizer,
)

__all__ = [
    "ArraySpec",
    "CharTokenizer",
    "DATASETS",
    "DATA_DIR_ENV",
    "DATA_CONFIG_DEFAULTS",
    "MissingSplitWarning",
    "OFFICIAL_DATASETS",
    "Pipeline",
    "SentencePieceTokenizer",
    "TASKS",
    "Tokenizer",
    "WordPieceTokenizer",
    "default_data_config",
    "default_tfds_data_dir",
    "load_builder",
    "load_data_source",
    "make_pipeline",
    "mask_tokens",
]
