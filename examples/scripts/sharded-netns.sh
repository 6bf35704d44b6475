#!/usr/bin/env bash
# A trainer sharded across two simulated hosts, as `refit launch` runs it
# (examples/topologies/cartpole-sharded-hosts.toml: rank 0 on host 1, the shards on hosts 2
# and 3, the engine on host 4), every host's egress limited to RATE and the policy's hidden
# layers HIDDEN units wide. Runs it twice in sync mode, with links.sharded = "gather" (shard
# 1 sends its half to shard 0, whose uplink carries the whole model to the engine) and
# "mesh" (each shard publishes its half, the engine pulls both at once), with small updates
# (one epoch over 32 frames: the weights' way is what differs), and prints the
# median wall time per update (the time between the controller's update lines: rollouts,
# training, the weights' way to the engine and its load) of each and their ratio:
#
#   sharded 2 hosts, hidden H, egress RATE: gather <s>; mesh <s>; ratio <mesh/gather>
#
#   examples/scripts/sharded-netns.sh [HIDDEN [RATE [UPDATES]]]
#
# Defaults: HIDDEN 2048 (a 17 MB policy and critic), RATE 400mbit, UPDATES 6 (the first
# update's time, which includes the connect, is left out). Needs root, scripts/netns-hosts
# (NETNS_HOSTS overrides it) and release builds of refit and the cartpole example
# (cargo build --release --example cartpole --bin refit; REFIT and CARTPOLE override them).
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
hidden=${1:-2048}; rate=${2:-400mbit}; updates=${3:-6}
. "$here/examples/scripts/netns-lib.sh"
cd "$here"
exe=$(example_exe cartpole "${CARTPOLE:-}")
refit=${REFIT:-$here/target/release/refit}
[ -x "$refit" ] || { echo "build it first: cargo build --release --bin refit" >&2; exit 1; }
topo=examples/topologies/cartpole-sharded-hosts.toml
# seconds of the day of each controller update line ("policy vN: ..."), then the median of
# the gaps between them after the first
per_update() {
  grep -E 'run::lead: policy v[0-9]+: ' "$1" \
    | sed -E 's/.*T([0-9]+):([0-9]+):([0-9.]+)Z.*/\1 \2 \3/' \
    | awk '{ t = $1 * 3600 + $2 * 60 + $3; if (n++ > 1) print t - p; p = t }' \
    | sort -n | awk '{ g[++k] = $1 } END {
        if (!k) { print "nan"; exit }
        print (k % 2) ? g[(k + 1) / 2] : (g[k / 2] + g[k / 2 + 1]) / 2 }'
}
declare -A took
for mode in gather mesh; do
  "$nh" up 4 "$rate" >/dev/null
  pids=()
  for rank in 0 1 2 3; do
    "$nh" run $((rank + 1)) env RANK=$rank WORLD_SIZE=4 MASTER_ADDR=10.77.0.1 MASTER_PORT=29500 \
      "$refit" launch "$topo" --set "run.command=[\"$exe\", \"topology\"]" \
      --set "links.sharded=$mode" --set sync.sync_mode=sync \
      --set "model.policy.params.hidden=[$hidden, $hidden]" --set "stop.max_updates=$updates" \
      --set model.policy.params.epochs=1 --set model.policy.params.minibatch=32 \
      --set model.policy.params.batch_frames=32 --set model.policy.params.envs_per_worker=1 \
      --set model.policy.params.fragment_steps=16 --set process.actor.rollout_workers=1 \
      --set stop.target_return=1000000.0 >"$log/$mode-$rank" 2>&1 &
    pids+=($!)
    [ "$rank" = 0 ] && sleep 0.5
  done
  for p in "${pids[@]}"; do wait "$p" || true; done
  if ! grep -q "solved: policy" "$log/$mode-0"; then cat "$log/$mode"-* >&2; exit 1; fi
  took[$mode]=$(per_update "$log/$mode-0")
  echo "links.sharded = $mode: $(grep -h 'weights' "$log/$mode-3" | grep -oE '(over|from) .*' | head -1)"
  grep -h "stopped; engine" "$log/$mode-3" | sed 's/.*: stopped/  engine: stopped/'
  "$nh" down >/dev/null
done
awk -v h="$hidden" -v r="$rate" -v g="${took[gather]}" -v m="${took[mesh]}" 'BEGIN {
  printf "sharded 2 hosts, hidden %s, egress %s: gather %.3f s; mesh %.3f s; ratio %.3f\n", h, r, g, m, m / g }'
