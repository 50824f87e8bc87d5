#!/usr/bin/env bash
# Where a burst's time goes below Ray, on the lent GPU in one device call (a diagnostic):
#   carry .gpu/activate.sh .gpu/mlx-cuda.tar.xz .gpu/ray-extra.tar.xz .gpu/py-spy.xz; run: bash bench/gpu_burst_probe.sh
# 1. bench.engine_burst (EngineCore alone) and bench.service_burst (ModelService: tokenization, event loop,
#    coalescing; GIL and event-loop stall meters), same model and machine;
# 2. the same FastAPI app on uvicorn without Ray (bench.run_orchard_local) under bench.serving's bursts, with
#    py-spy (GIL holders, then busy threads) over them. Writes $OUT/burst_probe.tgz and $OUT/burst_probe.txt.
set -u
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
source bench/gpu_diag_setup.sh burst_probe 70   # OUT, WORK, SHAPE, MODEL, VOCAB; packs WORK on exit
SUMMARY="$OUT/burst_probe.txt"
SPY="/tmp/py-spy record --nonblocking -r 250 --threads -f raw"
if [ "${ENGINE:-1}" = 1 ]; then
  timeout 150 python3 -m bench.engine_burst --random-shape "$SHAPE" --prompt-tokens 517 --warmup-seconds 30 \
    --json "$WORK/engine_burst.json" > "$WORK/engine_burst.log" 2>&1
  echo "== engine_burst: $(grep -h '"ratio"\|lone_ttft_ms\|burst_ttft_p95_ms' "$WORK/engine_burst.log" | tr -d '\n ')" | tee -a "$SUMMARY"
fi
timeout 200 python3 -m bench.service_burst --random-shape "$SHAPE" --bursts "${BURSTS:-3}" --json "$WORK/service_burst.json" \
  2>&1 | grep -v "^INFO\|^WARN" | tail -5 | tee -a "$SUMMARY"
python3 -m bench.run_orchard_local --model "$MODEL" --port 8123 --model-arg prefill_warmup_seconds=30 > "$WORK/local.log" 2>&1 &
SERVER=$!
for _ in $(seq 1 240); do grep -q "ORCHARD READY\|failed" "$WORK/local.log" && break; sleep 1; done
LOAD="python3 -m bench.serving --base-url http://127.0.0.1:8123 --model m --ignore-eos --vocab-size $VOCAB --workloads burst"
echo "== no Ray, uvicorn" | tee -a "$SUMMARY"
for i in 1 2; do $LOAD --json "$WORK/local_burst$i.json" --time-budget-s 30 2>&1 | grep "burst   c=" | tee -a "$SUMMARY"; done
(for i in 1 2 3; do $LOAD --json "$WORK/local_spy$i.json" --time-budget-s 30 2>&1 | grep "burst   c="; done) > "$WORK/spy_bursts.log" &
LOADER=$!
sleep 1
$SPY --gil -d 8 -p "$SERVER" -o "$WORK/local_burst_gil.raw" > /dev/null 2>&1
wait $LOADER; tee -a "$SUMMARY" < "$WORK/spy_bursts.log"
(for i in 1 2 3; do $LOAD --json "$WORK/local_spyb$i.json" --time-budget-s 30 2>&1 | grep "burst   c="; done) > "$WORK/spy_bursts_b.log" &
LOADER=$!
sleep 1
$SPY -d 8 -p "$SERVER" -o "$WORK/local_burst_busy.raw" > /dev/null 2>&1
wait $LOADER; tee -a "$SUMMARY" < "$WORK/spy_bursts_b.log"
kill -INT $SERVER; wait $SERVER
