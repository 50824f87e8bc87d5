"""`orchard bench`: the serving benchmark for users, against a running server and optionally a second
OpenAI-compatible one (`--against`): side-by-side tables of tok/s, TTFT and ITL, and JSON + PNG plots in --out.

The load itself is the serving benchmarks' load generator (one implementation, deployments/cli/loadgen): closed-loop
sweeps at each concurrency level, the long-prompt and burst scenarios. Every run is bounded by --duration and
--requests-per-stream, and only loopback servers are loaded unless --allow-remote says the servers are yours."""

from __future__ import annotations

import argparse

from deployments.cli.server_client import DEFAULT_URL

# The user's names -> the load generator's workloads: `chat` is its `mixed` sweep (log-uniform prompt lengths).
WORKLOADS = {"chat": "mixed", "same": "same", "long": "long", "burst": "burst"}


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("bench", help="benchmark a running server (and another OpenAI-compatible one)",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help=f"the server to load (default: $ORCHARD_URL, the one `orchard serve` "
                   f"runs, or {DEFAULT_URL})")
    p.add_argument("--against", default=None, help="a second OpenAI-compatible server, run after the first")
    p.add_argument("--model", default=None, help="model id at --url (default: the first it lists)")
    p.add_argument("--against-model", default=None, help="model id at --against (default: --model's, if listed, "
                   "else the first it lists)")
    p.add_argument("--names", default="orchard,other", help="labels of the two servers (default orchard,other)")
    p.add_argument("--concurrency", default="1,8,32", help="concurrent streams per level (default 1,8,32)")
    p.add_argument("--workload", default="chat", help=f"comma-separated, of {','.join(WORKLOADS)} (default "
                   "chat; tables and plots call it by bench/'s name, mixed)")
    p.add_argument("--requests-per-stream", type=int, default=2,
                   help="requests each stream sends back to back per level (default 2)")
    p.add_argument("--duration", type=float, default=120.0, help="seconds for the whole run, all servers (default 120)")
    p.add_argument("--gen-tokens", type=int, default=64, help="max_tokens of each request (default 64)")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (Orchard, vLLM; not mlx_lm.server)")
    p.add_argument("--out", default=None, help="folder for bench.json and the plots (default ./orchard-bench-<time>)")
    p.add_argument("--api-key", default=None, help="key for both servers (default: $ORCHARD_API_KEY)")
    p.add_argument("--allow-remote", action="store_true",
                   help="load servers that are not on this machine (only servers you own)")


def run(args: argparse.Namespace) -> int:
    # Imported here: the load generator brings aiohttp, numpy and matplotlib's callers (~0.4 s), which every other
    # `orchard` command would pay while its parser is built.
    from deployments.cli.bench_run import run_bench

    return run_bench(args, WORKLOADS)
