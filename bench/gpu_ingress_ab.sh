#!/usr/bin/env bash
# Ray Serve's direct ingress (RAY_SERVE_ENABLE_DIRECT_INGRESS=1: the ingress replica serves HTTP itself) against the
# proxy path, in ONE server, alternating rounds (a diagnostic). Rounds: uniform 64 streams (3 waves, per-process CPU)
# and a burst of 32 x 512-token prompts, through the proxy (port 8123) and straight to the ingress replica's port.
# CONTENTION=1 first runs bench.contention_probe (in-process engine steps with 0 / 3 / 6 busy Python processes beside).
# Writes $OUT/ingress_ab.txt and $OUT/ingress_ab.tgz.
set -u
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
source bench/gpu_diag_setup.sh ingress_ab
SUMMARY="$OUT/ingress_ab.txt"
if [ "${CONTENTION:-1}" = 1 ]; then
  echo "== in-process engine, c=64, with busy processes beside" | tee -a "$SUMMARY"
  python3 -m bench.contention_probe --model "$MODEL" --rounds "${CONTENTION_ROUNDS:-2}" --json "$WORK/contention.json" \
    --log "$WORK/contention_engine.log" 2>&1 | grep "burners" | tee -a "$SUMMARY"
fi
python3 -m bench.run_orchard_server --model "$MODEL" --model-id m --port 8123 \
  --model-arg "prefill_warmup_seconds=${WARMUP_S:-15}" --serve-env RAY_SERVE_ENABLE_DIRECT_INGRESS=1 ${SERVER_FLAGS:-} \
  > "$WORK/server.log" 2>&1 &
server=$!
for _ in $(seq 1 300); do grep -q "ORCHARD READY\|orchard server failed" "$WORK/server.log" && break; sleep 1; done
grep -h "ORCHARD READY\|orchard server failed" "$WORK/server.log" | tee -a "$SUMMARY"
direct=$(python3 - <<'PY'
import urllib.request
for port in range(30000, 30011):  # Serve's direct ingress ports; the model replicas get some too (not ASGI apps)
    try:
        if b'"object":"list"' in urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=3).read():
            print(port)
            break
    except Exception:
        pass
PY
)
echo "direct ingress port: ${direct:-none}" | tee -a "$SUMMARY"
ss -ltnp > "$WORK/listeners.txt" 2>&1
measure() {  # $1 label, $2 port, $3 round
  local load="python3 -m bench.serving --base-url http://127.0.0.1:$2 --model m --ignore-eos --vocab-size $VOCAB"
  python3 -m bench.proc_cpu -- $load --levels 64 --workloads uniform --requests-per-worker-high 3 \
    --json "$WORK/$1_uniform_$3.json" --time-budget-s 40 2>&1 | grep "c=64\|proc_cpu" | sed "s/^/$1 /" | tee -a "$SUMMARY"
  # A seed per round: repeated prompts would hit the prefix cache from the second round on.
  $load --workloads burst --seed "$3" --time-budget-s 30 --json "$WORK/$1_burst_$3.json" 2>&1 \
    | grep "burst   c=" | sed "s/^/$1 /" | tee -a "$SUMMARY"
}
for round in $(seq 1 "${ROUNDS:-3}"); do
  echo "-- round $round" | tee -a "$SUMMARY"
  if [ $((round % 2)) = 1 ]; then measure proxy 8123 "$round"; [ -n "$direct" ] && measure direct "$direct" "$round"
  else [ -n "$direct" ] && measure direct "$direct" "$round"; measure proxy 8123 "$round"; fi
done
kill -INT "$server"; wait "$server"
python3 -m bench.ab_summary "$WORK" proxy direct | tee -a "$SUMMARY"
