#!/usr/bin/env bash
# `make gpu-kit-check`: dry-run of the GPU kit on this CPU machine, so that a missing wheel or
# a broken import shows up here rather than on leased GPU time. Downloads (the image's packages).
#   1. a clean Python 3.11 venv with what the GPU image already has (gpu/image.txt, --no-deps);
#   2. the kit installed OFFLINE by gpu/install.sh itself (wheels/ plus local-py3XX/ for the
#      compiled ones), which then runs the import check as on the device;
#   3. the import check again with CUDA simulated (an sm90 H100), so SGLang's `if _is_cuda:`
#      module-level imports run against the sgl_kernel stub.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
KIT=${KIT:-.gpu-kit}
BASE_PY=${BASE_PY:-python3.11}
VENV=$KIT/check-venv
tag=$("$BASE_PY" -c 'import sys; print(f"py{sys.version_info[0]}{sys.version_info[1]}")')
[[ -d $KIT/wheels && -d $KIT/local-$tag ]] || { echo "no kit for $tag in $KIT: run make gpu-kit" >&2; exit 1; }

rm -rf "$VENV"
"$BASE_PY" -m venv "$VENV"
echo "== 1. the image's packages (gpu/image.txt)"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -r gpu/image.txt

echo "== 2. the kit, offline, through gpu/install.sh"
PYTHON=$VENV/bin/python KIT_EXTRA=$KIT/local-$tag gpu/install.sh "$KIT"

echo "== 3. import check with CUDA simulated"
# shellcheck source=gpu/env.sh
. gpu/env.sh
"$VENV/bin/python" gpu/check_imports.py --simulate-cuda
