#!/usr/bin/env bash
# The GPU check's luggage for a machine without network (docs/gpu-check.md "On a lent GPU"):
# into .gpu-check/ (ignored by git) it puts the wheels `gpu-dra gpu-check` imports beyond the
# standard library, for Python 3.12 (only nvidia-ml-py, at the version constraints.txt pins),
# unpacked into .gpu-check/site for PYTHONPATH, and a prebuilt probe (probe.c) for a machine
# without a C compiler. Carry .gpu-check and dra_driver/cdi/hook/gpu-dra-cdi-hook (make hook)
# with the working tree, then run `bash hack/gpu-check.sh --out "$OUT/gpu-check"` there.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.gpu-check
PYTHON_VERSION=${PYTHON_VERSION:-3.12}
PIP=${PIP:-.venv/bin/pip}
pin=$(grep -E '^nvidia-ml-py==' constraints.txt)
rm -rf "$DEST"
mkdir -p "$DEST/wheels" "$DEST/site"
"$PIP" download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" \
    --implementation cp --abi none --platform any -d "$DEST/wheels" "$pin"
for wheel in "$DEST"/wheels/*.whl; do
    python3 -m zipfile -e "$wheel" "$DEST/site"
done
# built against this machine's glibc: runs where glibc is at least as new (else the check
# builds its own with cc, which it prefers)
cc -O1 -o "$DEST/gpu-check-probe" dra_driver/gpucheck/probe.c
size=$(du -sb "$DEST" | cut -f1)
limit=$((64 * 1024 * 1024))
echo "$DEST: $size bytes ($(ls "$DEST/wheels"))"
if [ "$size" -ge "$limit" ]; then
    echo "$DEST is over the 64 MiB a device run may carry" >&2
    exit 1
fi
