"""Bodega's config.yaml examples (its docs, L117-131, L624-630, L678-686) run as Serve configs: the ingress, one
application per model with the entry as written, the embedder for RAG; Serve's own schema accepts the result."""

from __future__ import annotations

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from deployments.cli.bodega_config import serve_config_of
from deployments.cli.serve import _read_target
from deployments.cli.server_client import ServerError
from deployments.config import ModelConfig

MULTI_MODEL = """\
server:
  host: "0.0.0.0"
  port: 44468
models:
  - model_id: "bodega-solomon-9b"
    model_type: "multimodal"
    model_path: "srswti/bodega-solomon-9b"
    max_concurrency: 1
  - model_id: "bodega-raptor-8b"
    model_type: "lm"
    model_path: "srswti/bodega-raptor-8b-mxfp4"
    prompt_cache_size: 10
"""
SPECULATIVE = """\
models:
  - model_id: "raptor-fast"
    model_type: "lm"
    model_path: "srswti/bodega-raptor-8b-mxfp4"
    draft_model_path: "Qwen/Qwen3-0.6B-MLX-4bit"
    num_draft_tokens: 3
"""
BATCHED = """\
models:
  - model_id: "raptor-batched"
    model_type: "lm"
    model_path: "srswti/bodega-raptor-8b-mxfp4"
    continuous_batching: true
    cb_max_num_seqs: 256
    cb_prefill_batch_size: 16
    cb_completion_batch_size: 32
"""


def _models(serve_config: dict) -> dict[str, dict]:
    return {app["name"]: app["args"] for app in serve_config["applications"] if "model_path" in app["args"]}


def test_the_documented_multi_model_config_serves_each_model_and_the_rag_embedder():
    serve_config = serve_config_of(yaml.safe_load(MULTI_MODEL))
    ServeDeploySchema.model_validate(serve_config)  # Serve's own check of the config `serve run` gets
    assert serve_config["http_options"] == {"host": "0.0.0.0", "port": 44468}
    assert serve_config["applications"][0] == {"name": "orchard", "route_prefix": "/",
                                               "import_path": "deployments.app:build_app", "args": {}}
    models = _models(serve_config)
    assert list(models) == ["bodega-solomon-9b", "bodega-raptor-8b", "all-MiniLM-L6-v2"]
    assert models["bodega-raptor-8b"]["prompt_cache_size"] == 10  # as written: ModelConfig takes Bodega's names
    solomon = ModelConfig.model_validate(models["bodega-solomon-9b"])
    assert (solomon.model_type, solomon.max_decode_seqs) == ("multimodal", 1)  # max_concurrency 1: sequential


def test_the_speculative_and_batching_examples_map_to_our_fields():
    fast = ModelConfig.model_validate(_models(serve_config_of(yaml.safe_load(SPECULATIVE)))["raptor-fast"])
    assert (fast.speculative.method, fast.speculative.num_draft_tokens) == ("draft", 3)
    batched_config = serve_config_of(yaml.safe_load(BATCHED))
    assert batched_config["http_options"] == {"host": "127.0.0.1", "port": 44468}  # Bodega's port by default
    batched = ModelConfig.model_validate(_models(batched_config)["raptor-batched"])
    assert (batched.max_num_seqs, batched.max_prefill_seqs, batched.max_decode_seqs) == (256, 16, 32)


@pytest.mark.parametrize("config, message", [
    ({"models": []}, "'models' must be a list"),
    ({"server": {"workers": 4}, "models": [{"model_path": "default"}]}, "server.workers"),
    ({"models": [{"model_path": "default"}], "logging": {}}, "'logging'"),
    ({"models": [{"model_path": "default", "lora_paths": ["/a"], "lora_scales": [1, 2]}]},
     "models\\[0\\].*'lora_scales' has 2 entries for 1 lora_paths"),
    ({"models": [{"model_path": "/m/a", "model_id": "x"}, {"model_path": "/m/b", "model_id": "x"}]},
     "model_id 'x' is given to two"),
])
def test_a_bodega_config_orchard_cannot_serve_is_refused_naming_why(config, message):
    with pytest.raises(ServerError, match=message):
        serve_config_of(config)


def test_orchard_serve_runs_a_bodega_config_on_its_port(tmp_path, monkeypatch):
    monkeypatch.setenv("ORCHARD_HOME", str(tmp_path / "home"))
    config = tmp_path / "config.yaml"
    config.write_text(BATCHED)
    target = _read_target(config)
    assert (target.port, target.url) == (44468, "http://127.0.0.1:44468")
    assert _models(yaml.safe_load(target.run_path.read_text()))["raptor-batched"]["cb_max_num_seqs"] == 256
