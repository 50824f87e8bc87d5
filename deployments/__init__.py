"""Orchard's Ray Serve graph: an OpenAI ingress plus one Serve application per model.

The engine (engine/) knows nothing of Ray or HTTP; this package adapts it:
config.py (serve_config.yaml fields), model_service.py (engine owner, no Ray),
model_server.py (its Serve deployment), registry.py (model id -> status/handle),
ingress.py + admin.py (HTTP routes), api/ (OpenAI schemas, renderers, errors).
"""
