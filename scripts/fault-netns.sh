#!/usr/bin/env bash
# Faults on simulated hosts: the three-host CartPole topology (examples/topologies/
# cartpole-hosts.toml: rank 0 on host 1, one engine rank on hosts 2 and 3) started once per
# host with `refit launch` in its per-rank mode, as a cluster scheduler would; after a few
# updates one host's link goes down (its veth on the bridge: no packet in or out, no
# connection closed), and the script measures how long each rank takes to notice and end,
# and checks what each says.
#
#   scripts/fault-netns.sh partition-lead     # host 1 (rank 0) cut off
#   scripts/fault-netns.sh partition-engine   # host 3 (rank 2, an engine) cut off
#
# It exits 1 when a rank does not end within BOUND_S seconds (default 30) of the cut, or
# ends without naming the fault. It prints one line per rank: `rank R: ended T s after the
# cut (status S)`. Needs root, scripts/netns-hosts (NETNS_HOSTS overrides it) and a build of
# refit and of the CartPole example (REFIT, PROGRAM; default the debug builds):
#   cargo build --example cartpole --bin refit
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
fault=${1:?partition-lead or partition-engine}
refit=${REFIT:-$here/target/debug/refit}
program=${PROGRAM:-$here/target/debug/examples/cartpole}
bound=${BOUND_S:-30}
topo=examples/topologies/cartpole-hosts.toml
case "$fault" in
  partition-lead) cut=1 ;;
  partition-engine) cut=3 ;;
  *) echo "fault-netns: unknown fault \`$fault\` (partition-lead, partition-engine)" >&2; exit 2 ;;
esac
for f in "$refit" "$program"; do
  [ -x "$f" ] || { echo "fault-netns: build first: $f is missing (cargo build --example cartpole --bin refit)" >&2; exit 1; }
done
# netns-hosts, a cluster token, a log directory and a cleanup that removes the hosts
# shellcheck source=../examples/scripts/netns-lib.sh
source "$here/examples/scripts/netns-lib.sh"
"$nh" up 3 >/dev/null
launch() { # rank: runs it, then writes its status and end time
  local status=0
  "$nh" run $(($1 + 1)) env RANK="$1" WORLD_SIZE=3 MASTER_ADDR=10.77.0.1 MASTER_PORT=29500 \
    "$refit" launch "$topo" --set "run.command=[\"$program\",\"topology\"]" \
    --set stop.max_updates=100000 --set stop.target_return=100000 --set stop.max_time_s=600 \
    >"$log/rank$1" 2>&1 || status=$?
  echo "$status $(date +%s.%N)" >"$log/end$1"
}
for r in 0 1 2; do
  launch "$r" &
done
# a few updates first: the run is under way when the link goes down
for _ in $(seq 1 600); do
  grep -q "policy v4:" "$log/rank0" 2>/dev/null && break
  if [ -e "$log/end0" ]; then cat "$log/rank0"; echo "fault-netns: rank 0 ended before the fault"; exit 1; fi
  sleep 0.2
done
grep -q "policy v4:" "$log/rank0" || { cat "$log/rank0"; echo "fault-netns: no update in 120 s"; exit 1; }
ip link set "rfv$cut" down
t0=$(date +%s.%N)
echo "fault-netns: $fault: host $cut's link is down"
deadline=$(echo "$t0 + $bound" | bc)
for r in 0 1 2; do
  while [ ! -e "$log/end$r" ] && [ "$(echo "$(date +%s.%N) < $deadline" | bc)" = 1 ]; do sleep 0.1; done
done
failed=0
for r in 0 1 2; do
  if [ -e "$log/end$r" ]; then
    read -r status at <"$log/end$r"
    printf 'rank %s: ended %.1f s after the cut (status %s)\n' "$r" "$(echo "$at - $t0" | bc)" "$status"
  else
    echo "rank $r: still running $bound s after the cut"
    failed=1
  fi
done
# what each rank must have said
must() { # rank, text
  grep -qF -- "$2" "$log/rank$1" || { echo "rank $1 did not say: $2"; failed=1; }
}
case "$fault" in
  partition-lead)
    must 1 "rank 0 is gone"
    must 2 "rank 0 is gone"
    ;;
  partition-engine)
    must 0 "rank 2"
    must 2 "rank 0 is gone"
    ;;
esac
if [ "$failed" != 0 ]; then
  for r in 0 1 2; do echo "== rank $r"; tail -n 30 "$log/rank$r"; done
  exit 1
fi
for r in 0 1 2; do echo "== rank $r: its last lines"; tail -n 4 "$log/rank$r"; done
