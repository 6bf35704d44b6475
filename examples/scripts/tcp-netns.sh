#!/usr/bin/env bash
# A steady TCP update across two simulated hosts against the fastest raw stream of the same
# bytes between the same hosts: the multi_node trainer on host 1 publishes versions of a
# SIZE model to one worker on host 2 (every byte moves: the worker asks for full versions),
# then a plain Python program streams SIZE bytes from host 1 to host 2 over one connection
# and over four at once (each round ends when the reader has every byte and answers one).
# Each host's egress is limited to RATE (`off`: no limit). Prints the median of each and
# their ratio to the faster raw stream:
#
#   tcp 1->1 SIZE at RATE: update <time>; raw stream <time> (<streams>); ratio <update/raw>
#
#   examples/scripts/tcp-netns.sh [SIZE [RATE [VERSIONS]]]
#
# Defaults: SIZE 512MiB, RATE 2gbit, VERSIONS 6 (version 1 is the connect, untimed; the raw
# streams run VERSIONS - 1 rounds each). Needs root, python3 and scripts/netns-hosts
# (NETNS_HOSTS overrides it), and a release build of the example
# (cargo build --release --example multi_node; MULTI_NODE overrides the path).
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
size=${1:-512MiB}; rate=${2:-2gbit}; versions=${3:-6}
. "$here/examples/scripts/netns-lib.sh"
exe=$(example_exe multi_node "${MULTI_NODE:-}")
bytes=$(python3 -c "
import re, sys
m = re.fullmatch(r'(\d+)\s*(KiB|MiB|GiB)?', sys.argv[1])
if not m: sys.exit('SIZE: a number of bytes, KiB, MiB or GiB')
print(int(m[1]) << {None: 0, 'KiB': 10, 'MiB': 20, 'GiB': 30}[m[2]])" "$size")
rounds=$((versions - 1))
[ "$rounds" -ge 1 ] || { echo "VERSIONS: at least 2 (the first is the connect)" >&2; exit 1; }
if [ "$rate" = off ]; then "$nh" up 2 >/dev/null; else "$nh" up 2 "$rate" >/dev/null; fi

"$nh" run 1 env RANK=0 WORLD_SIZE=2 MASTER_ADDR=10.77.0.1 MASTER_PORT=29500 \
  "$exe" trainer --bind 10.77.0.1:29500 --no-spawn --workers 1 --versions "$versions" \
  --size "$size" >"$log/trainer-1" 2>&1 &
trainer=$!
# the worker reaches the trainer's store once it listens
for _ in $(seq 100); do grep -q "serving the store" "$log/trainer-1" && break; sleep 0.1; done
"$nh" run 2 env RANK=1 WORLD_SIZE=2 MASTER_ADDR=10.77.0.1 MASTER_PORT=29500 \
  "$exe" --delta off --size "$size" worker --bind 10.77.0.2:29501 >"$log/worker-1-1" 2>&1 &
worker=$!
wait_round 1 "$trainer" "$worker"
grep -E "acknowledged|median" "$log/trainer-1"
update=$(sed -n 's/^trainer: median \([0-9.]*\) s.*/\1/p' "$log/trainer-1")

# the raw streams: a reader on host 2, a writer on host 1, `streams` connections at once,
# each carrying its share of the bytes; a round ends when every reader answered. Either
# side fails (and the other is stopped) on an error of any of its connections, and
# neither waits more than 60 s for the other to make progress.
raw() {
  local streams=$1 port=$2
  "$nh" run 2 python3 - "$bytes" "$rounds" "$streams" "$port" <<'EOF' &
import socket, sys, threading
size, rounds, streams, port = map(int, sys.argv[1:])
listener = socket.create_server(("10.77.0.2", port), backlog=streams)
listener.settimeout(60)
conns = [listener.accept()[0] for _ in range(streams)]
failed = []

def read(c, share):
    try:
        c.settimeout(60)
        buf = memoryview(bytearray(min(share, 4 << 20) or 1))
        for _ in range(rounds):
            left = share
            while left:
                n = c.recv_into(buf[:min(left, len(buf))])
                if not n:
                    raise ConnectionError("the writer closed early")
                left -= n
            c.sendall(b"k")
    except Exception as e:
        failed.append(e)

shares = [size // streams + (i < size % streams) for i in range(streams)]
threads = [threading.Thread(target=read, args=(c, s)) for c, s in zip(conns, shares)]
for t in threads:
    t.start()
for t in threads:
    t.join()
if failed:
    sys.exit(f"raw stream reader: {failed[0]!r}")
EOF
  local reader=$!
  "$nh" run 1 python3 - "$bytes" "$rounds" "$streams" "$port" <<'EOF' || { kill "$reader" 2>/dev/null; wait "$reader" 2>/dev/null; return 1; }
import socket, statistics, sys, threading, time
size, rounds, streams, port = map(int, sys.argv[1:])
for _ in range(100):
    try:
        conns = [socket.create_connection(("10.77.0.2", port), timeout=60) for _ in range(streams)]
        break
    except ConnectionRefusedError:
        time.sleep(0.1)
else:
    sys.exit(f"raw stream writer: nothing listens at 10.77.0.2:{port}")
shares = [size // streams + (i < size % streams) for i in range(streams)]
data = [memoryview(bytearray(s)) for s in shares]
failed = []

def write(c, d):
    try:
        # 4 MiB at a time: a socket's timeout bounds each call, not the round
        for at in range(0, len(d), 4 << 20):
            c.sendall(d[at:at + (4 << 20)])
        if c.recv(1) != b"k":
            raise ConnectionError("the reader did not answer")
    except Exception as e:
        failed.append(e)

times = []
for _ in range(rounds):
    start = time.perf_counter()
    threads = [threading.Thread(target=write, args=(c, d)) for c, d in zip(conns, data)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed:
        sys.exit(f"raw stream writer: {failed[0]!r}")
    times.append(time.perf_counter() - start)
# the upper median, as the trainer's
print(f"{statistics.median_high(times):.3f}")
EOF
  wait "$reader"
}
one=$(raw 1 29701)
four=$(raw 4 29702)
echo "raw stream, 1 connection: median $one s; 4 connections: median $four s"
python3 - "$size" "$rate" "$update" "$one" "$four" <<'EOF'
import sys
size, rate, update, one, four = sys.argv[1], sys.argv[2], *map(float, sys.argv[3:])
raw, streams = (one, "1 connection") if one <= four else (four, "4 connections")
print(f"tcp 1->1 {size} at {rate}: update {update:.3f} s; raw stream {raw:.3f} s ({streams}); "
      f"ratio {update / raw:.2f}")
EOF
