#!/usr/bin/env bash
# Server variants side by side on one lent GPU machine, in one device call (a diagnostic, not the sweep):
#   VARIANTS='head|;head|--throughput-optimized;.gpu/other.tar.xz|' bash bench/gpu_server_ab.sh
# A variant is SOURCE|FLAGS: SOURCE "head" (this checkout) or an xz tarball of another source tree (e.g.
# `git archive REV | xz > .gpu/rev.txz`, carried along; not *.tar.xz, which .gpu/activate.sh unpacks into its site); FLAGS go to bench.run_orchard_server. Each variant
# serves the same random model in turn: BURSTS bursts of 32 x 512-token prompts, then 64 uniform streams, with
# the CPU seconds of the proxy, the ingress and the model replica over each (bench.proc_cpu). The in-process
# engine at 64 streams runs once first. FLAGS holding --no-ray serve with bench.run_orchard_local (no Ray) instead. Writes $OUT/server_ab.txt and $OUT/server_ab.tgz (JSON and logs).
# Env: SHAPE (default qwen3-0.6b), BURSTS (5, per stagger), BURST_STAGGERS (ms between a burst's requests,
# a list: "0"), UNIFORM (1: also the in-process engine and the 64-stream runs), WARMUP_S (model-entry prefill_warmup_seconds, 15;
# trees from 56dc888 on accept it).
set -u
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
source bench/gpu_diag_setup.sh server_ab   # OUT, WORK, SHAPE, MODEL, VOCAB; packs WORK on exit
HEAD_DIR="$PWD"
SUMMARY="$OUT/server_ab.txt"
if [ "${UNIFORM:-1}" = 1 ]; then
  timeout 80 python3 -m bench.engine_baseline --model "$MODEL" --levels 64,64 --json "$WORK/inprocess.json" \
    > "$WORK/inprocess.log" 2>&1
  { echo "== in-process engine"; grep -h "c=64" "$WORK/inprocess.log"; } | tee -a "$SUMMARY"
fi

run_variant() {  # $1 index, $2 source, $3 flags
  local dir="$HEAD_DIR" tag="v$1"
  if [ "$2" != "head" ]; then
    dir="$WORK/src_$1"; mkdir -p "$dir"; xz -dc "$HEAD_DIR/$2" | tar -x -C "$dir"
  fi
  echo "== $tag: $2 $3" | tee -a "$SUMMARY"
  local module=bench.run_orchard_server flags="$3"
  if [[ " $flags " == *" --no-ray "* ]]; then module=bench.run_orchard_local; flags="${flags//--no-ray/}"; fi
  # shellcheck disable=SC2086
  # PYTHONPATH names the variant's tree first: Ray's workers and the engine child import from it too.
  (cd "$dir" && PYTHONPATH="$dir:$PYTHONPATH" exec python3 -m $module --model "$MODEL" --port 8123 --model-arg "prefill_warmup_seconds=${WARMUP_S:-15}" $flags) \
    > "$WORK/${tag}_server.log" 2>&1 &
  local server=$!
  for _ in $(seq 1 240); do grep -q "ORCHARD READY\|orchard server failed" "$WORK/${tag}_server.log" && break; sleep 1; done
  grep -h "ORCHARD READY\|orchard server failed" "$WORK/${tag}_server.log" | tee -a "$SUMMARY"
  local load="python3 -m bench.serving --base-url http://127.0.0.1:8123 --model m --ignore-eos --vocab-size $VOCAB"
  for stagger in ${BURST_STAGGERS:-0}; do
    echo "-- bursts sent ${stagger} ms apart" | tee -a "$SUMMARY"
    for i in $(seq 1 "${BURSTS:-5}"); do
      # A seed per burst: repeated prompts would hit the prefix cache from the second burst on.
      python3 -m bench.proc_cpu -- $load --workloads burst --seed "$i$stagger" --burst-stagger-ms "$stagger" --time-budget-s 30 \
        --json "$WORK/${tag}_burst_s${stagger}_$i.json" 2>&1 | grep "burst   c=\|proc_cpu" | tee -a "$SUMMARY"
    done
  done
  if [ "${UNIFORM:-1}" = 1 ]; then
    python3 -m bench.proc_cpu -- $load --levels 64 --workloads uniform --requests-per-worker-high 5 \
      --json "$WORK/${tag}_uniform64.json" --time-budget-s 60 2>&1 | grep "c=64\|engine:\|proc_cpu" | tee -a "$SUMMARY"
  fi
  kill -INT "$server"; wait "$server"
  [ "$module" = bench.run_orchard_local ] && return
  for log in /tmp/ray/session_latest/logs/serve/replica_{m,orchard}_*.log; do
    tail -c 300000 "$log" > "$WORK/${tag}_$(basename "$log")"
  done
  python3 -m bench.arrival_spread "$WORK/${tag}"_replica_m_*.log --ingress-logs "$WORK/${tag}"_replica_orchard_*.log \
    2>&1 | tail -20 | tee -a "$SUMMARY"
}

IFS=';' read -r -a variants <<< "${VARIANTS:-head|}"
for i in "${!variants[@]}"; do
  run_variant "$i" "${variants[$i]%%|*}" "${variants[$i]#*|}"
done
