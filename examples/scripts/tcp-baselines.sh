#!/usr/bin/env bash
# Raw loopback TCP three ways in one invocation, so the baseline `refit bench` divides by can
# be checked against simple programs on the same loopback: a plain Python loop between two
# processes (sendall of 4 MiB chunks, recv_into a 4 MiB buffer), then `refit bench`'s pull
# section (its tuned baseline, the chunk sizes it tried, iperf3 timed in alternate rounds
# with it where installed, a stream into a new file, `refit pull` served from memory and
# `refit serve FILE` + `refit pull` as processes), then the Python loop again, so load that
# changed during the run shows. Every figure printed is measured here.
#
#   examples/scripts/tcp-baselines.sh [SIZE [ROUNDS [PULL_DIR]]]
#
# Defaults: SIZE 1GiB, ROUNDS 5, PULL_DIR /dev/shm. Needs python3 and a release build of
# refit (cargo build --release; REFIT overrides the path); iperf3 where installed (Debian:
# apt-get install iperf3).
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
size=${1:-1GiB}; rounds=${2:-5}; pull_dir=${3:-/dev/shm}
refit=${REFIT:-$here/target/release/refit}
[ -x "$refit" ] || { echo "no refit binary at $refit: cargo build --release" >&2; exit 1; }
bytes=$(python3 -c "
import re, sys
m = re.fullmatch(r'(\d+)\s*(KiB|MiB|GiB)?', sys.argv[1])
if not m: sys.exit('SIZE: a number of bytes, KiB, MiB or GiB')
print(int(m[1]) << {None: 0, 'KiB': 10, 'MiB': 20, 'GiB': 30}[m[2]])" "$size")

python_loop() {
  python3 - "$bytes" "$rounds" <<'EOF'
import socket, statistics, subprocess, sys, time
size, rounds = int(sys.argv[1]), int(sys.argv[2])
CHUNK = 4 << 20
reader = r'''
import socket, sys
size, rounds, port = map(int, sys.argv[1:])
s = socket.create_connection(("127.0.0.1", port))
buf = memoryview(bytearray(4 << 20))
for _ in range(rounds):
    left = size
    while left:
        n = s.recv_into(buf[:min(left, len(buf))])
        if not n: sys.exit("the sender closed early")
        left -= n
    s.sendall(b"\x01")
'''
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen(1)
child = subprocess.Popen([sys.executable, "-c", reader, str(size), str(rounds + 1),
                          str(srv.getsockname()[1])])
conn, _ = srv.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
chunk = memoryview(bytes([3]) * CHUNK)
times = []
for i in range(rounds + 1):
    t = time.perf_counter()
    left = size
    while left:
        n = min(left, CHUNK)
        conn.sendall(chunk[:n])
        left -= n
    conn.recv(1)
    if i:
        times.append(time.perf_counter() - t)
child.wait()
print(f"python sendall/recv_into 4M/4M  median {statistics.median(times) * 1e3:.1f} ms  "
      f"min {min(times) * 1e3:.1f}  max {max(times) * 1e3:.1f}  "
      f"({size / statistics.median(times) / 1e9:.2f} GB/s, {rounds} rounds after one untimed)")
EOF
}

echo "$(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git -C "$here" rev-parse --short HEAD)," \
  "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores," \
  "Linux $(uname -r); $(command -v iperf3 >/dev/null && iperf3 --version | head -1 || echo 'no iperf3')"
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "== a plain Python loop, $size"
python_loop
echo "== refit bench, pull section ($size into $pull_dir)"
"$refit" bench --transports tcp --max-size 4MiB --receivers 1 --strategies-size 0 \
  --connect-runs 1 --iters "$rounds" --pull-size "$size" --pull-dir "$pull_dir" 2>/dev/null |
  awk 'NR == 1 || /^(tcp-loopback|iperf3|new |refit )/ && !/  4 MiB /'
echo "== the plain Python loop again"
python_loop
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
