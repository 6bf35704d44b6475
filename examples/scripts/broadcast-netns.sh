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
# Needs root and scripts/netns-hosts (NETNS_HOSTS overrides it), and a release build
# of the example (cargo build --release --example broadcast_weights).
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
size=${1:-64MiB}; rate=${2:-400mbit}; versions=${3:-3}; bucket=${4:-4MiB}
. "$here/examples/scripts/netns-lib.sh"
exe=$(example_exe broadcast_weights "${BROADCAST_WEIGHTS:-}")
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
  wait_round "$n" "$trainer" "${pids[@]}"
  record_round "$n"
done
echo "broadcast of $size, egress $rate per host, buckets of $bucket (median per version):"
print_medians 1 2 4
