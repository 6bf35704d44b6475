#!/usr/bin/env bash
# Faults on simulated hosts: the three-host CartPole topology (examples/topologies/
# cartpole-hosts.toml: rank 0 on host 1, one engine rank on hosts 2 and 3) started once per
# host with `refit launch` in its per-rank mode, as a cluster scheduler would; after a few
# updates one host fails, and the script measures how long each other rank takes to notice
# and end, and checks what each says.
#
#   scripts/fault-netns.sh partition-lead     # host 1 (rank 0) cut off
#   scripts/fault-netns.sh partition-engine   # host 3 (rank 2, an engine) cut off
#   scripts/fault-netns.sh freeze-lead        # rank 0 frozen
#   scripts/fault-netns.sh freeze-engine      # rank 2 (an engine) frozen
#
# A partition takes the host's link down (its veth on the bridge: no packet in or out, no
# connection closed). A freeze SIGSTOPs the rank's processes (its `refit launch` and every
# process below it): they answer nothing, but their connections stay open and their kernel
# still acknowledges what arrives. Once the other ranks ended, the frozen rank is thawed
# (SIGCONT) and must end by itself, its peers gone.
#
# It exits 1 when a rank does not end within BOUND_S seconds (default 30) of the fault (a
# frozen rank: of its thaw), or ends without naming the fault. It prints one line per rank:
# `rank R: ended T s after the cut (status S)` (`after the freeze`, and for the frozen rank
# `after the thaw`). Whatever happens, no process is left stopped or running and the hosts
# are removed; FAULT_LOGS=DIR keeps each rank's log, as DIR/rankR. Needs root,
# scripts/netns-hosts (NETNS_HOSTS overrides it) and a build of refit and of the CartPole
# example (REFIT, PROGRAM; default the debug builds):
#   cargo build --example cartpole --bin refit
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
fault=${1:?partition-lead, partition-engine, freeze-lead or freeze-engine}
refit=${REFIT:-$here/target/debug/refit}
program=${PROGRAM:-$here/target/debug/examples/cartpole}
bound=${BOUND_S:-30}
topo=examples/topologies/cartpole-hosts.toml
case "$fault" in
  partition-lead) kind=partition host=1 ;;
  partition-engine) kind=partition host=3 ;;
  freeze-lead) kind=freeze host=1 ;;
  freeze-engine) kind=freeze host=3 ;;
  *) echo "fault-netns: unknown fault \`$fault\` (partition-lead, partition-engine, freeze-lead, freeze-engine)" >&2
     exit 2 ;;
esac
hit=$((host - 1)) # the rank on the failed host
for f in "$refit" "$program"; do
  [ -x "$f" ] || { echo "fault-netns: build first: $f is missing (cargo build --example cartpole --bin refit)" >&2; exit 1; }
done
# netns-hosts, a cluster token, a log directory and a cleanup that removes the hosts
# shellcheck source=../examples/scripts/netns-lib.sh
source "$here/examples/scripts/netns-lib.sh"
# A process and every process below it, parents first.
tree() {
  local c
  kill -0 "$1" 2>/dev/null || return 0
  echo "$1"
  for c in $(ps -o pid= --ppid "$1" 2>/dev/null); do tree "$c"; done
}
# Before the lib's cleanup (which stops the script's jobs and removes the hosts): every
# rank still alive (a frozen one thawed first) is ended, so no process is left stopped or
# running in a removed host.
stop_ranks() {
  local r pids
  set +e # whatever fails here, the hosts are still removed
  for r in 0 1 2; do
    [ -e "$log/pid$r" ] || continue
    pids=$(tree "$(cat "$log/pid$r")")
    kill -CONT $pids 2>/dev/null || true
    kill -TERM $pids 2>/dev/null || true
  done
  for _ in $(seq 1 50); do
    pids=$(for r in 0 1 2; do [ ! -e "$log/pid$r" ] || tree "$(cat "$log/pid$r")"; done)
    [ -z "$pids" ] && break
    sleep 0.1
  done
  [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
  [ -z "${FAULT_LOGS:-}" ] || { mkdir -p "$FAULT_LOGS"; cp "$log"/rank? "$FAULT_LOGS"/ 2>/dev/null || true; }
  cleanup
}
trap stop_ranks EXIT
"$nh" up 3 >/dev/null
launch() { # rank: runs it, then writes its status and end time
  local status=0
  "$nh" run $(($1 + 1)) env RANK="$1" WORLD_SIZE=3 MASTER_ADDR=10.77.0.1 MASTER_PORT=29500 \
    "$refit" launch "$topo" --set "run.command=[\"$program\",\"topology\"]" \
    --set stop.max_updates=100000 --set stop.target_return=100000 --set stop.max_time_s=600 \
    >"$log/rank$1" 2>&1 &
  # netns-hosts execs `ip netns exec`, which execs env, which execs refit: this is the
  # rank's launcher
  echo $! >"$log/pid$1"
  wait $! || status=$?
  rm -f "$log/pid$1"
  echo "$status $(date +%s.%N)" >"$log/end$1"
}
for r in 0 1 2; do
  launch "$r" &
done
# a few updates first: the run is under way when the fault comes
for _ in $(seq 1 600); do
  grep -q "policy v4:" "$log/rank0" 2>/dev/null && break
  if [ -e "$log/end0" ]; then cat "$log/rank0"; echo "fault-netns: rank 0 ended before the fault"; exit 1; fi
  sleep 0.2
done
grep -q "policy v4:" "$log/rank0" || { cat "$log/rank0"; echo "fault-netns: no update in 120 s"; exit 1; }
case "$kind" in
  partition)
    ip link set "rfv$host" down
    t0=$(date +%s.%N)
    what=cut
    echo "fault-netns: $fault: host $host's link is down"
    ;;
  freeze)
    # parents first: a stopped process starts no new one, so its children are all listed
    frozen=()
    stop_tree() {
      local c
      kill -STOP "$1" 2>/dev/null || return 0
      frozen+=("$1")
      for c in $(ps -o pid= --ppid "$1"); do stop_tree "$c"; done
    }
    [ -e "$log/pid$hit" ] || { cat "$log/rank$hit"; echo "fault-netns: rank $hit ended before the fault"; exit 1; }
    stop_tree "$(cat "$log/pid$hit")"
    t0=$(date +%s.%N)
    what=freeze
    echo "fault-netns: $fault: rank $hit frozen:" \
      "$(for p in "${frozen[@]}"; do printf '%s (%s) ' "$p" "$(ps -o comm= -p "$p")"; done)"
    # every process of its host is frozen
    for p in $(ip netns pids "rfh$host"); do
      [[ " ${frozen[*]} " == *" $p "* ]] || { echo "fault-netns: process $p of host $host is not frozen"; exit 1; }
    done
    ;;
esac
others=()
for r in 0 1 2; do
  [ "$kind" = freeze ] && [ "$r" = "$hit" ] && continue
  others+=("$r")
done
# waits until rank $1 ended or until $2 (date +%s.%N)
wait_end() {
  while [ ! -e "$log/end$1" ] && [ "$(echo "$(date +%s.%N) < $2" | bc)" = 1 ]; do sleep 0.1; done
}
for r in "${others[@]}"; do wait_end "$r" "$(echo "$t0 + $bound" | bc)"; done
if [ "$kind" = freeze ]; then
  # the others ended (or the bound passed): the frozen rank thaws and must end by itself
  kill -CONT "${frozen[@]}" 2>/dev/null || true
  t1=$(date +%s.%N)
  echo "fault-netns: rank $hit thawed $(printf '%.1f' "$(echo "$t1 - $t0" | bc)") s after the freeze"
  wait_end "$hit" "$(echo "$t1 + $bound" | bc)"
fi
failed=0
for r in 0 1 2; do
  since=$t0 after=$what
  [ "$kind" = freeze ] && [ "$r" = "$hit" ] && since=$t1 after=thaw
  if [ -e "$log/end$r" ]; then
    read -r status at <"$log/end$r"
    printf 'rank %s: ended %.1f s after the %s (status %s)\n' "$r" "$(echo "$at - $since" | bc)" "$after" "$status"
  else
    echo "rank $r: still running $bound s after the $after"
    failed=1
  fi
done
# what each rank must have said
must() { # rank, text
  grep -qF -- "$2" "$log/rank$1" || { echo "rank $1 did not say: $2"; failed=1; }
}
must_match() { # rank, extended regular expression
  grep -qE -- "$2" "$log/rank$1" || { echo "rank $1 said nothing that matches: $2"; failed=1; }
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
  # a frozen rank is found out by the keepalive (its connections stay open); thawed, it
  # finds its peers gone
  freeze-lead)
    must 1 "rank 0 is gone: it answered no ping"
    must 2 "rank 0 is gone: it answered no ping"
    must_match 0 "rank [12] \(process .*\) is gone"
    ;;
  freeze-engine)
    must_match 0 "rank 2 \(process .*\) is gone \(it answered no ping"
    must 2 "rank 0 is gone"
    ;;
esac
if [ "$failed" != 0 ]; then
  for r in 0 1 2; do echo "== rank $r"; tail -n 30 "$log/rank$r"; done
  exit 1
fi
for r in 0 1 2; do echo "== rank $r: its last lines"; tail -n 4 "$log/rank$r"; done
