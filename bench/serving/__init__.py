"""Serving benchmarks: Orchard vs mlx_lm.server (and mlx_vlm.server) on one model over HTTP, and the soak test's
requests. The load generator itself is the product's (deployments/cli/loadgen, `orchard bench`'s).

Entry points (bench/README.md has the commands):
    python -m bench.serving.compare            the whole comparison: servers as child processes, one JSON
    python -m bench.serving.vision_compare     the same with image requests (issue 27)
    python -m bench.serving.orchard_server     our graph on Ray Serve for a model folder (compare starts it)
    python -m bench.serving.engine_baseline    the in-process engine rate (compare starts it)
    python -m deployments.cli.loadgen.load     the load generator against one running server

Modules: answers (one request of any API kind and its checks; the soak test's), reports (the tables, acceptance
checks and verdicts of compare, vision_compare and the soak test).
"""
