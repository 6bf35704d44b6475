#!/usr/bin/env bash
# Many trainer shards to many engines across simulated hosts, against one sender's relay
# chain to the same engines. M sender hosts each hold the rows of every tensor of a SIZE
# model that their shard owns, N receiver hosts each serve a tensor-parallel slice (its
# columns); every host's egress is limited to RATE. Then the multi_node trainer on one host
# sends the whole model to N workers down its relay chain. Prints the median time per
# version of each, and their ratio:
#
#   mesh M->N SIZE: <time>; chain 1->N: <time>; ratio <mesh/chain>
#
#   examples/scripts/mesh-netns.sh [SIZE [M [N [RATE [VERSIONS]]]]]
#
# Defaults: SIZE 256MiB, M 4, N 4, RATE 400mbit, VERSIONS 4 (the chain's version 1 is its
# connect, untimed; the mesh times every version). Needs root and scripts/netns-hosts
# (NETNS_HOSTS overrides it), and release builds of the examples
# (cargo build --release --example mesh --example multi_node).
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
size=${1:-256MiB}; m=${2:-4}; n=${3:-4}; rate=${4:-400mbit}; versions=${5:-4}
. "$here/examples/scripts/netns-lib.sh"
mesh=$(example_exe mesh "${MESH:-}")
chain=$(example_exe multi_node "${MULTI_NODE:-}")
world=$((m + n))

"$nh" up "$world" "$rate" >/dev/null
pids=()
for rank in $(seq 0 $((world - 1))); do
  h=$((rank + 1))
  "$nh" run $h env RANK=$rank WORLD_SIZE=$world MASTER_ADDR=10.77.0.1 MASTER_PORT=29500 \
    "$mesh" --no-spawn --senders "$m" --receivers "$n" --size "$size" --versions "$versions" \
    --bind 10.77.0.$h:29500 >"$log/mesh-1-$rank" 2>&1 &
  pids+=($!)
  # the others reach rank 0's store once it listens
  [ "$rank" = 0 ] && sleep 0.5
done
for p in "${pids[@]}"; do wait "$p" || { cat "$log"/mesh-1-* >&2; exit 1; }; done
grep -h "mesh" "$log/mesh-1-0" "$log"/mesh-1-$m | sed 's/^/  /'
mesh_median=$(sed -n 's/^mesh: median \([0-9.]*\) s.*/\1/p' "$log/mesh-1-0")
"$nh" down >/dev/null

"$nh" up $((n + 1)) "$rate" >/dev/null
"$nh" run 1 env RANK=0 WORLD_SIZE=$((n + 1)) MASTER_ADDR=10.77.0.1 MASTER_PORT=29500 \
  "$chain" trainer --bind 10.77.0.1:29500 --no-spawn --workers "$n" --versions "$versions" \
  --size "$size" >"$log/trainer-2" 2>&1 &
trainer=$!
for _ in $(seq 100); do grep -q "serving the store" "$log/trainer-2" && break; sleep 0.1; done
pids=()
for rank in $(seq 1 "$n"); do
  h=$((rank + 1))
  "$nh" run $h env RANK=$rank WORLD_SIZE=$((n + 1)) MASTER_ADDR=10.77.0.1 MASTER_PORT=29500 \
    "$chain" --delta off --size "$size" worker --bind 10.77.0.$h:29501 >"$log/worker-2-$rank" 2>&1 &
  pids+=($!)
done
wait_round 2 "$trainer" "${pids[@]}"
grep -h "median" "$log/trainer-2" | sed 's/^/  chain /'
chain_median=$(sed -n 's/^trainer: median \([0-9.]*\) s.*/\1/p' "$log/trainer-2")
"$nh" down >/dev/null

awk -v m="$m" -v n="$n" -v s="$size" -v a="$mesh_median" -v b="$chain_median" 'BEGIN {
  printf "mesh %d->%d %s: %.3f s; chain 1->%d: %.3f s; ratio %.3f\n", m, n, s, a, n, b, a / b }'
