#!/usr/bin/env bash
# `gpu-dra gpu-check` without make and without an installed package (docs/gpu-check.md): runs
# the check from this working tree with .venv's Python when there is one, else with python3 and
# the wheels hack/gpu-check-wheels.sh unpacked into .gpu-check/site. The probe is built with cc
# when the machine has one, else the prebuilt .gpu-check/gpu-check-probe is used. Arguments go
# to the check: --out DIR, --simulate SPEC, --driver-root DIR, ...
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-}
if [ -z "$python" ]; then
    if [ -x "$repo/.venv/bin/python" ]; then python=$repo/.venv/bin/python; else python=python3; fi
fi
extra=()
if ! command -v cc > /dev/null && [ -x "$repo/.gpu-check/gpu-check-probe" ]; then
    extra=(--probe "$repo/.gpu-check/gpu-check-probe")
fi
export PYTHONPATH="$repo:$repo/.gpu-check/site${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -c 'import sys; from dra_driver.cli import gpu_dra_main; sys.exit(gpu_dra_main(sys.argv[1:]))' \
    gpu-check "${extra[@]}" "$@"
