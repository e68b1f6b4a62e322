r"""all-MiniLM-L6-v2 without fine-tuning on STS-B dev: cosine similarity of its sentence
embeddings (mean-pooled, normalised: its own pooling) against the gold scores.

    LOWRANK_ATTN_DATA=../shared/data .venv/bin/python -m experiments.glue.zero_shot

Writes `zero_shot.json` (Spearman and Pearson x100, the bar a fine-tune should clear). About
two minutes on the 2-core CPU. `tests/tasks/test_glue.py` asserts the same figure (86.7).
"""

import json
import pathlib
import tempfile

from flax import nnx
import jax
import numpy as np

from lowrank_attn import data
from lowrank_attn.models import bert
from lowrank_attn.tasks import glue
from lowrank_attn.train import state as state_lib

HERE = pathlib.Path(__file__).resolve().parent


def stsb_zero_shot(tfds_data_dir, model=None, length: int = 128) -> dict[str, float]:
  """Spearman and Pearson (x100) of `model`'s pooled cosine similarity on STS-B dev (default
  model: the installed all-MiniLM-L6-v2; any BERT-architecture model with its pooling)."""
  model_dir = state_lib.pretrained_dir('all-MiniLM-L6-v2')
  model = model or bert.load_pretrained(model_dir)
  pooling = bert.sentence_pooling(model_dir)
  tokenizer = data.WordPieceTokenizer(model_dir / 'vocab.txt')
  source = data.load_data_source('glue/stsb', 'validation', tfds_data_dir=tfds_data_dir)
  examples = [source[i] for i in range(len(source))]
  graphdef, params = nnx.split(model)
  embed_fn = jax.jit(lambda p, x: bert.sentence_embeddings(nnx.merge(graphdef, p), x, pooling))

  def embed(texts):
    rows = np.zeros((len(texts), length), np.int32)
    for i, text in enumerate(texts):
      ids = [tokenizer.bos_id, *tokenizer.encode(text)[: length - 2], tokenizer.eos_id]
      rows[i, : len(ids)] = ids
    return np.concatenate(
        [np.asarray(embed_fn(params, rows[i : i + 500])) for i in range(0, len(rows), 500)]
    )

  a = embed([e['sentence1'].decode() for e in examples])
  b = embed([e['sentence2'].decode() for e in examples])
  cosine = np.sum(a * b, -1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
  labels = np.array([e['label'] for e in examples])
  return {'examples': len(examples), **glue.glue_metrics('stsb', cosine, labels)}


def main():
  with tempfile.TemporaryDirectory() as tfds_data_dir:
    result = stsb_zero_shot(tfds_data_dir)
  (HERE / 'zero_shot.json').write_text(json.dumps(result, indent=1) + '\n')
  print(result)


if __name__ == '__main__':
  main()
