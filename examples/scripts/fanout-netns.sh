#!/usr/bin/env bash
# Fan-out across simulated hosts: the multi_node trainer on host 1 and N workers on hosts
# 2..N+1, every host's egress limited to RATE, for N = 1..4. Prints, for each N, the median
# time until every worker acknowledged a version, and its ratio to N = 1.
#
#   examples/scripts/fanout-netns.sh [SIZE [RATE [VERSIONS [BUCKET]]]]
#
# Defaults: SIZE 256MiB, RATE 400mbit, VERSIONS 4 (version 1 is the connect; versions 2.. are
# timed), BUCKET the transport's default bucket size. Needs root and
# scripts/netns-hosts (NETNS_HOSTS overrides it), and a release build of the example
# (cargo build --release --example multi_node).
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
size=${1:-256MiB}; rate=${2:-400mbit}; versions=${3:-4}; bucket=${4:-}
# the transport's default unless a bucket size is given
bucket_arg=(); [ -z "$bucket" ] || bucket_arg=(--bucket-size "$bucket")
. "$here/examples/scripts/netns-lib.sh"
exe=$(example_exe multi_node "${MULTI_NODE:-}")
for n in 1 2 3 4; do
  "$nh" up $((n + 1)) "$rate" >/dev/null
  world=$((n + 1))
  "$nh" run 1 env RANK=0 WORLD_SIZE=$world MASTER_ADDR=10.77.0.1 MASTER_PORT=29500 \
    "$exe" trainer --bind 10.77.0.1:29500 --no-spawn --workers "$n" --versions "$versions" \
    --size "$size" "${bucket_arg[@]}" >"$log/trainer-$n" 2>&1 &
  trainer=$!
  # the workers reach the trainer's store once it listens
  for _ in $(seq 100); do grep -q "serving the store" "$log/trainer-$n" && break; sleep 0.1; done
  pids=()
  for rank in $(seq 1 "$n"); do
    h=$((rank + 1))
    "$nh" run $h env RANK=$rank WORLD_SIZE=$world MASTER_ADDR=10.77.0.1 MASTER_PORT=29500 \
      "$exe" --delta off --size "$size" "${bucket_arg[@]}" worker --bind 10.77.0.$h:29501 \
      >"$log/worker-$n-$rank" 2>&1 &
    pids+=($!)
  done
  wait_round "$n" "$trainer" "${pids[@]}"
  record_round "$n"
done
echo "fan-out of $size, egress $rate per host, buckets of ${bucket:-the default size} (median per version):"
print_medians 1 2 3 4
