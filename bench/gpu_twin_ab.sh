#!/usr/bin/env bash
# Two variants of one model entry in ONE server, measured in alternating rounds (a diagnostic): the lent
# machines drift by up to 30% between consecutive minutes, so variants measured in turn in separate servers
# cannot be told apart by less. Model "m" gets MODEL_ARGS, "m-twin" the same entry with TWIN_ARGS changed:
#   MODEL_ARGS="engine_process=false" TWIN_ARGS="engine_process=true" bash bench/gpu_twin_ab.sh
# Each round: uniform 64 streams on m then on m-twin, then a burst of 32 x 512-token prompts on each
# (ROUNDS, default 4; the order flips every round). SERVER_FLAGS go to bench.run_orchard_server. PIN_TWIN_ENGINE=1
# gives m-twin's engine process a core of its own (bench/pin_engine.sh; with both models' args equal, an A/B of
# the pinning). Writes
# $OUT/twin_ab.txt (summary lines: bench/ab_summary.py) and $OUT/twin_ab.tgz (JSON, logs, per-process CPU).
set -u
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
source bench/gpu_diag_setup.sh twin_ab   # OUT, WORK, SHAPE, MODEL, VOCAB; packs WORK on exit
SUMMARY="$OUT/twin_ab.txt"
model_args=(); for a in ${MODEL_ARGS:-}; do model_args+=(--model-arg "$a"); done
twin_args=(--twin-arg "prefill_warmup_seconds=${WARMUP_S:-15}"); for a in ${TWIN_ARGS:-}; do twin_args+=(--twin-arg "$a"); done
echo "== m: ${MODEL_ARGS:-} | m-twin: ${TWIN_ARGS:-} | server: ${SERVER_FLAGS:-}" | tee -a "$SUMMARY"
# shellcheck disable=SC2086
python3 -m bench.run_orchard_server --model "$MODEL" --model-id m --port 8123 \
  --model-arg "prefill_warmup_seconds=${WARMUP_S:-15}" "${model_args[@]}" "${twin_args[@]}" ${SERVER_FLAGS:-} \
  > "$WORK/server.log" 2>&1 &
server=$!
for _ in $(seq 1 300); do grep -q "ORCHARD READY\|orchard server failed" "$WORK/server.log" && break; sleep 1; done
grep -h "ORCHARD READY\|orchard server failed" "$WORK/server.log" | tee -a "$SUMMARY"
lscpu > "$WORK/lscpu.txt" 2>&1
pin=""
if [ "${PIN_TWIN_ENGINE:-0}" = 1 ]; then  # m-twin's engine process alone on a core (bench/pin_engine.sh)
  bash bench/pin_engine.sh m-twin 2>&1 | tee -a "$SUMMARY"
  pin="taskset -c $(bash bench/pin_engine.sh --rest)"
fi
load="$pin python3 -m bench.serving --base-url http://127.0.0.1:8123 --ignore-eos --vocab-size $VOCAB"
measure() {  # $1 model id, $2 round
  python3 -m bench.proc_cpu -- $load --model "$1" --levels 64 --workloads uniform --requests-per-worker-high 3 \
    --json "$WORK/$1_uniform_$2.json" --time-budget-s 40 2>&1 | grep "c=64\|proc_cpu" | sed "s/^/$1 /" | tee -a "$SUMMARY"
  # A seed per round: repeated prompts would hit the model's prefix cache from the second round on.
  $load --model "$1" --workloads burst --seed "$2" --time-budget-s 30 --json "$WORK/$1_burst_$2.json" 2>&1 \
    | grep "burst   c=" | sed "s/^/$1 /" | tee -a "$SUMMARY"
}
for round in $(seq 1 "${ROUNDS:-4}"); do
  echo "-- round $round" | tee -a "$SUMMARY"
  if [ $((round % 2)) = 1 ]; then measure m "$round"; measure m-twin "$round"
  else measure m-twin "$round"; measure m "$round"; fi
done
kill -INT "$server"; wait "$server"
python3 -m bench.ab_summary "$WORK" m m-twin | tee -a "$SUMMARY"
