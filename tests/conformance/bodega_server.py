"""Orchard's in-process stack reached at Bodega's documented address, http://localhost:44468, through the `requests`
library, so the docs' curl bodies and Python snippets run unchanged.

The stack (tests/serve/local_stack.py: the ingress app over real engines on threads) runs on an event loop of its
own thread, so one server can outlive a test and serve a whole module; `requests` reaches it through a transport
adapter that hands each request to the ASGI app, as httpx's ASGI transport does for the other serving tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest
import requests
from requests.adapters import BaseAdapter
from requests.structures import CaseInsensitiveDict
from requests.utils import get_encoding_from_headers

from deployments.config import ModelConfig
from deployments.ingress_config import RagConfig
from deployments.hub.downloads import DownloadManager
from tests.serve.local_stack import LocalStack, local_stack
from tests.support.fake_hub import FakeHub

BASE_URL = "http://localhost:44468"  # Bodega's documented address (docs L33 and every example)
CALL_TIMEOUT_S = 120.0  # a bound for a hang: a load downloads and starts a tiny model in ~1 s here


class BodegaServer:
    """A local_stack on a background event loop. `requests` is a `requests.Session` whose calls to BASE_URL reach
    it: the docs' snippets call `requests.post(...)`, so a test binds `requests = server.requests`."""

    def __init__(self, configs: list[ModelConfig] | None = None, rag: RagConfig | None = None) -> None:
        self._configs = configs or []
        self._rag = rag
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="bodega-server", daemon=True)
        self._context: contextlib.AbstractAsyncContextManager[LocalStack] | None = None
        self.stack: LocalStack | None = None
        self.hub: FakeHub | None = None  # set by bodega_server()
        self.requests = requests.Session()
        self.requests.trust_env = False  # no proxy or .netrc of the machine's user: only the adapter below
        self.requests.mount(BASE_URL, _AsgiAdapter(self))

    def __enter__(self) -> "BodegaServer":
        self._thread.start()
        # DownloadManager() reads HF_HUB_CACHE / HF_ENDPOINT now: the caller has pointed them at the Hub stand-in.
        context = local_stack(self._configs, rag=self._rag, downloads=DownloadManager())
        try:
            self.stack = self.run(context.__aenter__())
        except BaseException:
            self._stop_loop()
            raise
        self._context = context
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._context is not None:
                self.run(self._context.__aexit__(None, None, None))
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()

    def run(self, coroutine: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
        """Run `coroutine` on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout_s)


class _AsgiAdapter(BaseAdapter):
    """requests' transport to the in-process app: the whole response is read before it is handed over (as httpx's
    ASGI transport does), then served to requests from memory, so `iter_lines()` reads it as from a socket."""

    def __init__(self, server: BodegaServer) -> None:
        super().__init__()
        self._server = server

    def send(self, request: requests.PreparedRequest, stream: bool = False, timeout: Any = None, verify: Any = True,
             cert: Any = None, proxies: Any = None) -> requests.Response:
        path = request.url[len(BASE_URL):] or "/"
        body = request.body.encode() if isinstance(request.body, str) else request.body
        answer = self._server.run(self._server.stack.http.request(
            request.method, path, content=body, headers=dict(request.headers)))
        response = requests.Response()
        response.status_code = answer.status_code
        response.headers = CaseInsensitiveDict(answer.headers)
        response.encoding = get_encoding_from_headers(response.headers)
        response.raw = io.BytesIO(answer.content)
        response.url, response.request, response.reason = request.url, request, answer.reason_phrase
        return response

    def close(self) -> None:
        pass


@contextlib.contextmanager
def bodega_hub(repos: dict[str, Path], cache_dir: Path) -> Iterator[FakeHub]:
    """The Hugging Face Hub stand-in serving each repo id's folder, with HF_ENDPOINT and HF_HUB_CACHE pointed at it
    and at `cache_dir/hub` (empty: the docs' flow starts with nothing downloaded) while the block runs; Orchard's
    own home (quantized copies, RAG indexes) is `cache_dir/orchard`."""
    environment = {"HF_HUB_CACHE": str(cache_dir / "hub"), "ORCHARD_HOME": str(cache_dir / "orchard")}
    with FakeHub() as hub, _environment(HF_ENDPOINT=hub.url, **environment):
        files_by_folder: dict[Path, dict[str, bytes]] = {}
        for repo_id, folder in repos.items():
            if folder not in files_by_folder:  # one copy of the bytes for every id that serves a folder
                files_by_folder[folder] = hub.add_folder(repo_id, folder).files
            else:
                hub.add_repo(repo_id, files_by_folder[folder])
        yield hub


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        for name, value in values.items():
            patch.setenv(name, value)
        yield


def curl_json(requests_module: requests.Session, method: str, path: str, data: str | None = None) -> requests.Response:
    """A docs curl command: `-X METHOD BASE_URL+path [-H "Content-Type: application/json" -d 'data']`, the body sent
    as the docs' text itself (checked to be JSON first, so a typo in a copied body fails here, not in the server)."""
    if data is None:
        return requests_module.request(method, BASE_URL + path)
    json.loads(data)
    return requests_module.request(method, BASE_URL + path, data=data.encode(),
                                   headers={"Content-Type": "application/json"})


@contextlib.contextmanager
def bodega_server(repos: dict[str, Path], cache_dir: Path, configs: list[ModelConfig] | None = None,
                  rag: RagConfig | None = None) -> Iterator[BodegaServer]:
    """A BodegaServer over the Hub stand-in serving `repos` (an empty `cache_dir`: nothing downloaded yet)."""
    with bodega_hub(repos, cache_dir) as hub, BodegaServer(configs, rag) as server:
        server.hub = hub
        yield server


# ---- setup steps (not replays): bring the server to the state a docs example starts from ----------------------
def loaded_models(requests_module: requests.Session) -> dict[str, dict[str, Any]]:
    response = requests_module.get(f"{BASE_URL}/v1/admin/loaded-models")
    assert response.status_code == 200, response.text
    return {model["id"]: model for model in response.json()["data"]}


def orchard_id(body: dict[str, Any]) -> str:
    """The id a load body gets: its model_id, else the last part of its model_path (Orchard's default)."""
    return body.get("model_id") or body["model_path"].rstrip("/").rsplit("/", 1)[-1]


def absent(requests_module: requests.Session, *model_ids: str) -> None:
    """Unload these models if loaded, so that a docs load of the same id starts from a clean server."""
    for model_id in set(model_ids) & set(loaded_models(requests_module)):
        response = requests_module.delete(f"{BASE_URL}/v1/admin/unload-model/{model_id}")
        assert response.status_code == 200, response.text


def ensure_loaded(requests_module: requests.Session, body: dict[str, Any]) -> None:
    """Load `body` unless its id already runs (a docs example that needs a model another example loads)."""
    model = loaded_models(requests_module).get(orchard_id(body))
    if model is not None and model["status"] == "running":
        return
    absent(requests_module, orchard_id(body))  # a failed entry of that id is replaced
    response = requests_module.post(f"{BASE_URL}/v1/admin/load-model", json=body)
    assert response.status_code == 200, response.text


def ensure_downloaded(requests_module: requests.Session, repo_id: str) -> None:
    """Download `repo_id` into the cache (Bodega's route; its stream ends when the download does)."""
    response = requests_module.post(f"{BASE_URL}/v1/admin/download-model-stream", json={"model_path": repo_id})
    assert response.status_code == 200, response.text
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]
    assert events and events[-1]["status"] == "completed", events[-1:]
