# Sourced by the GPU diagnostics (gpu_server_ab.sh, gpu_burst_probe.sh, gpu_replica_profile.sh), from the project root:
#   source bench/gpu_diag_setup.sh NAME [PYSPY_TOP]
# Activates MLX + Ray (.gpu/activate.sh); sets OUT (default /tmp/out), WORK=/tmp/NAME, SHAPE (default qwen3-0.6b),
# MODEL (a random model of SHAPE, built here) and VOCAB; unpacks .gpu/py-spy.xz to /tmp/py-spy if carried. On exit,
# py-spy raw profiles in WORK get their bench.pyspy_summary tables (PYSPY_TOP rows, 60) and WORK is packed into
# $OUT/NAME.tgz (the device returns at most 8 files).
# shellcheck disable=SC1091
source .gpu/activate.sh
DIAG_NAME="$1"; DIAG_PYSPY_TOP="${2:-60}"
OUT="${OUT:-/tmp/out}"; WORK="/tmp/$DIAG_NAME"; MODEL="/tmp/$DIAG_NAME-model/m"; SHAPE="${SHAPE:-qwen3-0.6b}"
mkdir -p "$OUT" "$WORK" "$(dirname "$MODEL")"
diag_finish() {
  for raw in "$WORK"/*.raw; do
    [ -f "$raw" ] && python3 -m bench.pyspy_summary "$raw" --top "$DIAG_PYSPY_TOP" > "${raw%.raw}.txt" 2>&1
  done
  tar -czf "$OUT/$DIAG_NAME.tgz" -C "$WORK" .
}
trap diag_finish EXIT
if [ -f .gpu/py-spy.xz ]; then xz -dc .gpu/py-spy.xz > /tmp/py-spy && chmod +x /tmp/py-spy; fi
python3 -c "from bench.random_model import make_random_model; make_random_model('$MODEL', '$SHAPE')" > /dev/null
VOCAB=$(python3 -c "import json; print(json.load(open('$MODEL/config.json'))['vocab_size'])")
