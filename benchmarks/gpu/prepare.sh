#!/usr/bin/env bash
# Prepares .gpu/ (git-ignored) for benchmarks/gpu/check.sh on a lent GPU machine, which reaches no
# package registry: the wheels its image lacks (benchmarks/gpu/wheels.py says which, and why) for
# its Python, and the generated gRPC stubs. Run here, in the project's environment, from anywhere:
#
#   benchmarks/gpu/prepare.sh                 # for the GPU image's Python 3.12
#   PYVER=3.11 benchmarks/gpu/prepare.sh      # for a dry run of check.sh on this machine's Python
#
# Then the device tool's run, with carry [".gpu"] (about 20 MB travels):
#   bash benchmarks/gpu/check.sh quick        # see check.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PYVER=${PYVER:-3.12}
DEST=${DEST:-.gpu}
python=${PYTHON:-python}

rm -rf "$DEST/wheels" "$DEST/stubs"
mkdir -p "$DEST/wheels" "$DEST/stubs"
ls specdec/v1/*_pb2.py > /dev/null 2>&1 || { echo "no generated stubs in specdec/v1: pip install -e . makes them" >&2; exit 1; }
cp specdec/v1/*_pb2*.py "$DEST/stubs/"
"$python" benchmarks/gpu/wheels.py > "$DEST/requirements.txt"
platforms=()
for n in 28 27 24 17; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  "${platforms[@]}" -d "$DEST/wheels" -r "$DEST/requirements.txt"
echo "$PYVER" > "$DEST/python-version"
echo "prepared $DEST for Python $PYVER: $(ls "$DEST/wheels" | wc -l) wheels ($(du -sh "$DEST/wheels" | cut -f1)), $(ls "$DEST/stubs" | wc -l) stubs"
