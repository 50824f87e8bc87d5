#!/usr/bin/env bash
# py-spy profiles of our server's model replica on the lent GPU, in one device call (a diagnostic, not a benchmark):
#   xz -9e -c "$(command -v py-spy)" > .gpu/py-spy.xz      # here, once (py-spy from pip in the dev venv)
#   carry .gpu/activate.sh .gpu/mlx-cuda.tar.xz .gpu/ray-extra.tar.xz .gpu/py-spy.xz; run: bash bench/gpu_replica_profile.sh
# Records, on the Qwen3-0.6B shape: the in-process engine at 64 streams; the replica under uniform load at 64 streams
# (GIL holders, then all busy threads); the replica and the ingress (GIL holders) during bursts of 32. Writes one
# $OUT/replica_profile.tgz (the device returns at most 8 files): raw profiles, their bench.pyspy_summary tables, the
# load results and the replica's log (request start/finish times). Env: SHAPE (default qwen3-0.6b), OUT.
set -u
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
source bench/gpu_diag_setup.sh replica_profile   # OUT, WORK, SHAPE, MODEL, VOCAB, /tmp/py-spy; packs WORK on exit
SPY="/tmp/py-spy record --nonblocking -r 200 --threads -f raw"   # --nonblocking: the process is never paused
timeout 60 python3 -m bench.decode_probe --random-shape "$SHAPE" --rows 64 > "$WORK/decode_probe.log" 2>&1
timeout 120 $SPY -o "$WORK/inprocess64.raw" -- python3 -m bench.engine_baseline --model "$MODEL" --levels 64,64 \
  --json "$WORK/inprocess.json" > "$WORK/inprocess.log" 2>&1
python3 -m bench.run_orchard_server --model "$MODEL" --port 8123 --decode-batch 128 > "$WORK/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 1 240); do grep -q "ORCHARD READY" "$WORK/server.log" && break; sleep 1; done
REPLICA=$(pgrep -f "ServeReplica:m:ModelServer" | head -1)
INGRESS=$(pgrep -f "ServeReplica:orchard:" | head -1)
echo "replica pid ${REPLICA:-?}, ingress pid ${INGRESS:-?}"
LOAD="python3 -m bench.serving --base-url http://127.0.0.1:8123 --model m --ignore-eos --vocab-size $VOCAB"
$LOAD --levels 64 --workloads uniform --requests-per-worker-high 5 --json "$WORK/uniform64.json" --time-budget-s 60 \
  > "$WORK/uniform64.log" 2>&1 &
LOADER=$!
sleep 5
$SPY --gil -d 4 -p "$REPLICA" -o "$WORK/replica64_gil.raw" > /dev/null 2>&1
$SPY -d 4 -p "$REPLICA" -o "$WORK/replica64_busy.raw" > /dev/null 2>&1
wait $LOADER
(for i in 1 2 3 4 5; do $LOAD --workloads burst --json "$WORK/burst$i.json" --time-budget-s 30 2>&1 | grep "burst   c="; done) \
  > "$WORK/bursts.log" &
LOADER=$!
sleep 3
$SPY --gil -d 15 -p "$REPLICA" -o "$WORK/replica_burst_gil.raw" > /dev/null 2>&1 &
SPY_REPLICA=$!
$SPY --gil -d 15 -p "$INGRESS" -o "$WORK/ingress_burst_gil.raw" > /dev/null 2>&1 &
SPY_INGRESS=$!
wait $LOADER $SPY_REPLICA $SPY_INGRESS
cat "$WORK/bursts.log"; grep -h "c=64" "$WORK/inprocess.log" "$WORK/uniform64.log"
for log in /tmp/ray/session_latest/logs/serve/replica_m_*.log; do tail -c 400000 "$log" > "$WORK/$(basename "$log")"; done
kill -INT $SERVER; wait $SERVER
