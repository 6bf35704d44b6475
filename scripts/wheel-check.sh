#!/usr/bin/env bash
# Builds the `refit` Python package as a wheel and checks it as a user gets it, from a
# machine with cargo and python3 (3.11+) only:
#
#   1. maturin (the one in $MATURIN_ENV, default /tmp/refit-maturin-env, installed there
#      when missing) builds python/ in release into target/wheels: one abi3 wheel for
#      CPython 3.11 and newer, tagged manylinux_2_N by the newest glibc symbol it uses;
#   2. a new virtual environment ($WHEEL_ENV, default /tmp/refit-wheel-env, made anew)
#      installs that wheel with PATH=/usr/bin:/bin: no cargo or rustc, and binaries only,
#      so nothing can be built from source;
#   3. there, from the environment's folder (no source tree to shadow the package): `import refit`,
#      refit.transports(), and a round trip over shared memory: a Sender publishes a numpy
#      array, a Receiver on a thread gets versions 1 and 2 and acknowledges them.
#
# Prints the wheel's path and tag; exits with the first failing step's status.
#
#   scripts/wheel-check.sh
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MATURIN_DIR="${MATURIN_ENV:-/tmp/refit-maturin-env}"
ENV_DIR="${WHEEL_ENV:-/tmp/refit-wheel-env}"
MATURIN_VERSION=1.16.0
OUT="${CARGO_TARGET_DIR:-$REPO/target}/wheels"
MATURIN="$MATURIN_DIR/bin/maturin"

say() { printf 'wheel-check: %s\n' "$*" >&2; }

if ! [ -x "$MATURIN" ]; then
    say "installing maturin $MATURIN_VERSION into $MATURIN_DIR"
    python3 -m venv "$MATURIN_DIR"
    "$MATURIN_DIR/bin/pip" install --quiet "maturin==$MATURIN_VERSION"
fi

say "building the wheel ($("$MATURIN" --version)) into $OUT"
rm -f "$OUT"/refit-*.whl
(cd "$REPO/python" && "$MATURIN" build --release --locked --out "$OUT")
wheels=("$OUT"/refit-*.whl)
[ "${#wheels[@]}" = 1 ] && [ -f "${wheels[0]}" ] || { say "expected one wheel in $OUT"; exit 1; }
wheel="${wheels[0]}"
tag="$(basename "$wheel" .whl | cut -d- -f3-)"
case "$tag" in
    cp311-abi3-manylinux_*_x86_64) ;;
    *) say "$tag is not an abi3 manylinux wheel (cp311-abi3-manylinux_*_x86_64)"; exit 1 ;;
esac

say "installing it into a new environment $ENV_DIR, without cargo or rustc"
rm -rf "$ENV_DIR"
python3 -m venv "$ENV_DIR"
env PATH=/usr/bin:/bin bash -c '! command -v cargo && ! command -v rustc' >/dev/null \
    || { say "cargo or rustc is in /usr/bin or /bin: the check would not prove the wheel"; exit 1; }
env PATH=/usr/bin:/bin "$ENV_DIR/bin/pip" install --quiet --only-binary :all: "$wheel"

say "import and a round trip over shm"
(cd "$ENV_DIR" && env PATH=/usr/bin:/bin "$ENV_DIR/bin/python" - "$ENV_DIR" <<'EOF')
import sys
import threading

import numpy as np
import refit

assert refit.__file__.startswith(sys.argv[1]), f"refit imported from {refit.__file__}"
print("refit", refit.__version__, "transports:", ", ".join(refit.transports()))

def weights(v):
    return {"w": np.arange(12, dtype=np.float32).reshape(3, 4) * v}

sender = refit.Sender("shm", weights(1), receivers=1)
box = {}
t = threading.Thread(target=lambda: box.setdefault("r", refit.Receiver(sender.spec, timeout=20)))
t.start()
sender.start(timeout=20)
t.join()
receiver = box["r"]
try:
    assert (receiver.current().arrays()["w"] == weights(1)["w"]).all()
    sender.publish(weights(2))
    update = receiver.receive(timeout=20)
    assert update is not None and update.version() == 2, update
    assert (update.arrays()["w"] == weights(2)["w"]).all()
    update.ack()
    sender.wait(timeout=20)
finally:
    receiver.close()
    sender.close()
print("round trip over shm: versions 1 and 2 received and acknowledged")
EOF

echo "wheel: $wheel"
echo "tag: $tag"
