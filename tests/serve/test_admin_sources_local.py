"""What an admin load may name (issue 25): folders under model_roots or cached Hugging Face repo ids, never
trust_remote_code or chat_template_file, never a reserved or over-long id; the same rules when the stored list is
restored. In process (no Ray)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import pytest

from deployments.config import ModelConfig
from deployments.model_sources import check_model_sources
from deployments.ingress.local_models import LOCAL_INGRESS_APP, LocalBackend
from engine.errors import ModelLoadError
from tests.serve.local_stack import local_stack, wait_for

CHAT = {"messages": [{"role": "user", "content": "t1"}], "max_tokens": 3, "temperature": 0}
REVISION = "0123456789abcdef0123456789abcdef01234567"


def _rce_folder(source: Path, root: Path) -> tuple[Path, Path]:
    """A working model folder whose config.json names a model_file that leaves a marker if it ever runs."""
    folder = root / "rce"
    shutil.copytree(source, folder)
    marker = root.parent / "model_file_ran"
    (folder / "evil.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
        "from mlx_lm.models.llama import Model, ModelArgs\n"
    )
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, model_file="evil.py")))
    return folder, marker


def _fake_hub_repo(hub: Path, repo_id: str, source: Path) -> Path:
    """huggingface_hub's cache layout: blobs/<sha256>, snapshots/<rev>/<name> -> blob, refs/main = <rev>."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for file in source.iterdir():
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


async def _loaded(stack) -> dict[str, dict]:
    return {m["id"]: m for m in (await stack.http.get("/v1/admin/loaded-models")).json()["data"]}


async def _has_status(stack, model_id: str, status: str) -> bool:
    return (await _loaded(stack)).get(model_id, {}).get("status") == status


def _error(response) -> dict:
    return response.json()["error"]


def test_model_file_never_runs_over_http_or_without_the_flag(tiny_models, tmp_path):
    roots = tmp_path / "models"
    roots.mkdir()
    folder, marker = _rce_folder(tiny_models.gamma, roots)

    async def over_http():
        async with local_stack([], tmp_path / "state", model_roots=[str(roots)]) as stack:
            flagged = await stack.http.post(
                "/v1/admin/load-model", json={"model_id": "rce", "model_path": str(folder), "trust_remote_code": True}
            )
            assert flagged.status_code == 400 and _error(flagged)["param"] == "trust_remote_code"
            assert "operator setting" in _error(flagged)["message"]
            assert "serve_config.yaml" in _error(flagged)["message"]
            assert not (tmp_path / "state" / "models.json").exists()
            assert "rce" not in await _loaded(stack)

            plain = await stack.http.post("/v1/admin/load-model", json={"model_id": "rce", "model_path": str(folder)})
            assert plain.status_code == 503 and "custom module ('evil.py')" in _error(plain)["message"]
            assert "custom module ('evil.py')" in (await _loaded(stack))["rce"]["error"]
            refused = await stack.http.post("/v1/chat/completions", json={"model": "rce", **CHAT})
            assert refused.status_code == 503 and _error(refused)["code"] == "model_load_failed"

    async def as_in_serve_config():  # the operator's own config, without trust_remote_code
        config = check_model_sources(ModelConfig(model_id="rce", model_path=str(folder)), base_dir=tmp_path)
        with pytest.raises(ModelLoadError, match="custom module"):
            await LocalBackend().deploy(config)

    asyncio.run(over_http())
    asyncio.run(as_in_serve_config())
    assert not marker.exists(), "the folder's model_file ran"


def test_chat_template_file_is_an_operator_setting(tiny_models, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the server's secret")

    async def scenario():
        async with local_stack([], tmp_path / "state", model_roots=[str(tiny_models.alpha.parent)]) as stack:
            answers = [
                await stack.http.post(
                    "/v1/admin/load-model", json={"model_path": str(tiny_models.gamma), "chat_template_file": path}
                )
                for path in (str(secret), "/etc/shadow", "/no/such/file")
            ]
            # The same answer whether the file exists or not: nothing about the server's files leaks.
            assert {a.status_code for a in answers} == {400}
            assert len({a.text for a in answers}) == 1
            error = _error(answers[0])
            assert error["param"] == "chat_template_file" and "operator setting" in error["message"]
            assert str(tmp_path) not in error["message"]
            assert not (tmp_path / "state" / "models.json").exists()
            assert await _loaded(stack) == {}

    asyncio.run(scenario())


def test_reserved_and_over_long_ids_are_refused_before_anything_is_stored(tiny_models, tmp_path):
    alpha = ModelConfig(model_id="alpha", model_path=str(tiny_models.alpha))

    async def scenario():
        async with local_stack([alpha], tmp_path, model_roots=[str(tiny_models.alpha.parent)]) as stack:
            http = stack.http
            gamma = str(tiny_models.gamma)
            ingress = await http.post("/v1/admin/load-model", json={"model_id": LOCAL_INGRESS_APP, "model_path": gamma})
            assert ingress.status_code == 400 and _error(ingress)["param"] == "model_id"
            assert f"model_id '{LOCAL_INGRESS_APP}' is reserved" in _error(ingress)["message"]
            for length in (129, 256):
                long_id = await http.post("/v1/admin/load-model", json={"model_id": "m" * length, "model_path": gamma})
                assert long_id.status_code == 400 and _error(long_id)["param"] == "model_id"
                assert f"model_id is {length} characters long; the most is 128" in _error(long_id)["message"]
            assert not (tmp_path / "models.json").exists()
            # A status poll now (what the periodic poll runs): the backend's view has nothing new either. A load
            # the checks had let through would show already: its entry is made before its deploy starts.
            await stack.registry.refresh(force=True)
            assert set(await _loaded(stack)) == {"alpha"}
            assert (await http.post("/v1/chat/completions", json={"model": "alpha", **CHAT})).status_code == 200

    asyncio.run(scenario())


def test_restore_skips_stored_entries_an_admin_load_would_refuse(tiny_models, tmp_path, caplog):
    roots = tmp_path / "models"
    roots.mkdir()
    rce, marker = _rce_folder(tiny_models.gamma, roots)
    good = roots / "good"
    shutil.copytree(tiny_models.gamma, good)
    secret = tmp_path / "secret.txt"
    secret.write_text("secret")
    stored = [
        {"model_id": "good", "model_path": str(good)},
        {"model_id": "gone", "model_path": str(roots / "gone")},  # under the roots, missing for now: kept, failed
        {"model_id": LOCAL_INGRESS_APP, "model_path": str(good)},
        {"model_id": "rce", "model_path": str(rce), "trust_remote_code": True},
        {"model_id": "template", "model_path": str(good), "chat_template_file": str(secret)},
        {"model_id": "outside", "model_path": str(tiny_models.beta)},
        {"model_id": "x" * 129, "model_path": str(good)},
    ]
    state = tmp_path / "state"
    state.mkdir()
    (state / "models.json").write_text(json.dumps({"models": stored}))
    skipped = {
        LOCAL_INGRESS_APP: "is reserved", "rce": "'trust_remote_code' is an operator setting",
        "template": "'chat_template_file' is an operator setting", "outside": "outside the allowed model_roots",
        "x" * 80: "the most is 128",
    }

    async def scenario():
        async with local_stack([], state, model_roots=[str(roots)]) as stack:
            await wait_for(lambda: _has_status(stack, "good", "running"), timeout_s=30)
            loaded = await _loaded(stack)
            assert set(loaded) == {"good", "gone"} and loaded["gone"]["status"] == "failed"
            assert loaded["gone"]["error"] == f"'model_path' is not a directory: {roots / 'gone'}"
            assert json.loads((state / "models.json").read_text())["models"] == stored  # a start writes nothing
            # The next save keeps what may be restored and leaves the refused entries out.
            assert (await stack.http.delete("/v1/admin/unload-model/good")).status_code == 200
            kept = json.loads((state / "models.json").read_text())["models"]
            assert [m["model_id"] for m in kept] == ["gone"]

    with caplog.at_level(logging.WARNING, logger="ray.serve.orchard"):
        asyncio.run(scenario())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("not restoring stored model")]
    assert len(lines) == len(skipped), lines
    for model_id, why in skipped.items():
        assert any(f"'{model_id}" in line and why in line for line in lines), (model_id, lines)
    assert not marker.exists(), "a stored entry ran the folder's model_file"


def test_repo_ids_load_from_the_local_hugging_face_cache(tiny_models, tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    _fake_hub_repo(hub, "org/tiny", tiny_models.gamma)
    _fake_hub_repo(hub, "org/broken", tiny_models.broken)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))

    async def scenario():
        # No folder roots at all: repo ids resolve from the cache whatever model_roots says.
        async with local_stack([], tmp_path / "state", model_roots=[]) as stack:
            http = stack.http
            accepted = await http.post("/v1/admin/load-model", json={"model_id": "org/tiny", "model_path": "org/tiny"})
            assert accepted.status_code == 200, accepted.text
            assert accepted.json()["model_path"] == "org/tiny" and accepted.json()["status"] == "loaded"
            assert (await http.post("/v1/chat/completions", json={"model": "org/tiny", **CHAT})).status_code == 200
            stored = json.loads((tmp_path / "state" / "models.json").read_text())["models"]
            assert stored == [{"model_id": "org/tiny", "model_path": "org/tiny"}]  # resolved again at each restore

            missing = await http.post("/v1/admin/load-model", json={"model_path": "org/missing"})
            assert missing.status_code == 400 and _error(missing)["param"] == "model_path"
            assert "'org/missing' is not in the local Hugging Face cache" in _error(missing)["message"]
            assert str(hub) not in _error(missing)["message"]
            for bad in ("a/b/c", "org/na--me", "./relative"):
                invalid = await http.post("/v1/admin/load-model", json={"model_id": "x", "model_path": bad})
                assert invalid.status_code == 400 and "Hugging Face repo id" in _error(invalid)["message"], bad
            folder = await http.post("/v1/admin/load-model", json={"model_path": str(tiny_models.gamma)})
            assert folder.status_code == 400 and "outside the allowed model_roots" in _error(folder)["message"]

            broken = await http.post("/v1/admin/load-model", json={"model_id": "broken", "model_path": "org/broken"})
            assert broken.status_code == 503 and _error(broken)["code"] == "model_load_failed"
            assert "org/broken" in _error(broken)["message"] and str(hub) not in _error(broken)["message"]
            await stack.registry.refresh(force=True)  # a status poll merges the backend's own failure message in
            error = (await _loaded(stack))["broken"]["error"]
            assert "no_such_architecture" in error and "org/broken" in error and str(hub) not in error

    asyncio.run(scenario())
