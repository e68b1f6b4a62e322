#!/bin/bash
# A GPU session's checks for issue 23: versions, the GPU tests (tests/gpu: cuDNN and our Pallas
# kernel against the materialising path), the --long table in bfloat16. Run from the repository
# root on a machine with an NVIDIA GPU and a CUDA build of jax; everything lands in $OUT
# (default /tmp/gpu_checks).
#
#   bash benchmarks/gpu_checks.sh                 # both: ~10 min of tests, ~3.5 min of table
#   STAGES=bench bash benchmarks/gpu_checks.sh    # the table alone (3.5 min on an H200)
#   STAGES=tests TEST_SECONDS=540 bash benchmarks/gpu_checks.sh
#
# On an H200 (2026-11-26) the table took 3.5 min and 65 of the 106 tests passed in 400 s with
# 14 processes (compiling dominates).
set -u
OUT=${OUT:-/tmp/gpu_checks}
STAGES=${STAGES:-tests bench}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PY:-python3}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c 'import jax, flax; from lowrank_attn.attention import fused
print("jax", jax.__version__, "flax", flax.__version__, jax.devices())
print("cudnn", fused._local_cudnn(), "takes value widths unlike key widths:", fused.cudnn_accepts_value_width())'
} >"$OUT/versions.txt" 2>&1
cat "$OUT/versions.txt"
if [[ " $STAGES " == *" tests "* ]]; then
  # -v names each test as it finishes, so a timeout still says which ones ran.
  timeout "${TEST_SECONDS:-600}" env JAX_PLATFORMS=cuda $PY -m pytest -v -m gpu tests/gpu \
    -n 14 --timeout=200 -p no:cacheprovider -W ignore::pytest.PytestWarning \
    >"$OUT/tests_gpu.log" 2>&1
  echo "tests/gpu exit $?: $(grep -c ' PASSED ' "$OUT/tests_gpu.log") passed," \
    "$(grep -c -E ' (FAILED|ERROR) ' "$OUT/tests_gpu.log") failed"
  grep -E ' (FAILED|ERROR) ' "$OUT/tests_gpu.log"
fi
if [[ " $STAGES " == *" bench "* ]]; then
  # The table alone on the GPU; rows print as each length finishes, so a timeout keeps them.
  timeout "${BENCH_SECONDS:-330}" $PY benchmarks/attention.py --long --dtype=bfloat16 \
    --long_batch=8 --max_temp_gb=40 --repeats=5 --lengths="${LENGTHS:-1024,2048,4096,8192,512}" \
    --out "$OUT/attention_long_gpu.md" >"$OUT/bench.log" 2>"$OUT/bench_err.log"
  echo "benchmark exit $?"
  cat "$OUT/bench.log"
  grep -A12 ' failed:$' "$OUT/bench_err.log" | tail -60
fi
