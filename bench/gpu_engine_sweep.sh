#!/usr/bin/env bash
# Engine figures in one device call (carry .gpu; runs from the project root):
#   bash bench/gpu_engine_sweep.sh
# 1. engine_throughput: Orchard vs mlx-lm generate_step / BatchGenerator, random bf16 Qwen3-0.6B shape,
#    128-token prompts, 128 new tokens, REPEAT runs per level (engines alternating; medians).
# 2. prefix_cache ttft: 2,048-token shared prefix + 16-token distinct suffix, hit vs miss, on the
#    Qwen3-0.6B shape and on the Llama-3.1-8B shape.
# Writes $OUT/engine_throughput.{json,txt} and $OUT/prefix_ttft_<shape>.json, $OUT/prefix_ttft.txt.
# Env: OUT (default /tmp/out), REPEAT (default 5), LEVELS (default 1,8,32,64,128), SKIP_8B=1.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
# shellcheck disable=SC1091
source .gpu/activate.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
python3 -m bench.engine_throughput --random-shape qwen3-0.6b --concurrency "${LEVELS:-1,8,32,64,128}" \
  --repeat "${REPEAT:-5}" --json "$OUT/engine_throughput.json" 2>&1 | tail -n 40 > "$OUT/engine_throughput.txt"
shapes="qwen3-0.6b"
[ -z "${SKIP_8B:-}" ] && shapes="$shapes llama-3.1-8b"
for shape in $shapes; do
  python3 -m bench.prefix_cache ttft --random-shape "$shape" --json "$OUT/prefix_ttft_${shape}.json" \
    2>&1 | tail -n 5 | sed "s/^/${shape}: /" >> "$OUT/prefix_ttft.txt"
done
cat "$OUT/engine_throughput.txt" "$OUT/prefix_ttft.txt"
