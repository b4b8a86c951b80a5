#!/usr/bin/env bash
# Fills benchmarks/gpu/carry/ (git-ignored) with what the GPU run needs and the GPU machine lacks,
# on a machine that reaches the package index; the device tool then carries the folder along.
#
#   bash benchmarks/gpu/prepare.sh            # wheels for Python 3.12 (the H200 image's 3.12.3)
#   PY_VERSIONS="3.11 3.12" bash benchmarks/gpu/prepare.sh
#
# carry/wheels/: msgspec and duckdb, the only packages `mismatch` imports that the image's list
# (.library/device/KINDS.md) lacks; pinned to the versions the dev venv tests with. duckdb's wheel
# is ~25 MB and abi3 (one wheel serves 3.12 and later), so one Python version fits the tool's
# 64 MiB with the tree (~6 MB); each more version below 3.12 adds another ~25 MB.
# carry/tiny-checkpoint/: the demo checkpoint built here (the one the CPU figures use), so the GPU
# run audits the same weights instead of rebuilding them there (~30 s of its 8 minutes).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
PY_VERSIONS=${PY_VERSIONS:-3.12}
MSGSPEC=${MSGSPEC_VERSION:-0.23.0}
DUCKDB=${DUCKDB_VERSION:-2.0.1}
CARRY=benchmarks/gpu/carry

mkdir -p "$CARRY/wheels"
for version in $PY_VERSIONS; do
  # pip matches each manylinux tag exactly: these are the ones these two packages publish.
  "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$version" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$CARRY/wheels" "msgspec==$MSGSPEC" "duckdb==$DUCKDB"
done

if [ -f reports/demo/checkpoint/mismatch_build.json ]; then
  rm -rf "$CARRY/tiny-checkpoint" && cp -r reports/demo/checkpoint "$CARRY/tiny-checkpoint"
else
  "$PYTHON" -c "import sys; from mismatch.demo.tinymodel import ensure_tiny_checkpoint as e; e(sys.argv[1])" \
    "$CARRY/tiny-checkpoint"
fi

ls -l "$CARRY/wheels"
du -sh "$CARRY"
