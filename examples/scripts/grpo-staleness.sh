#!/usr/bin/env bash
# GRPO on digit reversal through `refit launch` (examples/topologies/grpo-processes.toml)
# at maximum staleness 0, 1, 2 and 4, with the importance correction (the clipped ratio
# against the engines' behaviour log-probabilities) and without it (the ratio against the
# learner's own policy at the start of the update), a few seeds each. Prints one markdown
# row per run: the held-out reward at the start and the end, updates, wall time, the
# measured staleness of the trained completions, and the held-out reward by wall time.
#
#   cargo build --release --example grpo --bin refit
#   examples/scripts/grpo-staleness.sh [seeds=3]
#
# Staleness 0 is `sync` mode (every completion from the version that trains on it). For
# k > 0 rollouts never wait (`fully-async`), the trajectory pool buffers k + 1 batches and
# the trainer takes the oldest first, so completions are up to k versions old when they
# train; older ones are dropped (`max_staleness = k`). The measured staleness is how far
# behind the completions actually were (the engines' pace against the trainer's sets it).
set -euo pipefail
cd "$(dirname "$0")/../.."
seeds=${1:-3}
refit=target/release/refit
topo=examples/topologies/grpo-processes.toml
[ -x "$refit" ] && [ -x target/release/examples/grpo ] || {
  echo "build first: cargo build --release --example grpo --bin refit" >&2
  exit 1
}
log=$(mktemp)
trap 'rm -f "$log"' EXIT
echo "| max staleness | correction | seed | held-out start -> end | updates | wall s | mean staleness | held-out reward by wall time |"
echo "|---|---|---|---|---|---|---|---|"
for k in 0 1 2 4; do
  if [ "$k" = 0 ]; then
    mode=(--set sync.sync_mode=sync)
  else
    mode=(--set sync.sync_mode=fully-async --set "sync.max_staleness=$k"
      --set "sync.max_buffered_batches=$((k + 1))")
  fi
  for correction in behaviour ignore; do
    for seed in $(seq 0 $((seeds - 1))); do
      "$refit" launch "$topo" "${mode[@]}" --set "run.seed=$seed" \
        --set "model.policy.params.correction=$correction" >"$log" 2>&1 || true
      solved=$(grep -o 'held-out reward (greedy) [0-9.]* -> [0-9.]* in [0-9]* updates, [0-9.]* s wall' "$log" | tail -1 || true)
      curve=$(grep -o 'held-out reward (greedy) by wall time: .*' "$log" | tail -1 | sed 's/held-out reward (greedy) by wall time: //' || true)
      stale=$(grep -o 'oldest token.s version): mean [0-9.]*' "$log" | tail -1 | grep -o '[0-9.]*$' || true)
      if [ -z "$solved" ]; then
        echo "| $k | $correction | $seed | (no report: see a run's output) | | | | |"
        continue
      fi
      read -r start end updates wall <<<"$(echo "$solved" | sed -E 's/held-out reward \(greedy\) ([0-9.]*) -> ([0-9.]*) in ([0-9]*) updates, ([0-9.]*) s wall/\1 \2 \3 \4/')"
      echo "| $k | $correction | $seed | $start -> $end | $updates | $wall | $stale | $curve |"
    done
  done
done
