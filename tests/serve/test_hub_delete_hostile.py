"""DELETE /v1/models/local/{repo_id} against a hostile cache or id (issue 48): a link planted in a snapshot to a file
outside the repo's folder (another repo's blob, any file) is removed, never followed; a repo folder that is itself a
link out of the cache is refused (it would be left in place while the delete said it was done); a repo sharing
another's commit hash is deleted alone (huggingface_hub's delete_revisions took both); dotted, encoded and odd ids are
400s or 404s that touch nothing."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from deployments.hub.cache import delete_cached_model
from deployments.hub.downloads import DownloadManager
from engine.errors import InvalidRequestError
from tests.serve.local_stack import local_stack

COMMIT = "a" * 40  # every repo here has this commit: a delete must pick the repo, not the hash


def cached_repo(cache: Path, repo_id: str, files: dict[str, bytes]) -> Path:
    """A repo laid out as huggingface_hub's cache does: blobs by hash, a snapshot of links, refs/main."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    for index, (name, data) in enumerate(files.items()):
        blob = repo / "blobs" / f"{index:064x}"
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


def test_a_plain_repo_is_deleted(tmp_path: Path) -> None:
    cached_repo(tmp_path / "hub", "org/plain", {"config.json": b"{}", "model.safetensors": b"x" * 100})
    assert delete_cached_model("org/plain", tmp_path / "hub") == 102
    assert not (tmp_path / "hub" / "models--org--plain").exists()


@pytest.mark.parametrize("target", ["outside", "other repo's blob"])
def test_a_link_out_of_the_repo_is_removed_and_its_target_kept(tmp_path: Path, target: str) -> None:
    cache = tmp_path / "hub"
    snapshot = cached_repo(cache, "org/a", {"config.json": b"{}"})
    other = cached_repo(cache, "org/b", {"model.safetensors": b"b" * 10})
    victim = tmp_path / "outside" / "precious.txt"
    if target == "outside":
        victim.parent.mkdir()
        victim.write_bytes(b"keep me")
    else:
        victim = (other / "model.safetensors").resolve()
    content = victim.read_bytes()
    (snapshot / "weights.bin").symlink_to(victim)
    assert delete_cached_model("org/a", cache) == 2  # its own config.json blob: the link's target was not freed
    assert not (cache / "models--org--a").exists()
    assert victim.read_bytes() == content and (other / "model.safetensors").read_bytes() == b"b" * 10


def test_a_repo_folder_that_is_a_link_out_of_the_cache_is_not_deleted(tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    elsewhere = tmp_path / "elsewhere"
    cached_repo(elsewhere, "org/real", {"config.json": b"{}"})
    cache.mkdir()
    (cache / "models--org--linked").symlink_to(elsewhere / "models--org--real")
    with pytest.raises(InvalidRequestError, match="a link out of the Hugging Face cache"):
        delete_cached_model("org/linked", cache)
    assert (elsewhere / "models--org--real" / "snapshots" / COMMIT / "config.json").exists()


@pytest.mark.parametrize("path", ["..%2F..%2Fetc/passwd", "org/%2E%2E", "org%2F..%2F..", "%2E%2E/%2E%2E",
                                  "org/name%00", "/abs/olute", "org/a/b"])
def test_dotted_encoded_and_odd_ids_are_400s(tmp_path: Path, path: str) -> None:
    manager = DownloadManager(cache_dir=tmp_path / "hub")
    cached_repo(tmp_path / "hub", "org/name", {"config.json": b"{}"})

    async def scenario():
        async with local_stack([], downloads=manager) as stack:
            return await stack.http.delete(f"/v1/models/local/{path}")

    answer = asyncio.run(scenario())
    assert answer.status_code in (400, 404), answer.text
    if answer.status_code == 400:
        assert answer.json()["error"]["param"] == "repo_id"
    assert (tmp_path / "hub" / "models--org--name" / "snapshots" / COMMIT / "config.json").exists()
