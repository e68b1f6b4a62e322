r"""all-MiniLM-L6-v2 without fine-tuning on STS-B dev: cosine similarity of its sentence
embeddings (mean-pooled, normalised: its own pooling) against the gold scores.

    LOWRANK_ATTN_DATA=../shared/data .venv/bin/python -m experiments.glue.zero_shot

Writes `zero_shot.json` (Spearman and Pearson x100, the bar a fine-tune should clear). Under a
minute on the 2-core CPU. `tests/tasks/test_glue.py` asserts the same figure (86.7).

    ... -m experiments.glue.zero_shot --finetuned=experiments/glue/predictions/stsb-s0.json

also compares a fine-tuned STS-B run's dev predictions (its final evaluation's
`validation_predictions.json`) with the zero-shot similarities: its Spearman and Pearson minus
the zero-shot ones, with 95% paired bootstrap intervals over the 1,500 pairs
(`experiments.stats`), in `zero_shot.json` under `finetuned`.
"""

import argparse
import json
import pathlib
import tempfile

import numpy as np

from experiments import stats
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


def figures(similarities, labels) -> dict[str, float]:
  """The pairs, and Spearman and Pearson (x100) of similarities against the gold scores."""
  return {'examples': len(labels), **glue.glue_metrics('stsb', similarities, labels)}


def stsb_zero_shot(tfds_data_dir, model=None, length: int = 128) -> dict[str, float]:
  """`figures` of `stsb_similarities`."""
  return figures(*stsb_similarities(tfds_data_dir, model, length))


def versus_finetuned(cosine, labels, predictions_file) -> dict:
  """A fine-tuned run's dev figures and their differences to the zero-shot ones (paired
  bootstrap intervals); its labels must be the dev file's, in the same order."""
  kept = json.loads(pathlib.Path(predictions_file).read_text())
  predictions = np.asarray(kept['predictions'], np.float64)
  if len(kept['labels']) != len(labels) or not np.allclose(kept['labels'], labels, atol=1e-6):
    raise ValueError(
        f"{predictions_file}: its labels are not STS-B dev's in file order ({len(labels)} "
        'pairs): not predictions of this dev set.'
    )
  difference = lambda metric: stats.glue_difference(
      {'stsb': (labels, [cosine], [predictions])}, metric=metric
  ).as_dict()
  return {
      'predictions': str(predictions_file),
      **glue.glue_metrics('stsb', predictions, labels),
      'minus_zero_shot': {metric: difference(metric) for metric in ('spearman', 'pearson')},
  }


def main(argv=None):
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument(
      '--finetuned',
      help="a fine-tuned STS-B run's validation_predictions.json to compare with the zero-shot "
      'similarities',
  )
  args = parser.parse_args(argv)
  with tempfile.TemporaryDirectory() as tfds_data_dir:
    cosine, labels = stsb_similarities(tfds_data_dir)
  result = figures(cosine, labels)
  if args.finetuned:
    result['finetuned'] = versus_finetuned(cosine, labels, args.finetuned)
  (HERE / 'zero_shot.json').write_text(json.dumps(result, indent=1) + '\n')
  print(json.dumps(result, indent=1))


if __name__ == '__main__':
  main()
