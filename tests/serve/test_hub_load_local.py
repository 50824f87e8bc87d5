"""Load by Hugging Face repo id (issue 29, point 3) over the in-process stack, against the Hub stand-in: an admin
load with auto_download fetches the repo, then serves it; without auto_download an uncached repo is a 400; a repo the
Hub lacks fails the load with the Hub's answer; serve_config.yaml's repo ids download unless auto_download is false."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from deployments.config import ModelConfig
from deployments.hub.downloads import DownloadManager
from deployments.model_sources import check_model_sources
from engine.errors import InvalidRequestError
from tests.serve.local_stack import local_stack, wait_for
from tests.support.fake_hub import FakeHub
from tests.support.tiny_models import LLAMA, write_model, write_wordlevel_tokenizer

REPO = "mlx-community/tiny-llama"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hub-load")
    return write_model(root / "llama", dict(LLAMA, vocab_size=256), write_wordlevel_tokenizer(root / "tok", 256),
                       scale=3.0)


@pytest.fixture
def hub(tiny_llama, tmp_path, monkeypatch):
    """The stand-in serving the tiny llama as REPO; this test's own hub cache, named the way huggingface_hub reads
    it (the registry finds snapshots there, DownloadManager() writes there)."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    with FakeHub() as running:
        running.add_folder(REPO, tiny_llama)
        monkeypatch.setenv("HF_ENDPOINT", running.url)
        yield running


async def _status(stack, model_id: str) -> dict | None:
    data = (await stack.http.get("/v1/admin/loaded-models")).json()["data"]
    return next((m for m in data if m["id"] == model_id), None)


def test_admin_load_downloads_the_repo_then_serves_it(hub):
    """Bodega's load-model takes any Hugging Face repo: an uncached one downloads first unless auto_download is
    false, and the answer ("loaded") comes once it serves."""
    async def scenario():
        async with local_stack([], downloads=DownloadManager()) as stack:
            refused = await stack.http.post("/v1/admin/load-model", json={
                "model_path": REPO, "model_id": "tiny", "auto_download": False})
            loaded = await stack.http.post("/v1/admin/load-model", json={"model_path": REPO, "model_id": "tiny"})
            assert loaded.status_code == 200, loaded.text
            status = await _status(stack, "tiny")
            answer = await stack.http.post("/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "t1"}], "max_tokens": 3, "ignore_eos": True})
            downloads = stack.registry.downloads.downloads()
            return refused, loaded, status, answer, downloads

    refused, loaded, status, answer, downloads = asyncio.run(scenario())
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "model_path"
    assert "auto_download" in refused.json()["error"]["message"]
    assert loaded.json() == {"status": "loaded", "model_id": "tiny", "model_path": REPO, "model_type": "lm"}
    assert status["status"] == "running" and status["model_path"] == REPO, status  # as sent: no server path
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3
    assert [(d.repo_id, d.finished) for d in downloads] == [(REPO, True)]
    assert hub.file_gets(REPO, "model.safetensors")  # the weights came from the Hub


async def _running_or_failed(stack, model_id: str) -> dict | None:
    status = await _status(stack, model_id)
    return status if status is not None and status["status"] in ("running", "failed") else None


def test_a_repo_the_hub_lacks_fails_the_load_saying_so(hub):
    async def scenario():
        async with local_stack([], downloads=DownloadManager()) as stack:
            answer = await stack.http.post("/v1/admin/load-model", json={
                "model_path": "nobody/missing", "model_id": "missing"})
            accepted = await stack.http.post("/v1/admin/load-model?wait=false", json={
                "model_path": "nobody/missing", "model_id": "missing"})  # a failed model may be loaded again
            return answer, accepted, await wait_for(lambda: _running_or_failed(stack, "missing"), timeout_s=60)

    answer, accepted, status = asyncio.run(scenario())
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "repo_not_found"  # the Hub's answer
    assert answer.json()["error"]["param"] == "model_path"  # the load's field that named the repo
    assert "nobody/missing" in answer.json()["error"]["message"]
    assert accepted.status_code == 202 and accepted.json()["status"] == "loading"
    assert status["status"] == "failed" and "nobody/missing" in status["error"]


def test_serve_config_repo_ids_download_unless_told_not_to(hub, tmp_path):
    with pytest.raises(InvalidRequestError, match="not in the local Hugging Face cache"):
        check_model_sources(ModelConfig(model_path=REPO, auto_download=False), base_dir=tmp_path)
    assert not hub.file_gets(REPO)
    resolved = check_model_sources(ModelConfig(model_path=REPO), base_dir=tmp_path)
    folder = Path(resolved.model_path)
    assert folder.is_dir() and (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert str(tmp_path / "hf-cache") in str(folder)
    gets = len(hub.file_gets(REPO))
    again = check_model_sources(ModelConfig(model_path=REPO, auto_download=False), base_dir=tmp_path)
    assert again.model_path == resolved.model_path
    assert len(hub.file_gets(REPO)) == gets  # cached: nothing fetched again


def test_a_gguf_repo_loads_one_of_its_files_converted(hub, tmp_path, monkeypatch):
    """A repo of GGUF files: gguf_file names the one to load; only it is fetched, converted by the GGUF import."""
    from gguf import GGMLQuantizationType as Q

    from tests.engine.test_gguf_import import hf_weights, write_tiny_gguf

    monkeypatch.setenv("ORCHARD_HOME", str(tmp_path / "orchard"))
    f32 = write_tiny_gguf(tmp_path / "tiny-F32.gguf", hf_weights(tied=False), Q.F32).read_bytes()
    q8 = write_tiny_gguf(tmp_path / "tiny-Q8_0.gguf", hf_weights(tied=False), Q.Q8_0).read_bytes()
    hub.add_repo("someone/tiny-GGUF", {"tiny-F32.gguf": f32, "tiny-Q8_0.gguf": q8, "README.md": b"# tiny\n"})
    body = {"model_path": "someone/tiny-GGUF", "model_id": "tiny-gguf", "gguf_file": "tiny-Q8_0.gguf",
            "auto_download": True}

    async def scenario():
        async with local_stack([], downloads=DownloadManager()) as stack:
            bad = await stack.http.post("/v1/admin/load-model", json={**body, "gguf_file": "../x.gguf"})
            accepted = await stack.http.post("/v1/admin/load-model", json=body)
            status = await _status(stack, "tiny-gguf")
            answer = await stack.http.post("/v1/chat/completions", json={
                "model": "tiny-gguf", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "ignore_eos": True})
            return bad, accepted, status, answer, stack.registry.named("tiny-gguf").info.model_path

    bad, accepted, status, answer, served_from = asyncio.run(scenario())
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "gguf_file"
    assert accepted.status_code == 200 and status["status"] == "running", status
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2
    assert hub.file_gets("someone/tiny-GGUF", "tiny-Q8_0.gguf")
    assert not hub.file_gets("someone/tiny-GGUF", "tiny-F32.gguf")  # only the file named
    assert status["model_path"] == "someone/tiny-GGUF"  # as sent; the model serves from the converted folder:
    assert Path(served_from).parent == tmp_path / "orchard" / "models" / "gguf"


def test_a_pinned_revision_loads_that_commit(hub, tmp_path):
    commit = hub.repos[REPO].commit

    async def scenario():
        async with local_stack([], downloads=DownloadManager()) as stack:
            bad = await stack.http.post("/v1/admin/load-model", json={
                "model_path": REPO, "model_id": "pinned", "revision": "../main", "auto_download": True})
            accepted = await stack.http.post("/v1/admin/load-model", json={
                "model_path": REPO, "model_id": "pinned", "revision": commit, "auto_download": True})
            status = await _status(stack, "pinned")
            return bad, accepted, status, stack.registry.named("pinned").loaded_from

    bad, accepted, status, loaded_from = asyncio.run(scenario())
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "revision"
    assert accepted.status_code == 200 and status["status"] == "running", status
    assert Path(loaded_from).name == commit  # the snapshot of that commit
    resolved = check_model_sources(ModelConfig(model_path=REPO, revision=commit, auto_download=False), base_dir=tmp_path)
    assert Path(resolved.model_path).name == commit
    with pytest.raises(InvalidRequestError, match="not in the local Hugging Face cache"):
        check_model_sources(ModelConfig(model_path=REPO, revision="v9", auto_download=False), base_dir=tmp_path)


def test_a_load_joins_the_download_of_its_repo_in_progress(hub):
    """Bodega's docs download a repo, then load it: a load while that download runs waits on it (one transfer of
    the weights), and answers once the model serves."""
    hub.bytes_per_second = 200_000  # the tiny model's ~0.4 MB of weights take about two seconds

    async def scenario():
        async with local_stack([], downloads=DownloadManager()) as stack:
            started = await stack.http.post("/v1/admin/download-model", json={"model_path": REPO})
            loaded = await stack.http.post("/v1/admin/load-model", json={"model_path": REPO, "model_id": "tiny"})
            return started, loaded, stack.registry.downloads.downloads()

    started, loaded, downloads = asyncio.run(scenario())
    assert started.status_code == 202 and started.json()["status"] != "completed"
    assert loaded.status_code == 200 and loaded.json()["status"] == "loaded"
    assert [(d.repo_id, d.finished) for d in downloads] == [(REPO, True)]  # one download, joined
    assert len(hub.file_gets(REPO, "model.safetensors")) == 1


def test_repo_ids_match_the_cache_ignoring_case(hub, tmp_path):
    """The Hub's repo ids ignore case (Bodega's docs write "srswti/..." and "SRSWTI/..." for one repo): a cached repo
    is found under either spelling."""
    cached = check_model_sources(ModelConfig(model_path=REPO), base_dir=tmp_path)
    shouted = check_model_sources(ModelConfig(model_path=REPO.upper(), auto_download=False), base_dir=tmp_path)
    assert shouted.model_path == cached.model_path


def test_a_request_naming_a_cached_repo_the_operator_allows_loads_it_on_demand(hub, tiny_llama):
    """auto_load_repos: a repo complete in the local cache and matching a pattern loads for the request that names
    it (as an on_demand model); an uncached one is never downloaded for a request, one the patterns leave out is
    unknown, and so is every repo without the setting."""
    other = "someone/tiny-llama"
    hub.add_folder(other, tiny_llama)
    chat = {"messages": [{"role": "user", "content": "t1"}], "max_tokens": 3, "ignore_eos": True}

    async def scenario():
        async with local_stack([], downloads=DownloadManager(), auto_load_repos=["mlx-community/*"]) as stack:
            uncached = await stack.http.post("/v1/chat/completions", json={**chat, "model": REPO})
            for repo in (REPO, other):
                pulled = await stack.http.post("/v1/admin/download-model-stream", json={"repo_id": repo})
                assert pulled.status_code == 200 and '"error"' not in pulled.text, pulled.text
            answer = await stack.http.post("/v1/chat/completions", json={**chat, "model": REPO})
            left_out = await stack.http.post("/v1/chat/completions", json={**chat, "model": other})
            listed = {m["id"]: m.get("status") for m in (await stack.http.get("/v1/models")).json()["data"]}
        async with local_stack([], downloads=DownloadManager()) as plain:
            off = await plain.http.post("/v1/chat/completions", json={**chat, "model": REPO})
        return uncached, left_out, answer, listed, off

    uncached, left_out, answer, listed, off = asyncio.run(scenario())
    for refused in (uncached, off):  # no model loaded yet, and none loads for it
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_models_loaded", refused.text
    assert left_out.status_code == 404 and left_out.json()["error"]["code"] == "model_not_found", left_out.text
    assert len(hub.file_gets(REPO, "model.safetensors")) == 1  # by the download, never for a request
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3, answer.text
    assert listed == {REPO: "running", other: "cached"}  # /v1/models lists what the cache holds
