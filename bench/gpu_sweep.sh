#!/usr/bin/env bash
# The GPU benchmarks, one device call per mode (carry .gpu; runs from the project root):
#   bash bench/gpu_sweep.sh serving qwen3-0.6b          # Orchard vs mlx_lm.server over HTTP, bf16
#   bash bench/gpu_sweep.sh serving llama-3.1-8b 4      # the same, 4-bit (16 GB built and loaded three times)
#   bash bench/gpu_sweep.sh engine                      # in process: engine_throughput + prefix-cache TTFT
#   bash bench/gpu_sweep.sh vision [SHAPE]              # Orchard vs mlx_vlm.server, image requests (issue 27)
#
# serving SHAPE [BITS]: bench.serving.compare, levels LEVELS (default 1,4,8,16,32,64,128), servers orchard and
#   mlx_lm, the in-process engine baseline (ENGINE_BASELINE=0: none) and EFFICIENCY_ROUNDS (default 5; 0: none)
#   alternating HTTP / in-process rounds at 64 streams. Writes $OUT/serving_<shape>_<bf16|Nbit>.{json,txt} and server logs under
#   $OUT/logs_<tag>/. BUDGET: seconds for the whole compare run, model build included (default 540 of the
#   call's 600). EXTRA: more compare flags (e.g. "--workloads mixed,uniform,burst,long"). SERVERS (default
#   orchard,mlx_lm): the servers in run order; rapid_mlx (Rapid-MLX, issue 57) needs .gpu-rapid carried too
#   (bench/README.md builds it), unpacked here into /tmp/rapid-site.
# engine: bench.engine_throughput (Orchard vs mlx-lm generate_step / BatchGenerator / mlx_forward, mlx-lm's bare
#   forward loop; random bf16 Qwen3-0.6B shape, 128-token prompts, 128 new tokens, REPEAT runs per level (default
#   5), engines alternating; medians and paired ratios) at LEVELS (default 1,8,32,64,128), ENGINES (default
#   mlx_step,mlx_batch,mlx_forward,orchard), ours at ORCHARD_PREFILL_BATCH rows a step (default 0: the engine's own
#   default, 32; BatchGenerator at mlx-lm's 8); then bench.kv_cache ttft
#   ttft (2,048-token shared prefix + 16-token suffix, hit vs miss) on the Qwen3-0.6B shape and, unless SKIP_8B=1,
#   the Llama-3.1-8B shape. Writes $OUT/engine_throughput.{json,txt}, $OUT/prefix_ttft_<shape>.json and
#   $OUT/prefix_ttft.txt.
# vision [SHAPE]: bench.serving.vision_compare on a random bf16 VLM (default qwen2.5-vl-3b): ROUNDS (default 2) of
#   ours and mlx_vlm.server (order AB, BA, ...), both started once, together (TOGETHER=1, the default: Orchard's
#   start takes ~2 min on an H200, two per call leave no time to measure; round 1 runs on fresh servers, later
#   rounds warm; TOGETHER=0: a fresh server per phase): the first image's TTFT, levels LEVELS
#   (default 1,8,32; each request one IMAGE_SIZE (default 672x672) JPEG + a 64-token question, 128 new tokens,
#   streamed), REPEAT_PAIRS (default 3) images asked twice (and the second question alone: the floor); in ours' last phase MIX_ROUNDS (default 2) alternating
#   rounds of text-only vs half-image requests at 32 streams. VISION_DTYPE (default float32): the vision tower's
#   weights; mlx-vlm's forward of a bf16 / fp16 Qwen2.5-VL tower dies on MLX 0.32.4 CUDA (SIGFPE: attention over
#   empty windows) where the image's merged grid divides into whole windows (672x672 does; 700x700 does not),
#   Orchard's own forward does not. Needs mlx-vlm and its server's imports in the bundles (bench/README.md). Writes
#   $OUT/vision_<shape>.{json,txt} and server logs under $OUT/logs_vision_<shape>/. BUDGET (default 540), EXTRA.
# All: OUT (default /tmp/out), ORCHARD_COMMIT (recorded in the JSON where the tree has no .git).
set -euo pipefail
cd "$(dirname "$0")/.."
MODE="${1:?usage: bench/gpu_sweep.sh serving SHAPE [BITS] | engine | vision [SHAPE]}"
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
# shellcheck disable=SC1091
source .gpu/activate.sh            # MLX (CUDA), Ray Serve on PYTHONPATH; unpacks once per machine
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true

case "$MODE" in
  serving)
    SHAPE="${2:-qwen3-0.6b}"
    BITS="${3:-}"
    if [ -n "$BITS" ]; then TAG="${SHAPE}_${BITS}bit"; else TAG="${SHAPE}_bf16"; fi
    if [ -f .gpu-rapid/rapid-site.tar.xz ]; then
      mkdir -p /tmp/rapid-site && tar -xJf .gpu-rapid/rapid-site.tar.xz -C /tmp/rapid-site
      export RAPID_MLX_SITE=/tmp/rapid-site
    fi
    # shellcheck disable=SC2086
    python3 -m bench.serving.compare --random-shape "$SHAPE" ${BITS:+--bits "$BITS"} \
      --levels "${LEVELS:-1,4,8,16,32,64,128}" --servers "${SERVERS:-orchard,mlx_lm}" \
      $([ "${ENGINE_BASELINE:-1}" = 1 ] && echo --engine-baseline) \
      --efficiency-rounds "${EFFICIENCY_ROUNDS:-5}" \
      --json "$OUT/serving_${TAG}.json" --log-dir "$OUT/logs_${TAG}" \
      --time-budget-s "${BUDGET:-540}" ${EXTRA:-} 2>&1 | tee "$OUT/serving_${TAG}.txt"
    ;;
  engine)
    set +e  # the prefix-cache runs still go if engine_throughput fails
    python3 -m bench.engine_throughput --random-shape qwen3-0.6b --concurrency "${LEVELS:-1,8,32,64,128}" \
      --engines "${ENGINES:-mlx_step,mlx_batch,mlx_forward,orchard}" --repeat "${REPEAT:-5}" --step-trace \
      --orchard-prefill-batch-size "${ORCHARD_PREFILL_BATCH:-0}" --json "$OUT/engine_throughput.json" \
      2>&1 | tail -n 70 > "$OUT/engine_throughput.txt"
    # Staggered arrivals of mixed lengths (issue 57): a row joins every 2 steps, prompts 32..224 tokens.
    python3 -m bench.engine_throughput --random-shape qwen3-0.6b --concurrency "${STAGGER_LEVELS:-128}" \
      --engines mlx_batch,orchard --join-every-steps 2 --mixed-lengths --repeat "${REPEAT:-5}" \
      --orchard-prefill-batch-size "${ORCHARD_PREFILL_BATCH:-0}" --json "$OUT/engine_throughput_staggered.json" 2>&1 | tail -n 20 >> "$OUT/engine_throughput.txt"
    shapes="qwen3-0.6b"
    [ -z "${SKIP_8B:-}" ] && shapes="$shapes llama-3.1-8b"
    for shape in $shapes; do
      python3 -m bench.kv_cache ttft --random-shape "$shape" --json "$OUT/prefix_ttft_${shape}.json" \
        2>&1 | tail -n 5 | sed "s/^/${shape}: /" >> "$OUT/prefix_ttft.txt"
    done
    cat "$OUT/engine_throughput.txt" "$OUT/prefix_ttft.txt"
    ;;
  vision)
    SHAPE="${2:-qwen2.5-vl-3b}"
    # shellcheck disable=SC2086
    python3 -m bench.serving.vision_compare --random-shape "$SHAPE" --levels "${LEVELS:-1,8,32}" \
      --image-size "${IMAGE_SIZE:-672x672}" --mix-rounds "${MIX_ROUNDS:-2}" \
      --rounds "${ROUNDS:-2}" --repeat-pairs "${REPEAT_PAIRS:-3}" $([ "${TOGETHER:-1}" = 1 ] && echo --start-together) \
      --vision-dtype "${VISION_DTYPE:-float32}" \
      --json "$OUT/vision_${SHAPE}.json" --log-dir "$OUT/logs_vision_${SHAPE}" \
      --time-budget-s "${BUDGET:-540}" ${EXTRA:-} 2>&1 | tee "$OUT/vision_${SHAPE}.txt"
    ;;
  *)
    echo "unknown mode '$MODE': serving, engine or vision" >&2
    exit 2
    ;;
esac
