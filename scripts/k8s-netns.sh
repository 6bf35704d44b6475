#!/usr/bin/env bash
# The pods of a Kubernetes manifest of Refit ranks (default examples/kubernetes/cartpole.yaml:
# a headless Service and a StatefulSet) on simulated hosts, without Kubernetes: pod i runs
# on host i+1 (a network namespace from scripts/netns-hosts) with the environment and the
# command the manifest gives it (scripts/k8s-manifest.py pod: HOSTNAME and the downward
# API's pod name and namespace, the token of the Secret, the rest as written), and its
# Service DNS names (POD.SERVICE, POD.SERVICE.default.svc) resolve there to the hosts'
# addresses. `refit` is this build's, and the ConfigMap's topology file is the repository's
# examples/topologies/ copy. The manifest is checked first (scripts/k8s-manifest.py check).
# It stops what it started and removes the hosts whatever happens, and exits with rank 0's
# status.
#
#   scripts/k8s-netns.sh [MANIFEST.yaml] [-- ARGS...]
#
# ARGS go after the pods' command (`-- --set stop.max_updates=50`). Needs root, PyYAML and a
# build of refit and of the program the topology runs (REFIT names refit; default
# target/release/refit):
#   cargo build --release --example cartpole --bin refit
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
refit=${REFIT:-$here/target/release/refit}
manifest=examples/kubernetes/cartpole.yaml
if [ $# -gt 0 ] && [ "$1" != -- ]; then manifest=$1; shift; fi
[ "${1:-}" = -- ] && shift
extra=("$@")
[ -x "$refit" ] || { echo "k8s-netns: build first: $refit is missing" >&2; exit 1; }
python3 scripts/k8s-manifest.py check "$manifest" >/dev/null
n=$(python3 scripts/k8s-manifest.py replicas "$manifest")
# netns-hosts, the cluster token (REFIT_TOKEN, in the Secret's place), a log directory and
# a cleanup that stops what this script started and removes the hosts whatever happens
. "$here/examples/scripts/netns-lib.sh"
pids=()
"$nh" up "$n" >/dev/null
# each pod's Service DNS names, in every host's /etc/hosts
names=""
for i in $(seq 0 $((n - 1))); do
  mapfile -t pod < <(python3 scripts/k8s-manifest.py pod "$manifest" "$i")
  host=${pod[0]#HOSTNAME=}
  svc=$(printf '%s\n' "${pod[@]}" | sed -n 's/^REFIT_K8S_SERVICE=//p')
  names+="10.77.0.$((i + 1)) $host.$svc $host.$svc.default.svc"$'\n'
done
for i in $(seq 1 "$n"); do printf '%s' "$names" >>"/etc/netns/rfh$i/hosts"; done

start() { # pod index
  local i=$1 env=() cmd=() seen=""
  mapfile -t lines < <(python3 scripts/k8s-manifest.py pod "$manifest" "$i")
  for l in "${lines[@]}"; do
    if [ "$l" = -- ]; then seen=1; continue; fi
    if [ -z "$seen" ]; then
      env+=("${l/#REFIT_TOKEN=<secret>/REFIT_TOKEN=$REFIT_TOKEN}")
    else
      cmd+=("$l")
    fi
  done
  # this build's refit, the repository's copy of the ConfigMap's file
  [ "${cmd[0]}" = refit ] && cmd[0]=$refit
  cmd[2]=examples/topologies/$(basename "${cmd[2]}")
  "$nh" run $((i + 1)) env -i PATH="$PATH" "${env[@]}" "${cmd[@]}" "${extra[@]}" \
    >"$log/pod$i" 2>&1
}
for i in $(seq 0 $((n - 1))); do
  start "$i" &
  pids+=($!)
done
status=0
wait "${pids[0]}" || status=$?
for p in "${pids[@]:1}"; do wait "$p" || status=$((status ? status : $?)); done
for i in $(seq 0 $((n - 1))); do
  echo "== pod $i (host 10.77.0.$((i + 1)))"
  cat "$log/pod$i"
done
exit "$status"
