r"""all-MiniLM-L6-v2 without fine-tuning on STS-B dev: cosine similarity of its sentence
embeddings (mean-pooled, normalised: its own pooling) against the gold scores.

    LOWRANK_ATTN_DATA=../shared/data .venv/bin/python -m experiments.glue.zero_shot

Writes `zero_shot.json` (Spearman and Pearson x100, the bar a fine-tune should clear). About
two minutes on the 2-core CPU. `tests/tasks/test_glue.py` asserts the same figure (86.7).
"""

import json
import pathlib
import tempfile

import numpy as np

from lowrank_attn import data
from lowrank_attn.models import bert
from lowrank_attn.tasks import glue
from lowrank_attn.train import state as state_lib

HERE = pathlib.Path(__file__).resolve().parent


def stsb_similarities(
    tfds_data_dir, model=None, length: int = 128
) -> tuple[np.ndarray, np.ndarray]:
  """`model`'s pooled cosine similarity of each STS-B dev pair and the gold scores, in the dev
  file's order (default model: the installed all-MiniLM-L6-v2; any BERT-architecture model
  with its pooling)."""
  model_dir = state_lib.pretrained_dir('all-MiniLM-L6-v2')
  model = model or bert.load_pretrained(model_dir)
  pooling = bert.sentence_pooling(model_dir)
  tokenizer = data.WordPieceTokenizer(model_dir / 'vocab.txt')
  source = data.load_data_source('glue/stsb', 'validation', tfds_data_dir=tfds_data_dir)
  examples = [source[i] for i in range(len(source))]

  def embed(key):
    ids = [
        [tokenizer.bos_id, *tokenizer.encode(e[key].decode())[: length - 2], tokenizer.eos_id]
        for e in examples
    ]
    return bert.embed_sentences(model, pooling, ids)

  a, b = embed('sentence1'), embed('sentence2')
  cosine = np.sum(a * b, -1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
  return cosine, np.array([e['label'] for e in examples])


def stsb_zero_shot(tfds_data_dir, model=None, length: int = 128) -> dict[str, float]:
  """Spearman and Pearson (x100) of `stsb_similarities`."""
  cosine, labels = stsb_similarities(tfds_data_dir, model, length)
  return {'examples': len(labels), **glue.glue_metrics('stsb', cosine, labels)}


def main():
  with tempfile.TemporaryDirectory() as tfds_data_dir:
    result = stsb_zero_shot(tfds_data_dir)
  (HERE / 'zero_shot.json').write_text(json.dumps(result, indent=1) + '\n')
  print(result)


if __name__ == '__main__':
  main()
