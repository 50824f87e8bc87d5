#!/usr/bin/env bash
# End-to-end check with the real coding agents: Claude Code and Codex CLI (pinned versions, from the npm registry)
# each say hello through an Orchard server, and any protocol error fails the check.
#
#   bash scripts/check_agents.sh                 # both agents, against a server started here (README's way)
#   bash scripts/check_agents.sh claude          # one agent (claude | codex)
#   ORCHARD_URL=http://127.0.0.1:8000 bash scripts/check_agents.sh   # against a running server (same network)
#
# The CLIs are installed once into .cache/agents (needs node >= 20 and npm; skipped when present). Without
# ORCHARD_URL the server runs in a private loopback-only namespace (scripts/loopback.sh) with its own ORCHARD_HOME
# (.cache/agents/orchard-home), and the agents run in that namespace too. MODEL picks the model (default: the first
# one /v1/models lists); ORCHARD_API_KEY is sent if the server wants one. Transcripts: .cache/agents/transcripts/.
# A check fails on a non-zero exit, a timeout (AGENT_TIMEOUT_S, 900 s: the 2-core test machine prefilled SmolLM2 at
# ~10 tokens/s, and Claude Code's prompt is ~4,100 tokens), or "API Error" / "ERROR" in the output.
# Claude Code's replies are capped at AGENT_MAX_OUTPUT_TOKENS (256; CLAUDE_CODE_MAX_OUTPUT_TOKENS); Codex sends no
# cap, so the server's default_max_tokens applies. SmolLM2 at Claude Code's temperature 1 may not end a reply within
# the cap: Claude Code then asks for more, and finally exits with "API Error: ... exceeded the N output token
# maximum", which passes as "no protocol error" only when the server's log shows every call answered 200 (a larger
# cap does not help: at 1,024 the continued conversation outgrew SmolLM2's 8,192-token context). AGENT_PROMPT=minimal: Claude Code without its system prompt and
# tools (for slow CPUs).
set -euo pipefail
cd "$(dirname "$0")/.."
CLAUDE_CODE_VERSION=2.1.332
CODEX_VERSION=0.169.0
CACHE="$PWD/.cache/agents"
BIN="$CACHE/node_modules/.bin"
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
AGENT_TIMEOUT_S="${AGENT_TIMEOUT_S:-900}"
# Claude Code asks for 32,000 tokens for a model it does not know: a small model on a CPU can spend minutes on them.
AGENT_MAX_OUTPUT_TOKENS="${AGENT_MAX_OUTPUT_TOKENS:-256}"

install_agents() {
  if [ "$("$BIN/claude" --version 2>/dev/null)" = "$CLAUDE_CODE_VERSION (Claude Code)" ] &&
     [ "$("$BIN/codex" --version 2>/dev/null)" = "codex-cli $CODEX_VERSION" ]; then
    return
  fi
  local start=$SECONDS
  npm install --prefix "$CACHE" --no-audit --no-fund --loglevel=error \
    "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION" "@openai/codex@$CODEX_VERSION"
  echo "installed Claude Code $CLAUDE_CODE_VERSION and Codex $CODEX_VERSION in $((SECONDS - start)) s" \
       "($(du -sh "$CACHE/node_modules" | cut -f1))"
}

# ---- inside the namespace: start the server, check, stop ------------------------------------------------------
serve_and_check() {
  # The engines at normal priority (docs/operations.md: Ray starts them at nice 15, which a busy CI machine starves).
  export ORCHARD_HOME="$CACHE/orchard-home" RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_worker_niceness=0
  local serve log="$CACHE/transcripts/server.log"
  serve="$(dirname "$PYTHON")/serve"
  echo "starting the server: $serve run serve_config.yaml (log: $log)"
  # serve run stops cleanly on SIGINT only, and a background job of a script ignores SIGINT; so does everything
  # started from a shell that was itself started in the background (a bash that inherits an ignored SIGINT cannot
  # undo it). The server therefore starts through a Python that sets SIGINT back to its default before exec.
  PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -c \
    'import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])' \
    "$serve" run serve_config.yaml >"$log" 2>&1 &  # this checkout's code
  SERVER=$!
  trap stop_server EXIT
  local deadline=$((SECONDS + ${SERVER_TIMEOUT_S:-600}))
  # /ready answers 200 once every configured model runs (/health says "ok" as soon as one does).
  until curl -sf http://127.0.0.1:8000/ready >/dev/null 2>&1; do
    if ! kill -0 $SERVER 2>/dev/null || [ $SECONDS -gt $deadline ]; then
      tail -30 "$log"; curl -s http://127.0.0.1:8000/ready; echo "FAIL: the server did not become ready"; return 1
    fi
    sleep 2
  done
  echo "server ready after ${SECONDS} s"
  ORCHARD_URL=http://127.0.0.1:8000 check_all
}

# SIGINT; after 60 s SIGKILL for the server's whole process tree (Ray's GCS and raylet, replicas, engines).
stop_server() {
  kill -INT "$SERVER" 2>/dev/null || return 0
  local waited=0
  while kill -0 "$SERVER" 2>/dev/null && [ $waited -lt 60 ]; do sleep 1; waited=$((waited + 1)); done
  if kill -0 "$SERVER" 2>/dev/null; then
    echo "the server did not stop within 60 s of SIGINT: killing its processes"
    # shellcheck disable=SC2046
    kill -KILL $(process_tree "$SERVER") 2>/dev/null || true
  fi
  wait "$SERVER" 2>/dev/null || true
}

process_tree() {
  local child
  echo "$1"
  for child in $(pgrep -P "$1"); do process_tree "$child"; done
}

check_all() {
  MODEL="${MODEL:-$(curl -sf "$ORCHARD_URL/v1/models" -H "Authorization: Bearer ${ORCHARD_API_KEY:-unused}" |
    "$PYTHON" -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')}"
  echo "model: $MODEL at $ORCHARD_URL"
  local failed=0
  for agent in "${AGENTS[@]}"; do
    "check_$agent" || failed=1
  done
  return $failed
}

# Runs an agent command with a timeout, keeps its transcript, fails on an error exit or an error in the output.
run_agent() {
  local name=$1; shift
  local transcript="$CACHE/transcripts/$name.txt" start=$SECONDS rc=0
  timeout "$AGENT_TIMEOUT_S" "$@" </dev/null >"$transcript" 2>&1 || rc=$?
  echo "---- $name: exit $rc after $((SECONDS - start)) s; transcript $transcript"
  cat "$transcript"
  if [ $rc -ne 0 ] || grep -qE 'API Error|^ERROR|error sending request|unexpected status' "$transcript"; then
    if only_the_output_cap "$transcript"; then
      echo "PASS: $name (no protocol error: the model's replies ran to the $AGENT_MAX_OUTPUT_TOKENS-token cap and" \
           "stopped with stop_reason max_tokens, which Claude Code reports as an 'API Error')"
      return 0
    fi
    echo "FAIL: $name"
    return 1
  fi
  echo "PASS: $name"
}

# Claude Code ends with "API Error: ... exceeded the N output token maximum" when its replies keep stopping at
# max_tokens: a small model's length, not the protocol. Only with this script's own server, whose log shows every
# /v1/messages call answered 200 and some reply finished by length; any other error still fails.
only_the_output_cap() {
  local transcript=$1 log="$CACHE/transcripts/server.log"
  [ -n "${SERVER:-}" ] && grep -q 'output token maximum' "$transcript" || return 1
  ! grep -E 'API Error|^ERROR|error sending request|unexpected status' "$transcript" | grep -qv 'output token maximum' &&
    grep -q 'finished: length' "$log" && ! grep -qE 'POST /v1/messages [45][0-9][0-9] ' "$log"
}

check_claude() (
  HOME="$(mktemp -d)"
  export HOME ANTHROPIC_BASE_URL="$ORCHARD_URL" ANTHROPIC_API_KEY="${ORCHARD_API_KEY:-unused}" \
    ANTHROPIC_MODEL="$MODEL" ANTHROPIC_SMALL_FAST_MODEL="$MODEL" ANTHROPIC_DEFAULT_HAIKU_MODEL="$MODEL" \
    CLAUDE_CODE_MAX_OUTPUT_TOKENS="$AGENT_MAX_OUTPUT_TOKENS" CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_AUTOUPDATER=1 DISABLE_TELEMETRY=1 DISABLE_ERROR_REPORTING=1
  local slim=()
  # Claude Code's own prompt is ~4,100 tokens (~12,400 with its tools described), minutes of prefill on a CPU:
  # AGENT_PROMPT=minimal sends the same request fields with a one-line system prompt and no tools.
  [ "${AGENT_PROMPT:-full}" = minimal ] && slim=(--bare --tools "" --system-prompt "You are a helpful assistant.")
  cd "$HOME" && run_agent claude "$BIN/claude" "${slim[@]}" -p "say hello"
)

check_codex() (
  HOME="$(mktemp -d)"
  export HOME CODEX_HOME="$HOME" ORCHARD_API_KEY="${ORCHARD_API_KEY:-unused}"
  cat >"$HOME/config.toml" <<EOF
model = "$MODEL"
model_provider = "orchard"
check_for_update_on_startup = false

[model_providers.orchard]
name = "Orchard"
base_url = "$ORCHARD_URL/v1"
wire_api = "responses"
env_key = "ORCHARD_API_KEY"

[analytics]
enabled = false

[feedback]
enabled = false

[otel]
exporter = "none"
EOF
  cd "$HOME" && run_agent codex "$BIN/codex" exec --skip-git-repo-check "say hello"
)

if [ "${1:-}" = "--inside" ]; then  # re-entered in the namespace
  shift; AGENTS=("$@"); serve_and_check; exit
fi
AGENTS=("$@")
[ $# -eq 0 ] && AGENTS=(claude codex)
mkdir -p "$CACHE/transcripts"
install_agents
if [ -n "${ORCHARD_URL:-}" ]; then
  check_all
else
  PYTHON="$PYTHON" scripts/loopback.sh bash "$0" --inside "${AGENTS[@]}"
fi
