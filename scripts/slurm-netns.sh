#!/usr/bin/env bash
# A real Slurm cluster of three hosts on this machine: three simulated hosts (network
# namespaces h1..h3 at 10.77.0.1..3, from scripts/netns-hosts), a private munged, slurmctld
# on the machine (10.77.0.254) and one slurmd per host. It runs COMMAND against that cluster
# (SLURM_CONF set), then stops every daemon, removes the hosts and its files, whatever
# happened, and exits with COMMAND's status.
#
#   scripts/slurm-netns.sh [COMMAND...]
#
# Default COMMAND: sbatch --wait examples/slurm/cartpole.sbatch (the book's Slurm example:
# CartPole with PPO over three hosts; build it first with
# `cargo build --release --example cartpole --bin refit`). Jobs run as root, in the current
# directory; a batch job's output goes to the temporary directory (SBATCH_OUTPUT) and is
# printed when COMMAND ends.
#
# Needs root (ip, tc) and Debian's Slurm and munge:
#   apt-get install --no-install-recommends slurm-wlm munge
# Nothing of the machine's own Slurm or munge is used or touched: the key, the socket, the
# configuration, the state and the logs live in a temporary directory; the ports are 16817
# (slurmctld, on the machine) and 16818 (each slurmd, in its host).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
nh=${NETNS_HOSTS:-$here/scripts/netns-hosts}
n=3
[ "$(id -u)" = 0 ] || { echo "slurm-netns: needs root (network namespaces, slurmd)" >&2; exit 1; }
for b in munged slurmctld slurmd sbatch srun scontrol sinfo ip; do
  command -v "$b" >/dev/null || {
    echo "slurm-netns: $b is missing: apt-get install --no-install-recommends slurm-wlm munge" >&2
    exit 1
  }
done
[ $# -gt 0 ] || set -- sbatch --wait examples/slurm/cartpole.sbatch

dir=$(mktemp -d /tmp/refit-slurm.XXXXXX)
chmod 755 "$dir"
daemons=()
cleanup() {
  set +e
  # the daemons first (slurmd, then slurmctld, then munged), each by the pid it was started
  # with; then whatever is left in the hosts (a job step still running), by pid
  for ((i = ${#daemons[@]} - 1; i >= 0; i--)); do kill "${daemons[i]}" 2>/dev/null; done
  for p in "${daemons[@]}"; do
    for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$p" 2>/dev/null
  done
  for i in $(seq 1 "$n"); do
    ip netns pids "rfh$i" 2>/dev/null | xargs -r kill -9 2>/dev/null
  done
  wait 2>/dev/null
  "$nh" down >/dev/null 2>&1
  rm -rf "$dir"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

"$nh" up "$n" >/dev/null
# the hosts reach the machine's other addresses (where srun listens) through the bridge
for i in $(seq 1 "$n"); do ip -n "rfh$i" route add default via 10.77.0.254; done

# munge: a private key and socket
head -c 1024 /dev/urandom >"$dir/munge.key"
chmod 400 "$dir/munge.key"
munged --foreground --force --socket="$dir/munge.sock" --key-file="$dir/munge.key" \
  --pid-file="$dir/munged.pid" --log-file="$dir/munged.log" --seed-file="$dir/munged.seed" \
  >/dev/null 2>&1 &
daemons+=($!)

mkdir -p "$dir/state"
for i in $(seq 1 "$n"); do mkdir -p "$dir/spool/h$i"; done
export SLURM_CONF=$dir/slurm.conf
cat >"$SLURM_CONF" <<EOF
ClusterName=refit
SlurmctldHost=$(hostname -s)(10.77.0.254)
SlurmctldPort=16817
SlurmdPort=16818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge.sock
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/linear
ReturnToService=2
KillWait=5
MailProg=/bin/true
NodeName=h[1-$n] NodeAddr=10.77.0.[1-$n] CPUs=1 State=UNKNOWN
PartitionName=hosts Nodes=h[1-$n] Default=YES MaxTime=30 State=UP
EOF
# no cgroups: the hosts' /sys (mounted anew by `ip netns exec`) holds none, and
# proctrack/linuxproc with task/none need none
cat >"$dir/cgroup.conf" <<EOF
CgroupPlugin=cgroup/v1
CgroupAutomount=no
EOF

for _ in $(seq 50); do [ -S "$dir/munge.sock" ] && break; sleep 0.1; done
slurmctld -D -i -f "$SLURM_CONF" >/dev/null 2>&1 &
daemons+=($!)
for i in $(seq 1 "$n"); do
  "$nh" run "$i" slurmd -D -N "h$i" -f "$SLURM_CONF" >/dev/null 2>&1 &
  daemons+=($!)
done

# every node up (idle) within 30 s
up=""
for _ in $(seq 150); do
  states=$(sinfo -h -N -o '%N %t' 2>/dev/null || true)
  if [ "$(grep -c ' idle$' <<<"$states")" = "$n" ]; then up=1; break; fi
  sleep 0.2
done
if [ -z "$up" ]; then
  echo "slurm-netns: the nodes did not come up within 30 s:" >&2
  sinfo -N >&2 || true
  tail -n 20 "$dir"/*.log >&2 || true
  exit 1
fi
echo "slurm-netns: nodes h1..h$n up (10.77.0.1..$n), slurmctld at 10.77.0.254:16817"

export SBATCH_OUTPUT=$dir/slurm-%j.out
status=0
"$@" || status=$?
for f in "$dir"/slurm-*.out; do
  [ -f "$f" ] || continue
  echo "== $(basename "$f")"
  cat "$f"
done
if [ "$status" != 0 ]; then
  echo "slurm-netns: \`$*\` exited with status $status; the daemons' logs:" >&2
  tail -n 30 "$dir"/slurm*.log >&2 || true
fi
exit "$status"
