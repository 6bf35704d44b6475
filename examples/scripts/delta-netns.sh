#!/usr/bin/env bash
# Element-level deltas across a slow link: the multi_node trainer on host 1 and one worker
# on host 2, each host's egress limited to RATE, every version changing 2% of the elements
# of every tensor (--sparse). Runs once with bucket deltas (the default: every bucket holds
# a changed element, so every byte moves) and once with element-level deltas, and prints
# the median time until the worker acknowledged a version in each mode and their ratio.
#
#   examples/scripts/delta-netns.sh [SIZE [RATE [VERSIONS]]]
#
# Defaults: SIZE 64MiB, RATE 400mbit, VERSIONS 4 (version 1 is the connect, whole; versions
# 2.. are timed). Needs root and scripts/netns-hosts (NETNS_HOSTS overrides it), and a
# release build of the example (cargo build --release --example multi_node).
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
size=${1:-64MiB}; rate=${2:-400mbit}; versions=${3:-4}
. "$here/examples/scripts/netns-lib.sh"
exe=$(example_exe multi_node "${MULTI_NODE:-}")
round=0
for mode in buckets elements; do
  round=$((round + 1))
  "$nh" up 2 "$rate" >/dev/null
  "$nh" run 1 env RANK=0 WORLD_SIZE=2 MASTER_ADDR=10.77.0.1 MASTER_PORT=29500 \
    "$exe" trainer --bind 10.77.0.1:29500 --no-spawn --workers 1 --versions "$versions" \
    --size "$size" --sparse >"$log/trainer-$round" 2>&1 &
  trainer=$!
  for _ in $(seq 100); do grep -q "serving the store" "$log/trainer-$round" && break; sleep 0.1; done
  "$nh" run 2 env RANK=1 WORLD_SIZE=2 MASTER_ADDR=10.77.0.1 MASTER_PORT=29500 \
    "$exe" --delta "$mode" --size "$size" worker --bind 10.77.0.2:29501 \
    >"$log/worker-$round-1" 2>&1 &
  wait_round "$round" "$trainer" $!
  echo "delta = $mode:"
  record_round "$round"
done
awk -v b="${median[1]}" -v e="${median[2]}" -v s="$size" -v r="$rate" 'BEGIN {
  printf "delta %s, 2%% of elements changed, egress %s: buckets %.3f s; elements %.3f s; ratio %.3f\n", s, r, b, e, e / b }'
