"""Bodega's model-management routes (issue 29) in process, downloading through huggingface_hub from the local Hub
stand-in: SSE progress, the plain download, the list and its cancel, one transfer for two requests, a client that
leaves, Hub errors as events, the cache in GET /v1/models (and verify_with_hub), deleting a cached repo, keys."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path


from deployments.config import ModelConfig
from deployments.ingress.auth import ApiKeys
from tests.serve.local_stack import local_stack, send_streaming, wait_for
from tests.support.fake_hub import FakeHub, random_bytes

MIB = 1024 * 1024
WAIT_S = 60
OPENAI_CARD_KEYS = {"id", "object", "created", "owned_by", "status"}
CACHE_KEYS = {"size_gb", "download_percentage", "is_complete"}


def _sse(text: str) -> list[tuple[str, dict]]:
    """(event name, data) of each SSE event; keep-alive comments dropped."""
    events = []
    for block in text.strip().split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        if lines:
            name = next(line[len("event: "):] for line in lines if line.startswith("event: "))
            data = next(line[len("data: "):] for line in lines if line.startswith("data: "))
            events.append((name, json.loads(data)))
    return events


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _big_repo(hub: FakeHub, repo_id: str, shards: int, seed: int = 0) -> dict[str, bytes]:
    files = {"config.json": b'{"model_type": "llama"}',
             **{f"model-{i:05d}-of-{shards:05d}.safetensors": random_bytes(10 * MIB, seed + i) for i in range(shards)}}
    hub.add_repo(repo_id, files)
    return files


async def _downloads(stack) -> dict[str, dict]:
    response = await stack.http.get("/v1/admin/downloads")
    assert response.status_code == 200
    return {d["download_id"]: d for d in response.json()["data"]}


async def _models(stack, **params) -> dict[str, dict]:
    response = await stack.http.get("/v1/models", params=params)
    assert response.status_code == 200 and response.json()["object"] == "list"
    return {m["id"]: m for m in response.json()["data"]}


def test_the_stream_sends_ordered_progress_to_100_then_completed_and_the_source_bytes(hub, manager):
    files = _big_repo(hub, "org/big", shards=3)
    hub.bytes_per_second = 30 * MIB  # ~1 s: events spaced as on a real link

    async def scenario():
        async with local_stack([], downloads=manager) as stack:
            response = await stack.http.post("/v1/admin/download-model-stream", json={"repo_id": "org/big"})
            assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
            return _sse(response.text)

    events = asyncio.run(scenario())
    names = [name for name, _ in events]
    assert names == ["progress"] * (len(events) - 1) + ["completed"]
    progress = [data for name, data in events if name == "progress"]
    assert progress[0]["status"] == "resolving"
    downloading = [p for p in progress if p["status"] == "downloading"]
    assert len(downloading) >= 6  # the start, a step per 10 MiB chunk, each file's start and end
    assert [p["bytes_downloaded"] for p in downloading] == sorted(p["bytes_downloaded"] for p in downloading)
    assert [p["progress"] for p in downloading] == sorted(p["progress"] for p in downloading)
    total = sum(len(b) for b in files.values())
    assert downloading[-1]["progress"] == 100.0 and downloading[-1]["bytes_downloaded"] == total
    assert all(p["bytes_total"] == total and p["files_total"] == 4 for p in downloading)
    assert {p["current_file"] for p in downloading} >= set(files) - {"config.json"}
    assert any(p["speed_bytes_per_s"] > 0 and p["eta_s"] is not None for p in downloading)

    completed = events[-1][1]
    assert completed["status"] == "completed" and completed["progress"] == 100.0
    assert completed["bytes_downloaded"] == completed["bytes_total"] == completed["bytes_fetched"] == total
    assert len({d["download_id"] for _, d in events}) == 1 and completed["repo_id"] == "org/big"
    snapshot = Path(completed["snapshot_path"])
    assert snapshot == manager.cache_dir / "models--org--big" / "snapshots" / completed["commit"]
    assert {p.name for p in snapshot.iterdir()} == set(files)
    for name, data in files.items():
        assert _sha256(snapshot / name) == hashlib.sha256(data).hexdigest(), name


def test_the_plain_route_starts_or_joins_a_download_listed_and_cancelled(hub, manager):
    hub.add_repo("org/slow", {"config.json": b"{}", "model.safetensors": random_bytes(40 * MIB, 6)})
    hub.add_repo("org/small", {"config.json": b"{}", "model.safetensors": random_bytes(MIB, 7)})
    hub.bytes_per_second = 8 * MIB  # ~5 s

    async def scenario():
        async with local_stack([], downloads=manager) as stack:
            started = await stack.http.post("/v1/admin/download-model", json={"repo_id": "org/slow"})
            assert started.status_code == 202
            state = started.json()
            assert state["object"] == "model.download" and state["repo_id"] == "org/slow"
            assert state["revision"] == "main" and state["status"] in ("resolving", "downloading")
            download_id = state["download_id"]
            joined = await stack.http.post("/v1/admin/download-model", json={"repo_id": "org/slow"})
            assert joined.status_code == 202 and joined.json()["download_id"] == download_id

            async def flowing():
                return (await _downloads(stack))[download_id]["bytes_downloaded"] > 2

            await wait_for(flowing, WAIT_S)
            assert (await _downloads(stack))[download_id]["status"] == "downloading"
            busy = await stack.http.delete("/v1/models/local/org/slow")
            assert busy.status_code == 409 and busy.json()["error"]["code"] == "download_in_progress"

            cancelled = await stack.http.delete(f"/v1/admin/downloads/{download_id}")
            assert cancelled.status_code == 200
            body = cancelled.json()
            assert body["cancelled"] is True and body["status"] == "cancelled"
            assert body["error"]["code"] == "download_cancelled" and body["bytes_downloaded"] < body["bytes_total"]
            again = await stack.http.delete(f"/v1/admin/downloads/{download_id}")
            assert again.status_code == 200 and again.json()["cancelled"] is False
            unknown = await stack.http.delete("/v1/admin/downloads/dl-999")
            assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "download_not_found"
            assert unknown.json()["error"]["param"] == "download_id"

            hub.bytes_per_second = None
            small = (await stack.http.post("/v1/admin/download-model", json={"repo_id": "org/small"})).json()
            done = await wait_for(lambda: _finished(stack, small["download_id"]), WAIT_S)
            assert done["status"] == "completed" and done["progress"] == 100.0
            assert Path(done["snapshot_path"], "model.safetensors").read_bytes() == random_bytes(MIB, 7)
            listed = await _downloads(stack)
            assert [listed[download_id]["status"], listed[small["download_id"]]["status"]] == ["cancelled", "completed"]

            # The cancelled one is cached in part: listed as incomplete.
            models = await _models(stack)
            assert models["org/slow"]["is_complete"] is False and models["org/slow"]["download_percentage"] < 100
            assert models["org/small"]["is_complete"] is True

            for bad, param in (({"repo_id": "../etc"}, "repo_id"), ({"repo_id": "org/x", "revision": "../main"},
                               "revision"), ({"repo_id": "org/x", "hf_token": "t"}, "hf_token"), ({}, "repo_id")):
                refused = await stack.http.post("/v1/admin/download-model", json=bad)
                assert refused.status_code == 400 and refused.json()["error"]["param"] == param, bad

    asyncio.run(scenario())


async def _finished(stack, download_id: str) -> dict | None:
    state = (await _downloads(stack))[download_id]
    return state if state["status"] not in ("resolving", "downloading") else None


def test_two_streams_of_one_repo_are_one_transfer(hub, manager):
    _big_repo(hub, "org/shared", shards=2, seed=20)
    hub.bytes_per_second = 20 * MIB

    async def scenario():
        async with local_stack([], downloads=manager) as stack:
            stream = {"repo_id": "org/shared"}
            return await asyncio.gather(*(stack.http.post("/v1/admin/download-model-stream", json=stream)
                                          for _ in range(2)))

    first, second = (_sse(r.text) for r in asyncio.run(scenario()))
    assert first[-1][0] == second[-1][0] == "completed"
    assert first[-1][1]["download_id"] == second[-1][1]["download_id"]
    for path in ("config.json", "model-00000-of-00002.safetensors", "model-00001-of-00002.safetensors"):
        assert len(hub.file_gets("org/shared", path)) == 1, path


def test_a_client_that_leaves_the_stream_does_not_stop_the_download(hub, manager):
    files = _big_repo(hub, "org/orphan", shards=2, seed=30)
    hub.bytes_per_second = 10 * MIB  # ~2 s

    async def scenario():
        async with local_stack([], downloads=manager) as stack:
            messages = send_streaming(stack.app, "/v1/admin/download-model-stream", {"repo_id": "org/orphan"})
            async for message in messages:
                if any(data.get("bytes_downloaded", 0) > 0 for _, data in _sse(message.body)):
                    break  # the weights are flowing: the client goes away
            await messages.aclose()
            [download_id] = await _downloads(stack)
            assert (await _downloads(stack))[download_id]["status"] == "downloading"
            return await wait_for(lambda: _finished(stack, download_id), WAIT_S)

    done = asyncio.run(scenario())
    assert done["status"] == "completed"
    for name, data in files.items():
        assert Path(done["snapshot_path"], name).read_bytes() == data, name


def test_unknown_and_gated_repos_are_error_events_and_failed_downloads(hub, manager, monkeypatch, tmp_path):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no token file of the machine's user
    hub.add_repo("org/gated", {"config.json": b"{}", "model.safetensors": random_bytes(MIB, 5)}, gated_token="hf_ok")

    async def scenario():
        async with local_stack([], downloads=manager) as stack:
            missing = _sse((await stack.http.post("/v1/admin/download-model-stream",
                                                  json={"repo_id": "org/missing"})).text)
            gated = _sse((await stack.http.post("/v1/admin/download-model-stream", json={"repo_id": "org/gated"})).text)
            plain = (await stack.http.post("/v1/admin/download-model", json={"repo_id": "org/gated"})).json()
            failed = await wait_for(lambda: _finished(stack, plain["download_id"]), WAIT_S)
            allowed = await stack.http.post("/v1/admin/download-model-stream",
                                            json={"repo_id": "org/gated", "token": "hf_ok"})
            listed = await stack.http.get("/v1/admin/downloads")
            return missing, gated, failed, _sse(allowed.text), allowed.text + listed.text

    missing, gated, failed, allowed, bodies = asyncio.run(scenario())
    assert [name for name, _ in missing] == ["progress", "error"]
    error = missing[-1][1]
    assert error["status"] == "failed" and error["repo_id"] == "org/missing"
    assert error["error"]["code"] == "repo_not_found" and error["error"]["status_code"] == 404
    assert error["error"]["param"] == "repo_id" and "org/missing" in error["error"]["message"]

    assert gated[-1][0] == "error" and gated[-1][1]["error"]["code"] == "gated_repo"
    assert gated[-1][1]["error"]["status_code"] == 403 and "HF_TOKEN" in gated[-1][1]["error"]["message"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "gated_repo"
    assert allowed[-1][0] == "completed" and allowed[-1][1]["files_total"] == 2, allowed[-1]
    assert "hf_ok" not in bodies  # the token is never echoed


def test_models_lists_the_cache_beside_the_loaded_models_and_verifies_with_the_hub(hub, manager, tiny_models):
    hub.add_folder("org/alpha", tiny_models.alpha)
    served = ModelConfig(model_id="tiny-alpha", model_path=str(tiny_models.alpha))

    async def scenario():
        async with local_stack([served], downloads=manager) as stack:
            assert set(await _models(stack)) == {"tiny-alpha"}  # nothing cached yet
            await asyncio.to_thread(manager.download, "org/alpha")
            models = await _models(stack)
            assert list(models) == ["tiny-alpha", "org/alpha"]
            assert set(models["tiny-alpha"]) == OPENAI_CARD_KEYS  # OpenAI's shape, untouched
            cached = models["org/alpha"]
            assert set(cached) == OPENAI_CARD_KEYS | CACHE_KEYS
            assert (cached["object"], cached["owned_by"], cached["status"]) == ("model", "org", "cached")  # Bodega's
            downloaded = [p.name for p in tiny_models.alpha.iterdir() if p.suffix in (".json", ".safetensors")]
            size = sum((tiny_models.alpha / name).stat().st_size for name in downloaded)
            assert cached["size_gb"] == round(size / 1e9, 3) and isinstance(cached["created"], int)
            assert (cached["download_percentage"], cached["is_complete"]) == (100.0, True)

            verified = (await _models(stack, verify_with_hub="true"))["org/alpha"]
            assert (verified["is_latest"], verified["missing_files"], verified["hub_error"]) == (True, [], None)
            assert verified["hub_commit"] == hub.repos["org/alpha"].commit
            assert "is_latest" not in (await _models(stack, verify_with_hub="true"))["tiny-alpha"]

            source = {p.name: p.read_bytes() for p in tiny_models.alpha.iterdir() if p.is_file()}
            hub.add_repo("org/alpha", {**source, "config.json": source["config.json"] + b" "})  # a new commit
            changed = (await _models(stack, verify_with_hub=True))["org/alpha"]
            # The new commit's snapshot is not cached at all: every file of it is missing.
            assert (changed["is_latest"], changed["missing_files"]) == (False, sorted(downloaded))
            assert changed["is_complete"] is True  # what the cache holds is whole; the Hub has moved on

            bad = await stack.http.get("/v1/models", params={"verify_with_hub": "maybe"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "query.verify_with_hub"

            manager.endpoint = "http://127.0.0.1:9"  # a mirror nobody listens at: a note per repo, not a failed list
            unreachable = (await _models(stack, verify_with_hub="true"))["org/alpha"]
            assert unreachable["is_latest"] is None and unreachable["missing_files"] is None
            assert "cannot reach the Hugging Face Hub" in unreachable["hub_error"]
            assert unreachable["is_complete"] is True

    asyncio.run(scenario())


def test_a_cached_repo_is_deleted_only_when_no_loaded_model_serves_it(hub, manager, tiny_models, monkeypatch):
    hub.add_folder("org/alpha", tiny_models.alpha)
    monkeypatch.setenv("HF_HUB_CACHE", str(manager.cache_dir))  # where loads by repo id look

    async def scenario():
        async with local_stack([], downloads=manager) as stack:
            stream = await stack.http.post("/v1/admin/download-model-stream", json={"repo_id": "org/alpha"})
            assert _sse(stream.text)[-1][0] == "completed"
            load = await stack.http.post("/v1/admin/load-model", json={"model_id": "hub-alpha", "model_path": "org/alpha"})
            assert load.status_code == 200 and load.json()["status"] == "loaded"
            models = await _models(stack)
            assert models["hub-alpha"]["status"] == "running"
            assert models["hub-alpha"]["owned_by"] == "orchard" and models["hub-alpha"]["is_complete"] is True
            assert set(models["hub-alpha"]) == OPENAI_CARD_KEYS | CACHE_KEYS
            # Still listed as downloaded under its repo id (Bodega lists the cache), owned by the repo's owner.
            assert (models["org/alpha"]["owned_by"], models["org/alpha"]["is_complete"]) == ("org", True)

            refused = await stack.http.delete("/v1/models/local/org/alpha")
            assert refused.status_code == 409
            assert refused.json()["error"]["code"] == "model_in_use" and "hub-alpha" in refused.json()["error"]["message"]
            assert (manager.cache_dir / "models--org--alpha").is_dir()

            # By the repo id it was loaded from (Bodega's "full path model IDs"); answered once it is gone.
            assert (await stack.http.delete("/v1/admin/unload-model/org/alpha")).json()["status"] == "unloaded"
            # Bodega's documented path and a repo id in other case (the Hub's ids ignore case).
            deleted = await stack.http.delete("/v1/models/ORG/Alpha")
            assert deleted.status_code == 200
            body = deleted.json()
            assert (body["id"], body["deleted"]) == ("ORG/Alpha", True) and body["freed_bytes"] > 0
            assert not (manager.cache_dir / "models--org--alpha").exists()
            assert "org/alpha" not in await _models(stack)

            gone = await stack.http.delete("/v1/models/local/org/alpha")
            assert gone.status_code == 404 and gone.json()["error"]["code"] == "cached_model_not_found"
            invalid = await stack.http.delete("/v1/models/local/not-a-repo-id")
            assert invalid.status_code == 400 and invalid.json()["error"]["param"] == "repo_id"

    asyncio.run(scenario())


ADMIN_ROUTES = [
    ("POST", "/v1/admin/download-model", {"repo_id": "org/x"}),
    ("POST", "/v1/admin/download-model-stream", {"repo_id": "org/x"}),
    ("GET", "/v1/admin/downloads", None),
    ("DELETE", "/v1/admin/downloads/dl-1", None),
    ("DELETE", "/v1/models/local/org/x", None),
    ("DELETE", "/v1/models/org/x", None),  # Bodega's path of the same route
]


def test_the_hub_routes_need_the_admin_key(manager):
    keys = ApiKeys(["inference-key"], "admin-key")

    async def scenario():
        async with local_stack([], downloads=manager, keys=keys) as stack:
            for method, path, body in ADMIN_ROUTES:
                for headers, status, code in (({}, 401, "invalid_api_key"),
                                              ({"Authorization": "Bearer inference-key"}, 403,
                                               "insufficient_permissions")):
                    refused = await stack.http.request(method, path, json=body, headers=headers)
                    assert refused.status_code == status and refused.json()["error"]["code"] == code, (path, headers)
            assert not manager.downloads()  # nothing started
            admin = {"Authorization": "Bearer admin-key"}
            assert (await stack.http.get("/v1/admin/downloads", headers=admin)).status_code == 200
            listed = await stack.http.get("/v1/models", headers={"Authorization": "Bearer inference-key"})
            assert listed.status_code == 200
            card = await stack.http.get("/v1/models/org/x", headers={"Authorization": "Bearer inference-key"})
            assert card.status_code == 404  # reading a card stays the inference key's: only DELETE is admin

    asyncio.run(scenario())


def test_without_a_download_manager_there_are_no_hub_routes_and_no_cache_entries(tiny_models):
    served = ModelConfig(model_id="tiny-alpha", model_path=str(tiny_models.alpha))

    async def scenario():
        async with local_stack([served]) as stack:
            models = await stack.http.get("/v1/models", params={"verify_with_hub": "true"})
            assert models.json() == {"object": "list", "data": [
                {"id": "tiny-alpha", "object": "model", "created": models.json()["data"][0]["created"],
                 "owned_by": "orchard", "status": "running"}]}
            for method, path, body in ADMIN_ROUTES[:4]:
                absent = await stack.http.request(method, path, json=body)
                assert absent.status_code == 404 and absent.json()["error"]["code"] == "not_found", path
            assert "/v1/admin/download-model" not in stack.app.openapi()["paths"]

    asyncio.run(scenario())


def test_a_repo_whose_snapshot_folder_a_configured_model_serves_is_not_deleted(hub, manager, tiny_models):
    hub.add_folder("org/alpha", tiny_models.alpha)
    snapshot = manager.download("org/alpha").snapshot_path
    served = ModelConfig(model_id="from-folder", model_path=str(snapshot))  # serve_config.yaml naming the folder

    async def scenario():
        async with local_stack([served], downloads=manager) as stack:
            refused = await stack.http.delete("/v1/models/local/org/alpha")
            assert refused.status_code == 409 and refused.json()["error"]["code"] == "model_in_use"
            assert "from-folder" in refused.json()["error"]["message"]

    asyncio.run(scenario())
    assert (snapshot / "model.safetensors").is_file()


def test_a_quiet_stream_sends_keep_alives_and_loses_no_event(hub, manager):
    data = random_bytes(10 * MIB, 40)  # one huggingface_hub chunk: no byte event until the file is done
    hub.add_repo("org/quiet", {"config.json": b"{}", "model.safetensors": data})
    hub.bytes_per_second = 5 * MIB  # ~2 s of silence

    async def scenario():
        async with local_stack([], downloads=manager, keepalive_s=0.2) as stack:
            return (await stack.http.post("/v1/admin/download-model-stream", json={"repo_id": "org/quiet"})).text

    text = asyncio.run(scenario())
    assert text.count(": keep-alive\n\n") >= 3
    events = _sse(text)
    assert events[-1][0] == "completed" and [n for n, _ in events[:-1]] == ["progress"] * (len(events) - 1)
    weights = [d for _, d in events if d.get("current_file") == "model.safetensors"]
    assert [d["files_done"] for d in weights] == [1, 1, 2] and weights[-1]["progress"] == 100.0
    assert Path(events[-1][1]["snapshot_path"], "model.safetensors").read_bytes() == data


def test_bodegas_documented_download_body_works_on_both_routes(hub, manager):
    """Bodega's docs download with {"model_path": "SRSWTI/bodega-raptor-8b-mxfp4"} (Orchard's own name is repo_id):
    the plain route answers 202 for that repo, the stream sends status/progress events to completed; both names at
    once are a 400."""
    documented = "SRSWTI/bodega-raptor-8b-mxfp4"
    hub.add_repo(documented, {"config.json": b'{"model_type": "llama"}', "model.safetensors": random_bytes(MIB, 9)})

    async def scenario():
        async with local_stack([], downloads=manager) as stack:
            streamed = await stack.http.post("/v1/admin/download-model-stream", json={"model_path": documented})
            plain = await stack.http.post("/v1/admin/download-model", json={"model_path": documented})
            both = await stack.http.post("/v1/admin/download-model", json={"model_path": documented, "repo_id": "a/b"})
            return streamed, plain, both

    streamed, plain, both = asyncio.run(scenario())
    events = _sse(streamed.text)
    assert streamed.status_code == 200 and events[-1][0] == "completed"
    assert all({"status", "progress", "repo_id"} <= set(data) for _, data in events)
    assert events[-1][1]["repo_id"] == documented and events[-1][1]["progress"] == 100.0
    assert any(data.get("current_file") for _, data in events)
    assert plain.status_code == 202 and plain.json()["repo_id"] == documented
    assert both.status_code == 400 and "give one" in both.json()["error"]["message"]
