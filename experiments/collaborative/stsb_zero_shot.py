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
the layers' bilinear forms, seconds), each entry's cosine similarity per dev pair (rounded to
6 decimals, the figures are computed from the rounded values) to
`DIR/stsb_zero_shot_similarities.json`, and 95% paired bootstrap intervals over the 1,500 pairs
(`experiments.stats`) of each narrower entry's Spearman against the original's, and of the
methods against each other at each width, to `DIR/stsb_zero_shot_intervals.json`; the tables
to `.md` and, with the default DIR, to the README's section. Resumable: entries already in the
JSON with their similarities are kept; `--report_only` recomputes the intervals and tables.
"""

import argparse
import json
import pathlib
import tempfile
import time

import numpy as np

from experiments import runner
from experiments import stats
from experiments.collaborative.reparametrize_minilm import METHODS, convert
from experiments.glue.zero_shot import stsb_similarities
from lowrank_attn import runs
from lowrank_attn.models import bert
from lowrank_attn.tasks import glue
from lowrank_attn.train import state as state_lib

HERE = pathlib.Path(__file__).resolve().parent
DEFAULT_OUT = HERE / 'glue'
RESULTS = 'stsb_zero_shot.json'


SIMILARITIES = 'stsb_zero_shot_similarities.json'
INTERVALS = 'stsb_zero_shot_intervals.json'
# Method comparisons at each width: (A, B), the interval is B's Spearman minus A's.
PAIRS = (('per_head_svd', 'collaborative'), ('collaborative', 'collaborative_rescaled'))


def key(method: str, key_dim: int) -> str:
  return f'{method}@{key_dim}'


def main(argv=None):
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument('--key_dims', default='384,256,192,128,96,64,48')
  parser.add_argument('--out', default=str(DEFAULT_OUT))
  parser.add_argument(
      '--report_only', action='store_true', help='intervals and tables from the JSON files'
  )
  args = parser.parse_args(argv)
  key_dims = [int(k) for k in args.key_dims.split(',')]
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  path, sims_path = out / RESULTS, out / SIMILARITIES
  similarities = json.loads(sims_path.read_text()) if sims_path.exists() else {'entries': {}}
  results = json.loads(path.read_text()) if path.exists() else []
  # An entry counts as done only with its similarities (older runs did not keep them).
  results = [r for r in results if key(r['method'], r['key_dim']) in similarities['entries']]
  done = {(r['method'], r['key_dim']) for r in results}
  original = bert.load_pretrained(state_lib.pretrained_dir('all-MiniLM-L6-v2'))
  todo = [('original', original.cfg.emb_dim)] + [(m, k) for k in key_dims for m in METHODS]
  with tempfile.TemporaryDirectory() as tfds_data_dir:
    for method, key_dim in [] if args.report_only else todo:
      if (method, key_dim) in done:
        continue
      started = time.time()
      if method == 'original':
        model, errors = original, {}
      else:
        converted = convert(original, method, key_dim)
        model, errors = converted.model, converted.relative_errors
      cosine, labels = stsb_similarities(tfds_data_dir, model)
      cosine = [round(float(x), 6) for x in cosine]
      labels = [float(x) for x in labels]
      if similarities.get('labels', labels) != labels:
        raise ValueError(f'{sims_path}: its gold scores are not those of STS-B dev as read now.')
      similarities['labels'] = labels
      similarities['entries'][key(method, key_dim)] = cosine
      metrics = glue.glue_metrics('stsb', np.asarray(cosine), np.asarray(labels))
      results.append(
          {
              'method': method,
              'key_dim': key_dim,
              'examples': len(labels),
              'spearman': metrics['spearman'],
              'pearson': metrics['pearson'],
              'mean_relative_error': float(np.mean(list(errors.values()))) if errors else 0.0,
              'seconds': round(time.time() - started, 1),
          }
      )
      # Similarities first: an entry in the results always has them.
      runs.write_atomic(sims_path, json.dumps(similarities) + '\n')
      runs.write_atomic(path, json.dumps(results, indent=1) + '\n')
      print(
          f'{method:24s} D~k={key_dim:4d} Spearman {metrics["spearman"]:.2f} Pearson '
          f'{metrics["pearson"]:.2f} ({results[-1]["seconds"]:.0f} s)',
          flush=True,
      )
  intervals = compute_intervals(results, similarities)
  runs.write_atomic(out / INTERVALS, json.dumps(intervals, indent=1) + '\n')
  report(results, intervals, out)


def compute_intervals(results, similarities) -> dict[str, list[dict]]:
  """Paired bootstrap intervals of Spearman differences (x100) over the dev pairs: every
  entry narrower than the original against it (`vs_original`), and `PAIRS` at each narrower
  width (`methods`). Each Spearman is recomputed from the kept similarities and must match the
  recorded one."""
  labels, entries = similarities.get('labels'), similarities['entries']
  by_key = {key(r['method'], r['key_dim']): r for r in results}
  for name, r in by_key.items():
    recomputed = glue.glue_metrics('stsb', np.asarray(entries[name]), np.asarray(labels))
    if abs(recomputed['spearman'] - r['spearman']) > 1e-9:
      raise ValueError(
          f'{name}: Spearman {recomputed["spearman"]:.6f} from the kept similarities, '
          f'{r["spearman"]:.6f} recorded.'
      )

  def interval(a: str, b: str) -> dict:
    difference = stats.glue_difference(
        {'stsb': (labels, [entries[a]], [entries[b]])}, metric='spearman'
    )
    return {'a': a, 'b': b, **difference.as_dict()}

  # At the original's width every conversion is exact: only the narrower ones are compared.
  full = max((r['key_dim'] for r in results), default=0)
  vs_original = [
      interval(key('original', full), name)
      for name, r in by_key.items()
      if r['key_dim'] < full and key('original', full) in by_key
  ]
  methods = [
      interval(key(a, k), key(b, k))
      for k in sorted({r['key_dim'] for r in results if r['key_dim'] < full}, reverse=True)
      for a, b in PAIRS
      if key(a, k) in by_key and key(b, k) in by_key
  ]
  return {'vs_original': vs_original, 'methods': methods}


def _cell(entry: dict | None) -> str:
  if entry is None:
    return ''
  return f"{entry['estimate']:+.2f} [{entry['low']:+.2f}, {entry['high']:+.2f}]"


def report(results, intervals, out: pathlib.Path) -> None:
  rows = sorted(results, key=lambda r: (-r['key_dim'], r['method'] != 'original', r['method']))
  vs_original = {i['b']: i for i in intervals['vs_original']}
  table = runner.markdown_table(
      rows,
      [
          ('method', 'method'),
          ('D~k', 'key_dim'),
          ('STS-B dev Spearman', lambda r: f"{r['spearman']:.2f}"),
          (
              'minus the original [95% CI]',
              lambda r: _cell(vs_original.get(key(r['method'], r['key_dim']))),
          ),
          ('Pearson', lambda r: f"{r['pearson']:.2f}"),
          ('mean error', lambda r: f"{r['mean_relative_error']:.3f}"),
      ],
  )
  comparisons = runner.markdown_table(
      intervals['methods'],
      [
          ('D~k', lambda i: i['a'].split('@')[1]),
          ('B minus A', lambda i: f"{i['b'].split('@')[0]} minus {i['a'].split('@')[0]}"),
          ('Spearman difference [95% CI]', _cell),
      ],
  )
  text = (
      f'{table}\n'
      'Between methods at the same width (paired bootstrap over the 1,500 dev pairs, '
      f'{stats.SAMPLES:,} resamples):\n\n{comparisons}'
  )
  (out / RESULTS.replace('.json', '.md')).write_text(text)
  if out.resolve() == DEFAULT_OUT.resolve():
    runner.write_section(HERE / 'README.md', 'stsb_zero_shot', text)


if __name__ == '__main__':
  main()
