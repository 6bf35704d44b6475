# Shared by the netns scripts (sourced once `here` names the repository root): the
# netns-hosts tool, a cluster token for every process, a log directory, and a cleanup that
# stops what the script started and removes the hosts whatever happens.
nh=${NETNS_HOSTS:-$here/scripts/netns-hosts}
export REFIT_TOKEN=${REFIT_TOKEN:-$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')}
log=$(mktemp -d)
# Every process still inside one of the hosts (a rank the script's jobs started outlives
# them: deleting a namespace does not stop what runs in it).
host_pids() { ip netns list 2>/dev/null | awk '/^rfh[0-9]/ {print $1}' | while read -r h; do ip netns pids "$h" 2>/dev/null; done; }
cleanup() {
  jobs -p | xargs -r kill 2>/dev/null || true
  host_pids | xargs -r kill 2>/dev/null || true
  for _ in 1 2 3 4 5 6 7 8 9 10; do [ -z "$(host_pids)" ] && break; sleep 0.2; done
  host_pids | xargs -r kill -9 2>/dev/null || true
  "$nh" down >/dev/null 2>&1 || true
  rm -rf "$log"
}
trap cleanup EXIT
# The release build of example $1 (or the path in $2 when set); fails saying how to build it.
example_exe() {
  local exe=${2:-$here/target/release/examples/$1}
  [ -x "$exe" ] || { echo "build it first: cargo build --release --example $1" >&2; return 1; }
  echo "$exe"
}
declare -A median
# Waits for the trainer (pid $2) and the other processes (the rest) of round $1 (its logs:
# $log/NAME-$1 and $log/NAME-$1-*); on a failure prints the round's logs and exits.
wait_round() {
  local n=$1 trainer=$2; shift 2
  local logs=("$log"/*-"$n" "$log"/*-"$n"-*)
  if ! wait "$trainer"; then cat "${logs[@]}" >&2; exit 1; fi
  for p in "$@"; do wait "$p" || { cat "${logs[@]}" >&2; exit 1; }; done
}
# Prints the trainer's timings of round $1, records its median, removes the hosts.
record_round() {
  grep -E "acknowledged|median" "$log/trainer-$1" | sed "s/^/N=$1 /"
  median[$1]=$(sed -n 's/^trainer: median \([0-9.]*\) s.*/\1/p' "$log/trainer-$1")
  "$nh" down >/dev/null
}
# Prints each round's median (rounds named in the arguments) and its ratio to the first.
print_medians() {
  local first=$1
  for n in "$@"; do
    awk -v n="$n" -v t="${median[$n]}" -v b="${median[$first]}" \
      'BEGIN { printf "  N=%d  %.3f s  %.2fx N=1\n", n, t, t / b }'
  done
}
