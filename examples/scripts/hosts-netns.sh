#!/usr/bin/env bash
# A three-host topology on three simulated hosts (network namespaces at 10.77.0.1..3):
# the file (default examples/topologies/cartpole-hosts.toml; examples/topologies/
# grpo-hosts.toml is the generating one) started once per host with `refit launch` in its
# per-rank mode (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and one REFIT_TOKEN), as a
# cluster scheduler would. Rank 0 (the learner, host 1) prints the progress and the report;
# the engines' output follows it.
#
#   examples/scripts/hosts-netns.sh [TOPOLOGY.toml] [SYNC_MODE]
#
# Needs root, scripts/netns-hosts (NETNS_HOSTS overrides it) and a release build of
# the program the file runs and of refit:
#   cargo build --release --example cartpole --example grpo --bin refit
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
cd "$here"
topo=${1:-examples/topologies/cartpole-hosts.toml}
mode=${2:-}
refit=${REFIT:-$here/target/release/refit}
program=$(sed -n 's/^command = \["\([^"]*\)".*/\1/p' "$topo" | head -1)
for f in "$refit" "$program"; do
  [ -x "$f" ] || { echo "build first: $f is missing (cargo build --release --example ... --bin refit)" >&2; exit 1; }
done
set_mode=()
[ -n "$mode" ] && set_mode=(--set "sync.sync_mode=$mode")
# netns-hosts, the cluster token, a log directory and a cleanup that stops what this
# script started and removes the hosts whatever happens
. "$here/examples/scripts/netns-lib.sh"
pids=()
"$nh" up 3
launch() { # rank
  "$nh" run $(($1 + 1)) env RANK="$1" WORLD_SIZE=3 MASTER_ADDR=10.77.0.1 MASTER_PORT=29500 \
    "$refit" launch "$topo" "${set_mode[@]}" >"$log/rank$1" 2>&1
}
launch 0 & rank0=$!
pids+=("$rank0")
launch 1 & pids+=($!)
launch 2 & pids+=($!)
status=0
wait "$rank0" || status=$?
for p in "${pids[@]:1}"; do wait "$p" || status=$((status ? status : $?)); done
for r in 0 1 2; do
  echo "== rank $r (host 10.77.0.$((r + 1)))"
  cat "$log/rank$r"
done
exit "$status"
