"""How many rows a block of `convergence.text_interval`'s bootstrap should hold.

    python -m experiments.bottleneck.interval_blocks

Two runs scored on the same validation text differ by more on some scenes than on others, so
the per-row differences of neighbouring rows are correlated, and a bootstrap drawing single rows
would understate the spread of their mean. For every pair of runs in `convergence/results.json`
that recorded their validation rows (`convergence.validation_rows`, the same text digest): the
correlation of the per-row difference (nats per character) with the one `lag` rows on, and the
width of the 95% paired bootstrap interval of the difference in bits/char when blocks of
`block` consecutive rows are drawn. A block long enough is one past which the correlation has
died out and the width stops growing. Writes `convergence/interval_blocks.json`.
"""

import argparse
import itertools
import json
import math
import pathlib

import numpy as np

from experiments import runner
from experiments.bottleneck import convergence

OUT = convergence.OUT / 'interval_blocks.json'
LAGS = (1, 2, 4, 8, 16, 32, 64)
BLOCKS = (1, 4, 16, 32, 64, 128)


def pair_statistics(nll_a, nll_b, tokens) -> dict:
  """a minus b: bits/char, the lag correlations of the per-row difference per character, and
  the width of `convergence.block_interval` per block length (the rows past the last whole
  block left out, so that every block is as long; a few rows of 1,789)."""
  nll_a, nll_b, tokens = (np.asarray(x, np.float64) for x in (nll_a, nll_b, tokens))
  per_char = (nll_a - nll_b) / tokens
  widths = {}
  for block in BLOCKS:
    n = len(tokens) // block * block  # whole blocks only
    interval = convergence.block_interval([nll_a[:n]], [nll_b[:n]], tokens[:n], block)
    widths[block] = round(interval.high - interval.low, 5)
  return {
      'difference': round(float((nll_a.sum() - nll_b.sum()) / tokens.sum() / math.log(2)), 5),
      'rows': len(tokens),
      'lag_correlation': {
          lag: round(float(np.corrcoef(per_char[:-lag], per_char[lag:])[0, 1]), 3) for lag in LAGS
      },
      'interval_width': widths,
  }


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--results', default=str(convergence.OUT / runner.RESULTS_FILE))
  parser.add_argument('--out', default=str(OUT))
  args = parser.parse_args(argv)
  results = runner.load_results(pathlib.Path(args.results))
  rows = {
      run['name']: run['result']['final_eval']
      for run in results['runs']
      if 'row_nll' in ((run.get('result') or {}).get('final_eval') or {})
  }
  pairs = []
  for a, b in itertools.combinations(sorted(rows), 2):
    if rows[a]['rows_digest'] != rows[b]['rows_digest']:
      raise ValueError(f'{a} and {b} were scored on different validation rows')
    pairs.append(
        {'a': a, 'b': b}
        | pair_statistics(rows[a]['row_nll'], rows[b]['row_nll'], rows[a]['row_tokens'])
    )
  out = {'lags': LAGS, 'blocks': BLOCKS, 'pairs': pairs}
  runner.files.write_json(pathlib.Path(args.out), out)
  for pair in pairs:
    print(f"{pair['a']} minus {pair['b']}: {pair['difference']:+.4f} bits/char")
    print('  correlation at lag ' + json.dumps(pair['lag_correlation']))
    print('  95% interval width by block ' + json.dumps(pair['interval_width']))
  return out


if __name__ == '__main__':
  main()
