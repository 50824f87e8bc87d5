#!/usr/bin/env bash
# Give one model's engine process a CPU of its own (a diagnostic: do the other processes, on the CPU's SMT sibling
# or the same core, slow the engine's Python-bound steps?):
#   bash bench/pin_engine.sh MODEL_ID      # prints "pinned engine PID to CPU N; others to LIST"
# The engine process of MODEL_ID's replica goes to the last CPU; every other Ray process and engine process to
# the CPUs that share no core with it. Start later load generators with `taskset -c "$(bash bench/pin_engine.sh
# --rest)"` so they stay off it too.
set -euo pipefail
last=$(( $(nproc --all) - 1 ))
siblings=$(cat "/sys/devices/system/cpu/cpu$last/topology/thread_siblings_list" 2>/dev/null || echo "$last")
rest=$(python3 - "$last" "$siblings" <<'PY'
import sys
last, siblings = int(sys.argv[1]), sys.argv[2]
taken = set()
for part in siblings.split(","):
    lo, _, hi = part.partition("-")
    taken.update(range(int(lo), int(hi or lo) + 1))
print(",".join(str(c) for c in range(last + 1) if c not in taken))
PY
)
if [ "${1:-}" = "--rest" ]; then echo "$rest"; exit 0; fi
model="$1"
replica=$(pgrep -f "ServeReplica:${model}:ModelServer" | head -1)
engine=$(pgrep -P "$replica" -f engine.engine_child | head -1)
for pid in $(pgrep -f "ray::|raylet|gcs_server|engine.engine_child|run_orchard_server|dashboard"); do
  [ "$pid" = "$engine" ] && continue
  taskset -a -pc "$rest" "$pid" > /dev/null 2>&1 || true
done
taskset -a -pc "$last" "$engine" > /dev/null
echo "pinned engine $engine (replica $replica) to CPU $last (siblings $siblings); others to $rest"
