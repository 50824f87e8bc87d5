"""Orchard's Ray Serve graph: an OpenAI/Anthropic ingress plus one Serve application per model.

The engine (engine/) knows nothing of Ray or HTTP; this package adapts it:
- `app.py` builds both kinds of application from serve_config.yaml; `config.py` their fields (`bodega.py` maps
  Bodega's names); `model_calls.py` what the ingress and a model exchange;
- `ingress/`: HTTP routes, the model registry and its backends; `api/`: OpenAI and Anthropic wire formats;
- `model/`: a model's Serve deployment and the service that owns its engine client;
- `chat/`: chat templates, tokenizing and the tool-call/reasoning parsers, on the model's side;
- `transport/`: Ray handles or the stream channel between the two;
- `ray_loopback.py` keeps a local server's replicas listening on loopback only.
"""
