#!/usr/bin/env bash
# Run the test suite: `bash scripts/test.sh` runs every test but the slow ones (those that run the real
# SmolLM2 model: `bash scripts/test.sh -m slow` runs them; a later -m wins). Extra arguments go to pytest.
# Without a test path or -m among them, the suite runs as two pytest processes at once, each in its own namespace, as
# halves of about equal time: the engine's tests then the graph's (tests/engine, tests/graph: Ray starts only for
# the latter), beside all the others (with three engine modules, BESIDE_THE_REST below). Each half's output follows
# when both are done; the run fails if either does. (On 2 cores, at d63f99e, before those three moved: 1,483 and
# 1,134 s at once.)
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

pytest_isolated() {
  if [ "$(uname -s)" = Linux ]; then
    scripts/loopback.sh sh -c 'ip addr add 192.0.2.1/32 dev lo && ip route add 8.8.8.8/32 dev lo src 192.0.2.1 &&
      exec "$@"' host-like "$PYTHON" -m pytest -q -m "not slow" "$@"
  else
    "$PYTHON" -m pytest -q -m "not slow" "$@"
  fi
}

logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT
# A test or teardown that hangs is reported (tests/support/hang_watch.py); the reports are printed again last.
export ORCHARD_HANG_REPORT="$logs/hangs.txt"
hang_reports() {
  if [ -s "$logs/hangs.txt" ]; then echo "==== hangs (tests/support/hang_watch.py) ===="; cat "$logs/hangs.txt"; fi
}

one_process=0  # a test path, or -m (the slow tests: some measure real time and need the machine to themselves)
for arg in "$@"; do
  case "$arg" in tests|tests/*|*.py|*::*|-m|-m*) one_process=1 ;; esac
done
if [ "$one_process" = 1 ]; then
  status=0
  pytest_isolated "$@" || status=$?
  hang_reports
  exit "$status"
fi

# Engine modules that run in the other half (no Ray there either), to even the halves' times: at d63f99e the engine +
# graph half took 1,483 s against 1,134 s, these three ~170 s of it.
BESIDE_THE_REST="test_image_batch.py test_vision_engine.py test_speech_engine.py"
engine_half=(tests/engine tests/graph)
rest_half=(tests --ignore=tests/graph)
for module in tests/engine/test_*.py; do
  case " $BESIDE_THE_REST " in
    *" $(basename "$module") "*) engine_half+=("--ignore=$module") ;;
    *) rest_half+=("--ignore=$module") ;;
  esac
done
pytest_isolated "${engine_half[@]}" "$@" > "$logs/graph.log" 2>&1 &
graph=$!
pytest_isolated "${rest_half[@]}" "$@" > "$logs/rest.log" 2>&1 &
rest=$!
status=0
finished() {  # pytest's 5: no test of this half was selected (-m slow), which is no failure
  local code=0
  wait "$1" || code=$?
  if [ "$code" != 0 ] && [ "$code" != 5 ]; then status=$code; fi
}
finished "$rest"
echo "==== tests outside tests/engine and tests/graph (and $BESIDE_THE_REST) ===="
cat "$logs/rest.log"
finished "$graph"
echo "==== tests/engine, then tests/graph (Ray Serve) ===="
cat "$logs/graph.log"
hang_reports
exit "$status"
