#!/usr/bin/env bash
# Install the sgl-kvc GPU kit into the running Python environment and check that SGLang and
# sgl-kvc import; meant for the (offline) GPU machine, as root.
#   gpu/install.sh KIT_DIR        installs KIT_DIR/wheels/*.whl
# PYTHON (default python3) picks the interpreter; KIT_EXTRA names more wheel folders whose
# wheels take precedence (`make gpu-kit-check` passes the local-interpreter builds there).
# Fast on purpose (it runs on leased GPU time): one pip call, no resolver, no index, no bytecode.
# A package already there at the same or a newer version is skipped (gpu/install_plan.py): on a
# fresh machine that is the image's own packages; a rebuilt wheel of an unchanged version is not
# reinstalled over an older install of it.
set -euo pipefail
KIT=${1:?usage: gpu/install.sh KIT_DIR}
PY=${PYTHON:-python3}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
start=$(date +%s.%N)
elapsed() { awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN { printf "%.1f", e - s }'; }

# shellcheck disable=SC2086 # KIT_EXTRA is a list of folders
plan=$("$PY" "$HERE/install_plan.py" "$KIT/wheels" ${KIT_EXTRA:-})
wheels=()
[[ -z $plan ]] || mapfile -t wheels <<< "$plan"
echo "gpu-kit: installing ${#wheels[@]} wheels into $("$PY" -c 'import sys; print(sys.prefix)')"
if (( ${#wheels[@]} )); then
    if ! PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install --no-index --no-deps --no-compile \
            --no-cache-dir --disable-pip-version-check --quiet "${wheels[@]}"; then
        echo "gpu-kit: FAILED: pip install of the kit's wheels (see pip's error above)" >&2
        exit 1
    fi
fi
echo "gpu-kit: installed in $(elapsed) s"
# Bytecode for SGLang, in parallel: installed without it (--no-compile, fast), every server process
# would compile SGLang's modules from source at its first import (on an H100 machine the first
# import of the HTTP server took 25 s, and the test servers start several at once).
if "$PY" -m compileall -q -j 0 "$("$PY" -c 'import sglang, os; print(os.path.dirname(sglang.__file__))')" \
        >/dev/null 2>&1; then
    echo "gpu-kit: SGLang's bytecode compiled in $(elapsed) s"
fi

# shellcheck source=gpu/env.sh
. "$HERE/env.sh"
# With env.sh, `python -m sgl_kvc.launch` in the repo root gets the installed sgl_kvc.
if ! (cd "$HERE/.." && "$PY" -c 'import sgl_kvc.kernels, sgl_kvc.server'); then
    echo "gpu-kit: FAILED: in $(cd "$HERE/.." && pwd), sgl_kvc is not the installed one" >&2
    exit 1
fi
if ! "$PY" "$HERE/check_imports.py"; then
    echo "gpu-kit: FAILED: import check (the failing modules are listed above)" >&2
    exit 1
fi
echo "gpu-kit: install and import check done in $(elapsed) s"
