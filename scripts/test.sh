#!/usr/bin/env bash
# Run the test suite: `bash scripts/test.sh` runs every test but the slow ones (those that run the real
# SmolLM2 model: `bash scripts/test.sh -m slow` runs them; a later -m wins). Extra arguments go to pytest.
# On Linux, Ray binds its RPC to the host's interface address even when told 127.0.0.1, so the tests run in
# a private network namespace holding only loopback (scripts/loopback.sh), where Ray falls back to 127.0.0.1.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
export RAY_USAGE_STATS_ENABLED=0
if [ "$(uname -s)" = Linux ]; then
  exec scripts/loopback.sh "$PYTHON" -m pytest -q -m "not slow" "$@"
fi
exec "$PYTHON" -m pytest -q -m "not slow" "$@"
