#!/usr/bin/env bash
# Builds the GPU check (transports/tests/gpu_check.rs) on this machine, without CUDA, and
# stages it for a GPU machine; prints the one command to run there. That command runs the
# crate's unit tests whose names hold `gpu`, the check (NCCL communicator, pinned staging,
# CUDA IPC, the cuda-ipc and nccl links with receivers in other processes, bandwidths
# against a device copy, the checklist), then a colocated CartPole run over cuda-ipc
# (`refit launch examples/topologies/cartpole-colocated.toml`, trainer and engine processes
# on one GPU) that must reach its target.
#
#   scripts/gpu-check.sh                 # build + stage into <repo>/.gpu-check
#   scripts/gpu-check.sh --no-colocated  # without the colocated run (no refit/cartpole build)
#   scripts/gpu-check.sh --fetch-nccl    # also fetch libnccl.so.2 from PyPI's nvidia-nccl-cu12
#   scripts/gpu-check.sh --run           # build, stage, then run it here (on a GPU machine)
#   GPU_CHECK_ROOT=/path/to/checkout scripts/gpu-check.sh
#                                        # stage into another checkout's .gpu-check (the one
#                                        # the device tool sends)
#
# libnccl: cudarc loads `libnccl.so` at run time (not `libnccl.so.2`, NCCL's real name), so
# the run command links `libnccl.so -> libnccl.so.2` into a directory on LD_LIBRARY_PATH. It
# uses the staged copy when there is one (--fetch-nccl), else the GPU machine's own (the
# device image ships PyTorch with nvidia-nccl-cu13). The nvidia-nccl-cu12 wheel is 342 MB
# (2.31.2), far over a 64 MiB working-tree transfer: fetch it only where the stage directory
# reaches the GPU machine by other means.
set -euo pipefail

fetch_nccl=0
run_here=0
colocated=1
for a in "$@"; do
  case "$a" in
    --fetch-nccl) fetch_nccl=1 ;;
    --no-colocated) colocated=0 ;;
    --run) run_here=1 ;;
    -h|--help) sed -n 2,25p "$0"; exit 0 ;;
    *) echo "gpu-check.sh: unknown argument $a" >&2; exit 2 ;;
  esac
done

root=$(git rev-parse --show-toplevel)
stage_root=$(git -C "${GPU_CHECK_ROOT:-$root}" rev-parse --show-toplevel)
rel=.gpu-check
stage=$stage_root/$rel
cd "$root"

# The stage directory must stay out of git (and be carried explicitly).
exclude="$(cd "$stage_root" && realpath "$(git rev-parse --git-common-dir)")/info/exclude"
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.gpu-check/' "$exclude" 2>/dev/null || echo '/.gpu-check/' >>"$exclude"

echo "gpu-check: building the test binaries (release, stripped, feature cuda)" >&2
log=$(mktemp)
CARGO_PROFILE_RELEASE_STRIP=true cargo test --release --no-run --locked \
  -p refit-transports --features cuda --lib --test gpu_check 2>&1 | tee "$log" >&2
# cargo names each executable in parentheses, relative to here or absolute (a target
# directory elsewhere: CARGO_TARGET_DIR)
exe() {
  local p
  p=$(grep -o "([^()]*release/deps/$1-[0-9a-f]*)" "$log" | tail -1 | tr -d '()')
  [[ -z "$p" || "$p" == /* ]] || p="$root/$p"
  echo "$p"
}
bin=$(exe gpu_check)
lib=$(exe refit_transports)
rm -f "$log"
if [[ -z "$bin" || ! -x "$bin" || -z "$lib" || ! -x "$lib" ]]; then
  echo "gpu-check: cargo did not report the gpu_check and unit-test executables" >&2
  exit 1
fi

mkdir -p "$stage"
rm -f "$stage/refit.gz" "$stage/cartpole.gz" "$stage/cartpole-colocated.toml"
cp "$bin" "$stage/gpu_check"
cp "$lib" "$stage/unit_tests"
chmod +x "$stage/gpu_check" "$stage/unit_tests"

if [[ $colocated == 1 ]]; then
  # the colocated run: refit (the launcher) and the CartPole example, both with `cuda`,
  # compressed to fit a small transfer; the topology's command points at the staged example
  echo "gpu-check: building refit and the cartpole example (release, stripped, feature cuda)" >&2
  target=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
  CARGO_PROFILE_RELEASE_STRIP=true cargo build --release --locked --features cuda \
    --bin refit --example cartpole >&2
  gzip -9 -c "$target/release/refit" >"$stage/refit.gz"
  gzip -9 -c "$target/release/examples/cartpole" >"$stage/cartpole.gz"
  sed -e "s|^command = .*|command = [\"$rel/cartpole\", \"topology\"]|" \
    examples/topologies/cartpole-colocated.toml >"$stage/cartpole-colocated.toml"
fi

if [[ $fetch_nccl == 1 ]]; then
  tmp=$(mktemp -d)
  echo "gpu-check: fetching nvidia-nccl-cu12 from PyPI" >&2
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_18_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 -d "$tmp" nvidia-nccl-cu12 >&2
  whl=$(ls "$tmp"/nvidia_nccl_cu12-*.whl | head -1)
  python3 - "$whl" "$stage" <<'EOF'
import sys, zipfile, shutil, os
whl, stage = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    name = next(n for n in z.namelist() if n.endswith("/libnccl.so.2"))
    with z.open(name) as src, open(os.path.join(stage, "libnccl.so.2"), "wb") as dst:
        shutil.copyfileobj(src, dst)
print(f"gpu-check: extracted {name}", file=sys.stderr)
EOF
  rm -rf "$tmp"
fi

size=$(du -sm "$stage" | cut -f1)
echo "gpu-check: staged $(ls "$stage" | tr '\n' ' ')in $stage (${size} MiB)" >&2
if (( size > 60 )); then
  echo "gpu-check: note: ${size} MiB is over what a 64 MiB working-tree transfer carries" >&2
fi

# What runs on the GPU machine, from the repository root.
remote="chmod +x $rel/gpu_check $rel/unit_tests; d=/tmp/refit-nccl; mkdir -p \$d; n=$rel/libnccl.so.2; [ -f \$n ] || n=\$(find /opt /usr /usr/local -name 'libnccl.so.2*' 2>/dev/null | head -1); echo \"libnccl: \$n\"; ln -sf \"\$(readlink -f \$n)\" \$d/libnccl.so; nvidia-smi -L; export LD_LIBRARY_PATH=\$d:\${LD_LIBRARY_PATH:-}; $rel/unit_tests gpu 2>&1 | tee \${OUT:-/tmp}/unit-tests.log; u=\${PIPESTATUS[0]}; $rel/gpu_check 2>&1 | tee \${OUT:-/tmp}/gpu-check.log; g=\${PIPESTATUS[0]}; c=skipped; if [ -f $rel/refit.gz ]; then gunzip -f $rel/refit.gz $rel/cartpole.gz; chmod +x $rel/refit $rel/cartpole; timeout 420 $rel/refit launch $rel/cartpole-colocated.toml --set stop.max_time_s=360 2>&1 | tee \${OUT:-/tmp}/colocated.log; c=\${PIPESTATUS[0]}; grep -q '^solved: ' \${OUT:-/tmp}/colocated.log || c=unsolved; fi; echo \"unit tests rc=\$u, gpu check rc=\$g, colocated cuda-ipc run: \$c\"; [ \$u = 0 ] && [ \$g = 0 ] && { [ \$c = 0 ] || [ \$c = skipped ]; }"

if [[ $run_here == 1 ]]; then
  exec bash -c "$remote"
fi

cat <<EOF
Run on the GPU machine (the device tool's run, from the root of the checkout it sends, with
the stage directory carried; it must sit in that checkout, ignored by git):

  carry: ["$rel"]
  timeout_s: 600
  command: $remote
EOF
