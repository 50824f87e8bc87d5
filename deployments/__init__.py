"""Orchard's Ray Serve graph: an OpenAI/Anthropic ingress plus one Serve application per model.

The engine (engine/) knows nothing of Ray or HTTP; this package adapts it, in layers (pyproject.toml's
`deployments-layers` contract: a module imports only from the rows below its own):
- `cli/` the `orchard` command; `app.py` builds both kinds of application from serve_config.yaml;
- `ingress/`: HTTP routes, the model registry and its backends;
- `model/`: a model's Serve deployment and the service that owns its engine client; `rag/`: the RAG deployment;
  `embeddings/`: an embedding model's service; `model_sources.py`: where a model may come from;
- `config.py`: model and ingress fields (`engine_fields.py`: the engine's knobs as fields, `bodega.py`: Bodega's
  names, `speculative.py`: a model's `speculative:`);
- `api/`: OpenAI and Anthropic wire formats; `chat/`: chat templates, tokenizing and the tool-call/reasoning
  parsers, on the model's side; `transport/`: Ray handles or the stream channel between the two;
  `ray_loopback.py` keeps a local server's replicas listening on loopback only;
- `metrics/`: what each process records and how /metrics renders it;
- the contract modules, what crosses between deployments: `rag_calls.py` (ingress <-> RAG), `model_calls.py`
  (ingress <-> a model), `output_deltas.py` (the parsed output a model's stream carries).
"""

import engine  # noqa: F401 - first: importing the engine picks the BLAS MLX will call, before anything imports MLX
