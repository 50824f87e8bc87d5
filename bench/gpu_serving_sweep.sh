#!/usr/bin/env bash
# The serving sweep in one device call (carry .gpu; the command runs from the project root):
#   bash bench/gpu_serving_sweep.sh qwen3-0.6b          # bf16
#   bash bench/gpu_serving_sweep.sh llama-3.1-8b        # bf16, 16 GB
#   bash bench/gpu_serving_sweep.sh llama-3.1-8b 4      # 4-bit
# Writes $OUT/serving_<shape>_<bf16|Nbit>.{json,txt} and server logs under $OUT/logs_<tag>/.
# Env: OUT (default /tmp/out), LEVELS (default 1,4,8,16,32,64,128), BUDGET (seconds for bench.compare,
# model build included; default 540 of the call's 600), EFFICIENCY_ROUNDS (alternating HTTP / in-process rounds at
# 64 streams after our sweep, default 5; 0: none), EXTRA (more bench.compare flags), ORCHARD_COMMIT.
set -euo pipefail
cd "$(dirname "$0")/.."
SHAPE="${1:-qwen3-0.6b}"
BITS="${2:-}"
if [ -n "$BITS" ]; then TAG="${SHAPE}_${BITS}bit"; else TAG="${SHAPE}_bf16"; fi
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
# shellcheck disable=SC1091
source .gpu/activate.sh            # MLX (CUDA) + Ray Serve on PYTHONPATH; unpacks once per machine
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
# shellcheck disable=SC2086
python3 -m bench.compare --random-shape "$SHAPE" ${BITS:+--bits "$BITS"} \
  --levels "${LEVELS:-1,4,8,16,32,64,128}" --servers orchard,mlx_lm --engine-baseline \
  --efficiency-rounds "${EFFICIENCY_ROUNDS:-5}" \
  --json "$OUT/serving_${TAG}.json" --log-dir "$OUT/logs_${TAG}" \
  --time-budget-s "${BUDGET:-540}" ${EXTRA:-} 2>&1 | tee "$OUT/serving_${TAG}.txt"
