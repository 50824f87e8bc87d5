#!/bin/sh
# Run a command in a loopback-only network namespace, where 127.0.0.1 is the only address:
#   scripts/loopback.sh python -m pytest tests/serve -q
#   scripts/loopback.sh sh -c 'orchard serve & until curl -sf 127.0.0.1:8000/ready; do sleep 2; done; orchard chat;
#     kill -INT $!; wait'
# Ray binds its RPC to the host interface on Linux; in here it cannot reach or expose anything else.
# A client must run in the same namespace (same command) to reach the server.
set -eu
export RAY_USAGE_STATS_ENABLED="${RAY_USAGE_STATS_ENABLED:-0}"
# Unprivileged users need a user namespace (-r) to create a network namespace.
if [ "$(id -u)" -eq 0 ]; then userns=""; else userns="-r"; fi
exec unshare $userns -n sh -c 'ip link set lo up && exec "$@"' loopback "$@"
