#!/usr/bin/env bash
# Broadcast across simulated hosts: the broadcast_weights trainer on host 1 and N receivers on
# hosts 2..N+1, every host's egress limited to RATE, for N = 1, 2, 4. The CPU collective sends
# each bucket down a chain (host 1 -> 2 -> 3 ...), so every byte crosses every link once and
# N receivers should take little more than one. Prints, for each N, the median time until
# every receiver applied and acknowledged a version, and its ratio to N = 1.
#
#   examples/scripts/broadcast-netns.sh [SIZE [RATE [VERSIONS [BUCKET]]]]
#
# Defaults: SIZE 64MiB, RATE 400mbit, VERSIONS 3 (timed, after the initial one), BUCKET 4MiB.
# Needs root and ../shared/tools/netns-hosts (NETNS_HOSTS overrides it), and a release build
# of the example (cargo build --release --example broadcast_weights).
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
size=${1:-64MiB}; rate=${2:-400mbit}; versions=${3:-3}; bucket=${4:-4MiB}
nh=${NETNS_HOSTS:-$here/../shared/tools/netns-hosts}
exe=${BROADCAST_WEIGHTS:-$here/target/release/examples/broadcast_weights}
[ -x "$exe" ] || { echo "build it first: cargo build --release --example broadcast_weights" >&2; exit 1; }
export REFIT_TOKEN=${REFIT_TOKEN:-$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')}
log=$(mktemp -d)
cleanup() { jobs -p | xargs -r kill 2>/dev/null || true; "$nh" down >/dev/null 2>&1 || true; rm -rf "$log"; }
trap cleanup EXIT
declare -A median
for n in 1 2 4; do
  "$nh" up $((n + 1)) "$rate" >/dev/null
  "$nh" run 1 "$exe" trainer --bind 10.77.0.1:29500 --no-spawn --receivers "$n" \
    --versions "$versions" --size "$size" --bucket-size "$bucket" >"$log/trainer-$n" 2>&1 &
  trainer=$!
  # the receivers reach the trainer's store once it listens
  for _ in $(seq 100); do grep -q "serving the store" "$log/trainer-$n" && break; sleep 0.1; done
  pids=()
  for i in $(seq 1 "$n"); do
    h=$((i + 1))
    "$nh" run $h "$exe" receiver --store 10.77.0.1:29500 --member "r$i" --bind "10.77.0.$h" \
      --bucket-size "$bucket" >"$log/receiver-$n-$i" 2>&1 &
    pids+=($!)
  done
  if ! wait "$trainer"; then cat "$log/trainer-$n" "$log"/receiver-$n-* >&2; exit 1; fi
  for p in "${pids[@]}"; do wait "$p" || { cat "$log"/receiver-$n-* >&2; exit 1; }; done
  grep -E "acknowledged|median" "$log/trainer-$n" | sed "s/^/N=$n /"
  median[$n]=$(sed -n 's/^trainer: median \([0-9.]*\) s.*/\1/p' "$log/trainer-$n")
  "$nh" down >/dev/null
done
echo "broadcast of $size, egress $rate per host, buckets of $bucket (median per version):"
for n in 1 2 4; do
  awk -v n=$n -v t="${median[$n]}" -v b="${median[1]}" \
    'BEGIN { printf "  N=%d  %.3f s  %.2fx N=1\n", n, t, t / b }'
done
