"""Validation and test BLEU of a translation run: last checkpoint vs the mean of the last K,
at two length penalties (the choice is made on validation, then read off test).

    python -m experiments.multi30k.final_scores --workdir=/work/runs/multi30k/base \
        --out=experiments/multi30k/final_scores

Prints a markdown table (sacreBLEU, cased, detokenized; beam 4); with --out also writes it to
DIR/final_scores.md and every score to DIR/results.json.
"""

import argparse
import gzip
import json
import os
import pathlib

from lowrank_attn import runs, translate
from lowrank_attn.train import decode


def read(path):
  with gzip.open(path, 'rt', encoding='utf-8') as f:
    return [line.rstrip('\n') for line in f]


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--workdir', required=True)
  parser.add_argument('--average_last', type=int, default=3)
  parser.add_argument('--length_penalties', default='0.6,1.0')
  parser.add_argument('--splits', default='val,test_2016_flickr')
  parser.add_argument('--out', help='folder for final_scores.md and results.json')
  args = parser.parse_args()
  data_dir = os.path.join(os.environ['LOWRANK_ATTN_DATA'], 'multi30k')
  opened = translate.open_run(args.workdir)
  steps = opened.run.last_steps(args.average_last)
  params = [opened.run.restore_params(step, opened.abstract_params) for step in steps]
  candidates = {
      f'last checkpoint ({steps[-1]})': params[-1],
      f'mean of {", ".join(map(str, steps))}': runs.mean_params(params),
  }
  splits = args.splits.split(',')
  lines = [
      '| parameters | length penalty | '
      + ' | '.join(f'{s} BLEU | {s} chrF2' for s in splits)
      + ' |',
      '|---|---:|' + '---:|---:|' * len(splits),
  ]
  print('\n'.join(lines), flush=True)
  results = []
  for name, p in candidates.items():
    for alpha in map(float, args.length_penalties.split(',')):
      translator = opened.translator(p, beam_size=4, length_penalty=alpha, batch_size=64)
      cells = []
      for split in splits:
        scores = decode.score(
            translator.translate(read(f'{data_dir}/{split}.en.gz')).texts,
            read(f'{data_dir}/{split}.de.gz'),
        )
        cells += [f'{scores["bleu"]:.2f}', f'{scores["chrf"]:.2f}']
        results.append(
            {
                'workdir': args.workdir,
                'parameters': name,
                'length_penalty': alpha,
                'beam_size': 4,
                'split': split,
                **scores,
            }
        )
      lines.append(f'| {name} | {alpha} | ' + ' | '.join(cells) + ' |')
      print(lines[-1], flush=True)
  lines += ['', scores['bleu_signature'], scores['chrf_signature']]
  print('\n'.join(lines[-3:]))
  if args.out:
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / 'final_scores.md').write_text('\n'.join(lines) + '\n')
    (out / 'results.json').write_text(json.dumps(results, indent=1) + '\n')


if __name__ == '__main__':
  main()
