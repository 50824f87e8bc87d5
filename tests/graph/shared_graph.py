"""The Ray graph most graph tests share: serve_config.yaml's applications on Ray Serve, started once per session.

Its model entry is copied onto each tiny model a graph module needs (a chat pair for test_serve_graph, the RAG chat
model, a tools/reasoning model, a vision-language model) beside the embedded embedder, behind one ingress with RAG
and the admin API. One start (~40 s on 2 cores) instead of one per module (~20-30 s each). A test that changes the
graph (loads, unloads, restarts) leaves it as it found it; a module that needs another ingress config (keys, bind
host) deploys its own graph after shutting Serve down, and puts this one back (`redeploy`).
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from pathlib import Path

import anthropic
import httpx
import openai
import yaml

from deployments.config import serve_app_name
from tests.graph.conftest import GRAPH_START_S, ServeCluster, deploy_graph
from tests.support.serving import TinyModels, wait_until
from tests.support.tiny_images import write_tiny_klein
from tests.support.tiny_models import write_smollm2_tokenizer_model
from tests.support.tiny_vlms import write_qwen25_vl
from tests.support.tiny_whisper import write_tiny_whisper

REPO = Path(__file__).resolve().parents[2]
INGRESS_APP = "orchard"  # serve_config.yaml's name for the ingress application
ALPHA = "tiny/alpha"  # an id with "/" on purpose; also the RAG tests' chat model
BETA = "tiny-beta"
TOOLS = "tiny/tools"
VISION = "tiny-vl"
SPEECH = "tiny-whisper"
VOICE = "en_US-joe-medium"  # the embedded voice (model_path default-tts)
IMAGES = "tiny-klein"
EMBEDDER = "all-MiniLM-L6-v2"
MCP_SERVER = "demo"
MCP_DEMO = "tests.support.mcp_demo_server"
ALPHA_CONTEXT = 4096
TOOLS_CONTEXT = 1536
VISION_CONTEXT = 2048
TOOLS_TEMPLATE = REPO / "tests" / "support" / "qwen3_tools.jinja"
# The models the graph starts with, and the type each must run as before a test may use it.
MODEL_TYPES = {ALPHA: "lm", BETA: "lm", TOOLS: "lm", VISION: "multimodal", SPEECH: "stt", VOICE: "tts",
               IMAGES: "image-generation", EMBEDDER: "embedding"}


@dataclass
class SharedGraph:
    cluster: ServeCluster
    state_dir: Path
    schema: dict  # the Serve config it was deployed from (a restart deploys it again)

    @property
    def url(self) -> str:
        return self.cluster.base_url

    @property
    def port(self) -> int:
        return self.cluster.port

    def openai(self, timeout: float = 60) -> openai.OpenAI:
        # max_retries=0: the client would otherwise retry 429/503 itself and hide them.
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=timeout)

    def async_openai(self, timeout: float = 60) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=timeout)

    def anthropic(self, timeout: float = 60) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key="unused", max_retries=0, timeout=timeout)

    def http(self, timeout: float = 60) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)


def shared_graph_config(models: TinyModels, root: Path) -> dict:
    """serve_config.yaml's ingress (RAG on a temporary folder, admin loads from the tiny models' folder) and
    embedder, and its model entry copied onto each tiny model with the settings the tests rely on."""
    config = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    ingress, model_template, embedder = config["applications"]
    assert ingress["name"] == INGRESS_APP and embedder["name"] == serve_app_name(EMBEDDER)
    assert embedder["args"]["model_path"] == "default-embedding"
    ingress["args"].update(state_dir=str(root / "state"), status_poll_interval_s=0.5,
                           model_roots=[str(models.alpha.parent)], rag={"storage_dir": str(root / "rag")},
                           responses_store_size=10, responses_store_ttl_s=600,
                           # the demo MCP server over stdio, started by the ingress replica at first use
                           mcp={"servers": [{"name": MCP_SERVER, "command": [sys.executable, "-m", MCP_DEMO],
                                             "cwd": str(REPO)}]})

    def model_app(name: str, path: Path, advanced: dict | None = None, **overrides) -> dict:
        app = copy.deepcopy(model_template)
        app["name"] = serve_app_name(name)
        app["args"].update(model_id=name, model_path=str(path), **overrides)
        app["args"].setdefault("advanced", {}).update(advanced or {})
        return app

    tools_model = write_smollm2_tokenizer_model(root / "tools", {"max_position_embeddings": 4096}, seed=1, scale=3.0)
    return {"applications": [
        ingress,
        # alpha's context is cut to 4096 tokens and it streams over its stream channel (the default); beta holds
        # at most 2 requests, so a third is refused with 429, and streams through Ray's handle.
        model_app(ALPHA, models.alpha, context_length=ALPHA_CONTEXT),
        model_app(BETA, models.beta, max_num_seqs=2, advanced={"stream_channel": False}),
        # SmolLM2's real tokenizer with a Qwen3 tool template; no parser names: qwen3's tool-call and <think>
        # parsers are inferred from the template.
        model_app(TOOLS, tools_model, context_length=TOOLS_CONTEXT, chat_template_file=str(TOOLS_TEMPLATE)),
        model_app(VISION, write_qwen25_vl(root / "vision"), model_type="multimodal", context_length=VISION_CONTEXT),
        model_app(SPEECH, write_tiny_whisper(root / "speech", scale=4.0), model_type="stt"),
        model_app(VOICE, "default-tts", model_type="tts"),
        model_app(IMAGES, write_tiny_klein(root / "klein"), model_type="image-generation", config_name="flux2-klein-4b"),
        embedder,
    ]}


def models_running(http: httpx.Client) -> bool:
    """Whether every model the graph starts with runs, as its type."""
    response = http.get("/v1/admin/loaded-models")
    if response.status_code != 200:
        return False
    running = {m["id"]: m["type"] for m in response.json()["data"] if m["status"] == "running"}
    return all(running.get(model_id) == model_type for model_id, model_type in MODEL_TYPES.items())


def deploy_shared_graph(schema: dict, base_url: str) -> None:
    """Deploy `schema` (replacing whatever Serve runs) and wait until every model of it runs."""
    from ray.serve.schema import ServeDeploySchema

    deploy_graph(ServeDeploySchema.model_validate(copy.deepcopy(schema)))
    with httpx.Client(base_url=base_url, timeout=60) as http:
        wait_until(lambda: models_running(http), GRAPH_START_S, what=f"models {sorted(MODEL_TYPES)} running")
