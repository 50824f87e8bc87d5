#!/usr/bin/env bash
# In-process burst A/B of engine trees on the lent GPU, in one device call (no HTTP, no Ray):
#   carry .gpu (activate.sh, mlx-cuda.tar.xz, REV.txz); run:
#   BASE=.gpu/base-REV.txz ROUNDS=2 bash bench/gpu_engine_burst_ab.sh
# Each round runs, base tree then this one: bench.engine_burst (32 x 517 tokens, sent 2 ms apart) and
# bench.service_burst --engine-thread (ModelService's intake, timed steps). The base tree is unpacked from a
# `git archive REV engine deployments bench | xz` and put first on PYTHONPATH. Writes $OUT/engine_burst_ab.txt and
# the JSON reports.
set -u
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
source .gpu/activate.sh
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
SUMMARY="$OUT/engine_burst_ab.txt"
BASE_DIR=/tmp/ab-base
mkdir -p "$BASE_DIR" && tar -xJf "${BASE:?BASE=.gpu/base-REV.txz}" -C "$BASE_DIR"
STAGGER="${STAGGER_MS:-2}"

run_variant() {  # NAME TREE ROUND
  local name="$1" tree="$2" round="$3"
  (cd "$tree" && PYTHONPATH="$tree:$PYTHONPATH" timeout 150 python3 -m bench.engine_burst --random-shape qwen3-0.6b \
    --prompt-tokens 517 --stagger-ms "$STAGGER" --warmup-seconds 20 --json "$OUT/engine_burst_${name}_$round.json" \
    > /dev/null 2>&1)
  python3 - "$OUT/engine_burst_${name}_$round.json" "$name" <<'EOF' | tee -a "$SUMMARY"
import json, sys
r = json.load(open(sys.argv[1]))
steps = [(s["ms"], s["first_tokens"]) for s in r["burst_steps"] if s["first_tokens"]]
print(f"{sys.argv[2]} engine_burst: lone {r['lone_ttft_ms']} ms, P95 {r['burst_ttft_p95_ms']} ms ({r['ratio']}x); "
      f"steps with first tokens (ms, count) {steps}")
EOF
  (cd "$tree" && PYTHONPATH="$tree:$PYTHONPATH" timeout 200 python3 -m bench.service_burst --random-shape qwen3-0.6b \
    --bursts "${BURSTS:-4}" --engine-thread --json "$OUT/service_thread_${name}_$round.json" 2>&1 \
    | grep "^lone\|timeline" | sed "s/; GIL stalls.*//; s/^/$name service: /" | tee -a "$SUMMARY")
}

for round in $(seq 1 "${ROUNDS:-2}"); do
  echo "== round $round" | tee -a "$SUMMARY"
  run_variant base "$BASE_DIR" "$round"
  run_variant head "$PWD" "$round"
done
