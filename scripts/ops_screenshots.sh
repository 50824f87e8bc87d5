#!/usr/bin/env bash
# The screenshots of docs/operations.md (Scaling): Ray's dashboard with the model applications and their replicas,
# and Orchard's metrics graphed by a real Prometheus scraping /metrics. Needs Debian's chromium and prometheus:
#   apt-get install -y chromium prometheus
#   scripts/loopback.sh bash scripts/ops_screenshots.sh [OUTDIR]     # Linux: Ray and the browser on loopback only
# Serves serve_config.yaml's models plus a tiny random chat model on 2 replicas (bench.serving.orchard_server
# --dashboard), starts Prometheus with docs/ops/prometheus.yml, sends ~90 s of load (`orchard bench`), then writes
# OUTDIR/ray_dashboard_serve.png and OUTDIR/prometheus_replicas.png (default docs/screenshots) and stops it all.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="$(realpath -m "${1:-docs/screenshots}")"
WORK="$(mktemp -d /tmp/orchard-ops.XXXXXX)"
PY=.venv/bin/python
mkdir -p "$OUT"
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -INT "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do timeout 60 tail --pid="$pid" -f /dev/null 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT

"$PY" -m tests.support.random_model "$WORK/tiny-chat" --shape tiny > /dev/null
# Ray 2.60's dashboard asks for the cluster's token: this throwaway cluster, on loopback only, runs without one.
RAY_AUTH_MODE=disabled "$PY" -m bench.serving.orchard_server --model "$WORK/tiny-chat" --model-id tiny-chat --port 8000 --dashboard \
  --with-config-models --model-arg num_replicas=2 --decode-batch 16 > "$WORK/server.log" 2>&1 &
pids+=($!)
until grep -q "ORCHARD READY" "$WORK/server.log"; do
  kill -0 "${pids[0]}" 2>/dev/null || { tail -40 "$WORK/server.log"; exit 1; }
  sleep 2
done
prometheus --config.file=docs/ops/prometheus.yml --storage.tsdb.path="$WORK/prometheus" \
  --web.listen-address=127.0.0.1:9090 > "$WORK/prometheus.log" 2>&1 &
pids+=($!)
.venv/bin/orchard bench --url http://127.0.0.1:8000 --model tiny-chat --concurrency 4,8,16 --duration 100 \
  --requests-per-stream 40 --gen-tokens 64 --ignore-eos --out "$WORK/bench" > "$WORK/bench.log" 2>&1 || tail -20 "$WORK/bench.log"
sleep 10  # the last scrapes

shot() {  # URL FILE: the page after its scripts ran (virtual time lets the charts draw)
  chromium --headless=new --no-sandbox --disable-gpu --hide-scrollbars --window-size=1600,1000 \
    --virtual-time-budget=20000 --screenshot="$2" "$1" > /dev/null 2>&1
}
shot "http://127.0.0.1:8265/#/serve" "$OUT/ray_dashboard_serve.png"
query='sum by (replica) (rate(orchard:generation_tokens_total{model_name="tiny-chat"}[30s]))'
shot "http://127.0.0.1:9090/graph?g0.expr=$("$PY" -c 'import sys, urllib.parse; print(urllib.parse.quote(sys.argv[1]))' "$query")&g0.tab=0&g0.range_input=2m" \
  "$OUT/prometheus_replicas.png"
ls -la "$OUT"/ray_dashboard_serve.png "$OUT"/prometheus_replicas.png
