r"""Issue 24, part 1 without training: all-MiniLM-L6-v2 re-parametrized at each key width,
scored zero-shot on STS-B dev (mean-pooled cosine similarity, Spearman x100).

    LOWRANK_ATTN_DATA=../shared/data .venv/bin/python -m \
        experiments.collaborative.stsb_zero_shot [--key_dims=384,256,...] [--out=DIR]

STS-B is not among the sentence pairs MiniLM was trained on (unlike the Multi30k/Flickr30k
captions of `reparametrize_minilm.py`), so this is the uncontaminated zero-shot measure. The
methods are those of `reparametrize_minilm.py` (`convert`): every layer CP-decomposed to a
collaborative layer of shared key width D~k (logit scale kept, or the paper's code's rescaled
1/sqrt(D~k / 12)), or each head's W_Q W_K^T truncated to rank D~k / 12 (per-head SVD); the
original once. No fine-tune: this is where each method starts before the GLUE fine-tunes.

Writes `DIR/stsb_zero_shot.json` (method, key_dim, spearman, pearson, mean relative error of
the layers' bilinear forms, seconds) and `.md`, and with the default DIR the README's section.
Resumable: entries already in the JSON are kept.
"""

import argparse
import json
import pathlib
import tempfile
import time

import numpy as np

from experiments import runner
from experiments.collaborative.reparametrize_minilm import METHODS, convert
from experiments.glue.zero_shot import stsb_zero_shot
from lowrank_attn import runs
from lowrank_attn.models import bert
from lowrank_attn.train import state as state_lib

HERE = pathlib.Path(__file__).resolve().parent
DEFAULT_OUT = HERE / 'glue'
RESULTS = 'stsb_zero_shot.json'


def main(argv=None):
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument('--key_dims', default='384,256,192,128,96,64,48')
  parser.add_argument('--out', default=str(DEFAULT_OUT))
  args = parser.parse_args(argv)
  key_dims = [int(k) for k in args.key_dims.split(',')]
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  path = out / RESULTS
  results = json.loads(path.read_text()) if path.exists() else []
  done = {(r['method'], r['key_dim']) for r in results}
  original = bert.load_pretrained(state_lib.pretrained_dir('all-MiniLM-L6-v2'))
  todo = [('original', original.cfg.emb_dim)] + [(m, k) for k in key_dims for m in METHODS]
  with tempfile.TemporaryDirectory() as tfds_data_dir:
    for method, key_dim in todo:
      if (method, key_dim) in done:
        continue
      started = time.time()
      if method == 'original':
        model, errors = original, {}
      else:
        converted = convert(original, method, key_dim)
        model, errors = converted.model, converted.relative_errors
      metrics = stsb_zero_shot(tfds_data_dir, model)
      results.append(
          {
              'method': method,
              'key_dim': key_dim,
              **metrics,
              'mean_relative_error': float(np.mean(list(errors.values()))) if errors else 0.0,
              'seconds': round(time.time() - started, 1),
          }
      )
      runs.write_atomic(path, json.dumps(results, indent=1) + '\n')
      print(
          f'{method:24s} D~k={key_dim:4d} Spearman {metrics["spearman"]:.2f} Pearson '
          f'{metrics["pearson"]:.2f} ({results[-1]["seconds"]:.0f} s)',
          flush=True,
      )
  report(results, out)


def report(results, out: pathlib.Path) -> None:
  rows = sorted(results, key=lambda r: (-r['key_dim'], r['method'] != 'original', r['method']))
  table = runner.markdown_table(
      rows,
      [
          ('method', 'method'),
          ('D~k', 'key_dim'),
          ('STS-B dev Spearman', lambda r: f"{r['spearman']:.2f}"),
          ('Pearson', lambda r: f"{r['pearson']:.2f}"),
          ('mean error', lambda r: f"{r['mean_relative_error']:.3f}"),
      ],
  )
  (out / RESULTS.replace('.json', '.md')).write_text(table)
  if out.resolve() == DEFAULT_OUT.resolve():
    runner.write_section(HERE / 'README.md', 'stsb_zero_shot', table)


if __name__ == '__main__':
  main()
