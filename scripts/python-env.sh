#!/usr/bin/env bash
# Makes the one Python environment of CI's Python checks: a virtual environment with the
# `refit` package of this repository and everything its tests drive for real, pinned:
# torch, TorchRL (and tensordict), gymnasium, Ray (CPU wheels from PyPI), pytest, safetensors.
#
#   scripts/python-env.sh [DIR]       # default $REFIT_PYENV, else /tmp/refit-pyenv
#
# Prints the environment's python on its last line. A DIR that already has every pinned
# package is reused; the refit package is reinstalled each time (it is this checkout's).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-${REFIT_PYENV:-/tmp/refit-pyenv}}"
PY="$DIR/bin/python"
PINS=(torch==2.15.0 torchrl==0.14.1 ray==2.60.0 "gymnasium<1.3" "pytest>=8" "safetensors>=0.4")

say() { printf 'python-env: %s\n' "$*" >&2; }

if [ ! -x "$PY" ]; then
    say "creating $DIR"
    python3 -m venv "$DIR"
fi
if ! "$PY" -c 'import torch, torchrl, ray, gymnasium, pytest, safetensors' >/dev/null 2>&1; then
    say "installing ${PINS[*]} (several minutes: torch's wheel carries CUDA libraries)"
    "$PY" -m pip install --quiet --disable-pip-version-check "${PINS[@]}"
fi
say "installing the refit package ($REPO/python)"
"$PY" -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps "$REPO/python"
# the test extra's packages by name: a second install of the directory would build it again
"$PY" -m pip install --quiet --disable-pip-version-check "pytest>=8" "safetensors>=0.4"
echo "$PY"
