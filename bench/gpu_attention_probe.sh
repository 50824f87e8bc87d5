#!/usr/bin/env bash
# Attention-path diagnostics in one device call (carry .gpu; runs from the project root):
#   bash bench/gpu_attention_probe.sh
# For each MLX setting in CONFIGS: bench.attention_probe (warm forward cost by query length / cache offset,
# first-use cost of new shapes) on the Qwen3-0.6B shape; with TTFT=1 also the prefix-cache hit/miss TTFT on
# the Qwen3-0.6B and Llama-3.1-8B shapes; with THROUGHPUT=1 engine_throughput at LEVELS.
# Writes $OUT/probe_<name>.json, $OUT/ttft_<name>_<shape>.json, $OUT/engine_<name>.json, $OUT/log.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
# shellcheck disable=SC1091
source .gpu/activate.sh
log() { echo "$@" | tee -a "$OUT/log.txt"; }
declare -A SETTINGS=([default]="" [nocudnn]="MLX_CUDA_USE_CUDNN_SDPA=0" [nographs]="MLX_USE_CUDA_GRAPHS=0"
  [nographs_nocudnn]="MLX_USE_CUDA_GRAPHS=0 MLX_CUDA_USE_CUDNN_SDPA=0")
for name in ${CONFIGS:-default nocudnn nographs}; do
  log "== probe $name"
  env ${SETTINGS[$name]} timeout 150 python3 -m bench.attention_probe --random-shape qwen3-0.6b \
    --json "$OUT/probe_$name.json" >> "$OUT/log.txt" 2>&1
  if [ -n "${TTFT:-}" ]; then
    log "== ttft qwen3-0.6b $name"
    env ${SETTINGS[$name]} timeout 90 python3 -m bench.prefix_cache ttft --random-shape qwen3-0.6b \
      --json "$OUT/ttft_${name}_qwen3-0.6b.json" 2>&1 | tail -n 1 | tee -a "$OUT/log.txt"
  fi
done
for name in ${CONFIGS:-default nocudnn nographs}; do
  if [ -n "${THROUGHPUT:-}" ]; then
    log "== engine_throughput $name"
    env ${SETTINGS[$name]} timeout 200 python3 -m bench.engine_throughput --random-shape qwen3-0.6b \
      --concurrency "${LEVELS:-1,64,128}" --repeat "${REPEAT:-2}" --json "$OUT/engine_$name.json" 2>&1 | tail -n 12 | tee -a "$OUT/log.txt"
  fi
done
