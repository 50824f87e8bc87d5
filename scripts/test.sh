#!/usr/bin/env bash
# Run the test suite: `bash scripts/test.sh` runs every test but the slow ones (those that run the real
# SmolLM2 model: `bash scripts/test.sh -m slow` runs them; a later -m wins). Extra arguments go to pytest.
# The tests run in a private network namespace holding only loopback (scripts/loopback.sh), so a test server
# can neither expose nor reach anything else. Its lo also carries a stand-in for a host's interface address
# (192.0.2.1, a documentation address), with a route for the address Ray probes to find its node IP (8.8.8.8):
# Ray then sees what it sees on a real Linux host, and test_serve_graph.py's socket test proves that Ray still
# listens on loopback only. Every other address stays unreachable, so nothing waits on a network.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
export RAY_USAGE_STATS_ENABLED=0
# Ray's node IP 127.0.0.1, hence every Ray process on loopback (read at `import ray`; macOS's default).
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
if [ "$(uname -s)" = Linux ]; then
  exec scripts/loopback.sh sh -c 'ip addr add 192.0.2.1/32 dev lo && ip route add 8.8.8.8/32 dev lo src 192.0.2.1 &&
    exec "$@"' host-like "$PYTHON" -m pytest -q -m "not slow" "$@"
fi
exec "$PYTHON" -m pytest -q -m "not slow" "$@"
