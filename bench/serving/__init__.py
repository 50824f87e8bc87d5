"""Serving benchmarks: an OpenAI-streaming load generator, and Orchard vs mlx_lm.server on one model.

Entry points (bench/README.md has the commands):
    python -m bench.serving.compare          the whole comparison: servers as child processes, one JSON
    python -m bench.serving.load             the load generator against one running server
    python -m bench.serving.orchard_server   our graph on Ray Serve for a model folder (compare starts it)
    python -m bench.serving.engine_baseline  the in-process engine rate (compare starts it)

Modules: client (one streamed request, timed per network read), workloads (what is sent and when),
stats (summaries), tables (tables and acceptance checks).
"""
