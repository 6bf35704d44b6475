#!/usr/bin/env bash
# Fan-out across simulated hosts: the multi_node trainer on host 1 and N workers on hosts
# 2..N+1, every host's egress limited to RATE, for N = 1..4. Prints, for each N, the median
# time until every worker acknowledged a version, and its ratio to N = 1.
#
#   examples/scripts/fanout-netns.sh [SIZE [RATE [VERSIONS [BUCKET]]]]
#
# Defaults: SIZE 256MiB, RATE 400mbit, VERSIONS 4 (version 1 is the connect; versions 2.. are
# timed), BUCKET 4MiB. Needs root and ../shared/tools/netns-hosts (NETNS_HOSTS overrides it),
# and a release build of the example (cargo build --release --example multi_node).
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
size=${1:-256MiB}; rate=${2:-400mbit}; versions=${3:-4}; bucket=${4:-4MiB}
nh=${NETNS_HOSTS:-$here/../shared/tools/netns-hosts}
exe=${MULTI_NODE:-$here/target/release/examples/multi_node}
[ -x "$exe" ] || { echo "build it first: cargo build --release --example multi_node" >&2; exit 1; }
export REFIT_TOKEN=${REFIT_TOKEN:-$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')}
log=$(mktemp -d)
cleanup() { jobs -p | xargs -r kill 2>/dev/null || true; "$nh" down >/dev/null 2>&1 || true; rm -rf "$log"; }
trap cleanup EXIT
declare -A median
for n in 1 2 3 4; do
  "$nh" up $((n + 1)) "$rate" >/dev/null
  world=$((n + 1))
  "$nh" run 1 env RANK=0 WORLD_SIZE=$world MASTER_ADDR=10.77.0.1 MASTER_PORT=29500 \
    "$exe" trainer --bind 10.77.0.1:29500 --no-spawn --workers "$n" --versions "$versions" \
    --size "$size" --bucket-size "$bucket" >"$log/trainer-$n" 2>&1 &
  trainer=$!
  # the workers reach the trainer's store once it listens
  for _ in $(seq 100); do grep -q "serving the store" "$log/trainer-$n" && break; sleep 0.1; done
  pids=()
  for rank in $(seq 1 "$n"); do
    h=$((rank + 1))
    "$nh" run $h env RANK=$rank WORLD_SIZE=$world MASTER_ADDR=10.77.0.1 MASTER_PORT=29500 \
      "$exe" --full --size "$size" --bucket-size "$bucket" worker --bind 10.77.0.$h:29501 \
      >"$log/worker-$n-$rank" 2>&1 &
    pids+=($!)
  done
  if ! wait "$trainer"; then cat "$log/trainer-$n" "$log"/worker-$n-* >&2; exit 1; fi
  for p in "${pids[@]}"; do wait "$p" || { cat "$log"/worker-$n-* >&2; exit 1; }; done
  grep -E "acknowledged|median" "$log/trainer-$n" | sed "s/^/N=$n /"
  median[$n]=$(sed -n 's/^trainer: median \([0-9.]*\) s.*/\1/p' "$log/trainer-$n")
  "$nh" down >/dev/null
done
echo "fan-out of $size, egress $rate per host, buckets of $bucket (median per version):"
for n in 1 2 3 4; do
  awk -v n=$n -v t="${median[$n]}" -v b="${median[1]}" \
    'BEGIN { printf "  N=%d  %.3f s  %.2fx N=1\n", n, t, t / b }'
done
