"""The steps of the heads experiment, one command each (the runner runs them as subprocesses).

    python -m experiments.heads.steps analyse  --run=BASE --out=DIR [--max_batches=N]
    python -m experiments.heads.steps evaluate --run=RUN --out=DIR [--prune=gates|importance|random
        --keep=K --types=encoder|all --importance=ANALYSE_DIR --seed=S [--prune_only]]
        [--prune=mask --mask_from=EVAL_DIR] [--num_sentences=N]
    python -m experiments.heads.steps retrain  --pruned=DIR --out=DIR --steps=N [--lr=X]

analyse   head importance (Michel et al., per layer L2-normalised and raw) and confidence (Voita
          et al., EOS left out) of a run on its validation split -> DIR/result.json.
evaluate  test BLEU (test_2016_flickr, sacreBLEU) of a run, or of a pruned copy of it written to
          DIR/pruned: the heads with eval gate > 0 (gates; the gated model is scored too, and
          must score the same), the K most important heads by ANALYSE_DIR's normalised
          importance ranked over the types pruned (importance; Michel et al.'s global ranking),
          K random heads (random), or exactly the heads another evaluate run kept (mask, from
          EVAL_DIR/result.json's `keep`: an L0 run's heads pruned in another model)
          -> DIR/result.json. --prune_only: the pruned copy, its
          heads and size, no BLEU (the pruned model is fine-tuned and scored by that run).
retrain   trains a pruned copy (a run written by evaluate) for N steps from its parameters, then
          scores it as evaluate does (Michel et al.'s "retrain after pruning").
"""

import argparse
import gzip
import json
import pathlib
import shutil

import numpy as np

RESULT_FILE = 'result.json'  # what experiments.runner.read_run collects


def write_result(out: pathlib.Path, result: dict) -> None:
  out.mkdir(parents=True, exist_ok=True)
  (out / RESULT_FILE).write_text(json.dumps(result, indent=1, default=_jsonable))


def _jsonable(value):
  if isinstance(value, np.ndarray):
    return value.tolist()
  if isinstance(value, np.generic):
    return value.item()
  raise TypeError(f'{type(value).__name__} is not JSON')


def test_files(out: pathlib.Path, num_sentences: int) -> tuple[str, str]:
  """Source and reference files of test_2016_flickr (its first `num_sentences`; 0: all)."""
  from experiments.heads.roles import raw_file

  source, reference = (raw_file(f'multi30k/test_2016_flickr.{lang}.gz') for lang in ('en', 'de'))
  if not num_sentences:
    return str(source), str(reference)
  paths = []
  for path in (source, reference):
    with gzip.open(path, 'rt', encoding='utf-8') as f:
      lines = f.read().split('\n')[:num_sentences]
    subset = out / pathlib.Path(path).name.removesuffix('.gz')
    subset.write_text('\n'.join(lines) + '\n', encoding='utf-8')
    paths.append(str(subset))
  return paths[0], paths[1]


def recorded_bleu(run_dir: str, step: int, beam_size: int) -> dict | None:
  """The whole-test-split BLEU that a training run's final evaluation recorded (the same
  translations `lowrank_attn.translate` makes), if it used `beam_size`; else None."""
  path = pathlib.Path(run_dir) / 'final_eval' / str(step) / 'metrics.json'
  test = json.loads(path.read_text()).get('test') if path.exists() else None
  if not test or int(test.get('beam_size', -1)) != beam_size:
    return None
  return {
      'bleu': test.get('bleu', test.get('bleu_greedy')),
      'chrf': test['chrf'],
      'sentences': test['sentences'],
      'beam_size': beam_size,
      'bleu_signature': test.get('bleu_signature'),
      'from': str(path),
  }


def bleu(run_dir: str, out: pathlib.Path, args, run=None, step: int | None = None) -> dict:
  """Test BLEU and chrF of a run directory, with `lowrank_attn.translate` (or what the run's
  final evaluation recorded at `step`, when that is the same measurement; `run`: its RunDir)."""
  from lowrank_attn import translate

  if run is not None and not args.num_sentences:
    recorded = recorded_bleu(run_dir, step, args.beam_size or run.config.decode.beam_size)
    if recorded is not None:
      return recorded
  source, reference = test_files(out, args.num_sentences)
  result = translate.translate_file(
      run_dir,
      input_path=source,
      output_path=str(out / f'{pathlib.Path(run_dir).name}.de'),
      reference=reference,
      beam_size=args.beam_size,
      compilation_cache='',
  )
  return {k: result[k] for k in ('bleu', 'chrf', 'sentences', 'beam_size', 'bleu_signature')}


def model_size(model) -> dict:
  from flax import nnx
  from lowrank_attn import pruning

  counts = pruning.head_counts(model)
  params = sum(x.size for x in jax_leaves(nnx.state(model, nnx.Param)))
  return {
      'heads': {t: list(c) for t, c in counts.items()},
      'encoder_heads': sum(counts.get('encoder', ())),
      'total_heads': sum(sum(c) for c in counts.values()),
      'params': params,
      'gflops_per_sentence_pair': model.flops(1, 16, 16) / 1e9,
  }


def jax_leaves(tree):
  import jax

  return jax.tree.leaves(tree)


# ------------------------------------------------------------------------------ commands


def analyse(args) -> None:
  from lowrank_attn import analysis, tasks
  from lowrank_attn.runs import RunDir

  run = RunDir(args.run)
  model = run.model()
  batches = tasks.make_pipeline(
      run.config.data,
      split='validation',
      seed=0,
      global_batch_size=args.batch_size,
      train=False,
      workdir=run.path,
  )
  batches = [b for _, b in zip(range(args.max_batches or 10**9), batches)]
  result = {
      'importance': analysis.head_importance(model, batches),
      'importance_normalized': analysis.head_importance(model, batches, normalize_layers=True),
      'confidence': analysis.head_confidence(model, batches, eos_id=run.tokenizer.eos_id),
      'batches': len(batches),
      **model_size(model),
  }
  write_result(pathlib.Path(args.out), result)


def keep_mask(args, model) -> dict:
  """{type: bool [layers, heads]} of the pruning asked for."""
  from lowrank_attn import pruning

  if args.prune == 'gates':
    return pruning.keep_from_gates(model)
  if args.prune == 'mask':  # `prune_run` checks it against the model (types, shapes)
    kept = json.loads((pathlib.Path(args.mask_from) / RESULT_FILE).read_text())['keep']
    return {t: np.asarray(k, bool) for t, k in kept.items()}
  counts = pruning.head_counts(model)
  types = ['encoder'] if args.types == 'encoder' else list(counts)
  if args.prune == 'importance':
    analysed = json.loads((pathlib.Path(args.importance) / RESULT_FILE).read_text())
    scores = {t: np.asarray(analysed['importance_normalized'][t]) for t in types}
  else:
    rng = np.random.default_rng(args.seed)
    scores = {t: rng.random((len(counts[t]), counts[t][0])) for t in types}
  ranked = sorted(
      ((float(s), t, layer, head) for t in types for (layer, head), s in np.ndenumerate(scores[t])),
      reverse=True,
  )
  if not 0 <= args.keep <= len(ranked):
    raise ValueError(f'--keep={args.keep} must be in [0, {len(ranked)}] (heads of {types}).')
  keep = {t: np.zeros(scores[t].shape, bool) for t in types}
  for _, t, layer, head in ranked[: args.keep]:
    keep[t][layer, head] = True
  return keep


def evaluate(args) -> None:
  from lowrank_attn import pruning
  from lowrank_attn.runs import RunDir

  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  run = RunDir(args.run)
  step = run.check_step()
  model = run.model(step)
  result = {'run': run.path, 'step': step, 'prune': args.prune}
  if args.prune is None:
    write_result(out, {**result, **model_size(model), **bleu(run.path, out, args)})
    return
  keep = keep_mask(args, model)
  if args.prune == 'gates':  # the gated model itself: pruning it must not change its BLEU
    result['unpruned'] = {**model_size(model), **bleu(run.path, out, args, run, step)}
  pruned_dir = out / 'pruned'
  if pruned_dir.exists():  # an interrupted attempt: write it again
    shutil.rmtree(pruned_dir)
  overrides = pruning.prune_run(run.path, keep, pruned_dir, step=step)
  result.update(
      keep={t: np.asarray(k).astype(int).tolist() for t, k in keep.items()},
      overrides=overrides,
      **model_size(RunDir(pruned_dir).model()),
  )
  if not args.prune_only:
    result.update(bleu(str(pruned_dir), out, args))
  write_result(out, result)


def retrain(args) -> None:
  from lowrank_attn.runs import RunDir
  from lowrank_attn.train import train

  pruned = pathlib.Path(args.pruned).resolve()
  config = RunDir(pruned).config
  config.init_from = str(pruned)
  config.trainable = None
  config.l0_penalty_weight = 0.0  # plain training of the pruned model (Michel et al.)
  config.num_train_steps = args.steps
  config.learning_rate = args.lr
  config.lr_schedule = 'constant'
  config.warmup_steps = 0
  config.eval_every_steps = 0
  config.checkpoint_every_steps = max(args.steps // 2, 1)
  config.decode.num_examples = 0  # test BLEU below, with the same command as every point
  if args.beam_size:
    config.decode.beam_size = args.beam_size  # also the beam of the run's final evaluation
  out = pathlib.Path(args.out)
  train.train_and_evaluate(config, str(out))
  pruned_record = json.loads((pruned / 'pruning.json').read_text())
  retrained = RunDir(out)
  step = retrained.check_step()
  write_result(
      out,
      {
          'pruned_from': str(pruned),
          'retrain_steps': args.steps,
          'keep': pruned_record['keep'],
          **model_size(retrained.model(step)),
          **bleu(str(out), out, args, retrained, step),
      },
  )


def main(argv=None):
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  commands = parser.add_subparsers(dest='command', required=True)
  for name in ('analyse', 'evaluate', 'retrain'):
    sub = commands.add_parser(name)
    sub.add_argument('--out', required=True)
    sub.add_argument('--beam_size', type=int, default=None, help="default: the run's")
    sub.add_argument('--num_sentences', type=int, default=0, help='test sentences; 0: all')
    if name != 'retrain':
      sub.add_argument('--run', required=True, help='run directory')
  analyse_parser = commands.choices['analyse']
  analyse_parser.add_argument('--batch_size', type=int, default=32)
  analyse_parser.add_argument('--max_batches', type=int, default=0, help='0: the whole split')
  evaluate_parser = commands.choices['evaluate']
  evaluate_parser.add_argument('--prune', choices=('gates', 'importance', 'random', 'mask'))
  evaluate_parser.add_argument(
      '--keep', type=int, default=0, help='heads kept (importance, random)'
  )
  evaluate_parser.add_argument('--types', choices=('encoder', 'all'), default='encoder')
  evaluate_parser.add_argument('--importance', help='an analyse output directory')
  evaluate_parser.add_argument('--seed', type=int, default=0)
  evaluate_parser.add_argument(
      '--mask_from', help="mask: an evaluate output directory whose result.json has 'keep'"
  )
  evaluate_parser.add_argument(
      '--prune_only',
      action='store_true',
      help='write the pruned copy and its size, score nothing (a fine-tune scores it)',
  )
  retrain_parser = commands.choices['retrain']
  retrain_parser.add_argument('--pruned', required=True, help='a pruned run (evaluate wrote it)')
  retrain_parser.add_argument('--steps', type=int, required=True)
  retrain_parser.add_argument('--lr', type=float, default=2e-4)
  args = parser.parse_args(argv)
  if args.command == 'evaluate' and args.prune == 'importance' and not args.importance:
    parser.error('--prune=importance needs --importance=<analyse output directory>')
  if args.command == 'evaluate' and args.prune == 'mask' and not args.mask_from:
    parser.error('--prune=mask needs --mask_from=<evaluate output directory>')
  {'analyse': analyse, 'evaluate': evaluate, 'retrain': retrain}[args.command](args)


if __name__ == '__main__':
  main()
