"""Hugging Face downloads (issue 29) through huggingface_hub against a local stand-in of the Hub's HTTP API."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path

import pytest

from deployments.api.errors import wire_error
from deployments.hub.cache import find_cached_model, list_cached_models
from deployments.hub.downloads import DownloadManager
from deployments.hub.errors import (
    CachedModelNotFoundError,
    DownloadCancelledError,
    DownloadFailedError,
    DownloadInProgressError,
    GatedRepoError,
    RepoNotFoundError,
    RevisionNotFoundError,
)
from deployments.hub.events import (
    DownloadCompleted,
    DownloadFailed,
    DownloadProgress,
    DownloadStatus,
    Subscription,
)
from engine.errors import InvalidRequestError
from tests.support.fake_hub import random_bytes

MIB = 1024 * 1024
# huggingface_hub 2.4.0 reads plain-HTTP bodies in chunks of this size (constants.DOWNLOAD_CHUNK_SIZE): its byte
# counts, and so our progress events and a resumed Range, move in these steps.
HF_CHUNK = 10 * MIB
WAIT_S = 60


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    from tests.support.tiny_models import LLAMA, write_model, write_wordlevel_tokenizer

    root = tmp_path_factory.mktemp("hub-models")
    folder = write_model(root / "llama", dict(LLAMA, vocab_size=256), write_wordlevel_tokenizer(root / "tok", 256))
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    (folder / "modeling_evil.py").write_text("raise SystemExit('never downloaded')\n")
    (folder / "README.md").write_text("# tiny llama\n")
    return folder


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _events(job) -> list:
    return list(job.subscribe())


def test_download_emits_ordered_progress_to_100_and_the_source_bytes(hub, manager, tiny_llama):
    hub.add_folder("org/tiny-llama", tiny_llama)
    events = _events(manager.start("org/tiny-llama"))

    assert events[0].status == DownloadStatus.RESOLVING
    progress = [e for e in events if isinstance(e, DownloadProgress)]
    downloading = [e for e in progress if e.status == DownloadStatus.DOWNLOADING]
    assert [e.status for e in progress] == sorted((e.status for e in progress), key=lambda s: s != "resolving")
    assert [e.bytes_done for e in downloading] == sorted(e.bytes_done for e in downloading)
    assert downloading[-1].percent == 100.0 and downloading[-1].current_file == "model.safetensors"
    final = events[-1]
    assert isinstance(final, DownloadCompleted) and final.final and final.percent == 100.0
    assert [e for e in events if e.final] == [final]

    wanted = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
    assert wanted <= {p.name for p in tiny_llama.iterdir()}
    downloaded = {p.name for p in final.snapshot_path.iterdir()}
    assert downloaded == {p.name for p in tiny_llama.iterdir()} - {"modeling_evil.py", "README.md"}
    for name in downloaded:
        assert _sha256(final.snapshot_path / name) == _sha256(tiny_llama / name), name
    assert final.files_total == len(downloaded) == downloading[-1].files_done
    assert final.bytes_total == final.bytes_downloaded == sum((tiny_llama / n).stat().st_size for n in downloaded)
    assert final.snapshot_path == manager.cache_dir / "models--org--tiny-llama" / "snapshots" / final.commit

    [cached] = list_cached_models(manager.cache_dir)
    assert (cached.repo_id, cached.is_complete, cached.download_percentage) == ("org/tiny-llama", True, 100.0)
    assert cached.refs == ("main",) and cached.files_expected == len(downloaded) and cached.listing_known
    assert cached.size_bytes == final.bytes_total and cached.size_gb == round(final.bytes_total / 1e9, 3)

    # huggingface_hub's temp files: one beside its finished blob (left by a killed process) is harmless; one
    # whose blob is missing is a transfer under way (or cut), so the repo is not complete.
    blobs = manager.cache_dir / "models--org--tiny-llama" / "blobs"
    weights_blob = (final.snapshot_path / "model.safetensors").resolve()
    (blobs / f"{weights_blob.name}.0badf00d.incomplete").write_bytes(b"stale")
    assert find_cached_model("org/tiny-llama", manager.cache_dir).is_complete
    (blobs / f"{'0' * 64}.0badf00d.incomplete").write_bytes(b"in flight")
    unfinished = find_cached_model("org/tiny-llama", manager.cache_dir)
    assert unfinished.has_partial_files and not unfinished.is_complete and unfinished.download_percentage == 100.0
    (blobs / f"{'0' * 64}.0badf00d.incomplete").unlink()

    # Cached: a second download transfers nothing and still ends complete.
    gets_before = len(hub.file_gets("org/tiny-llama"))
    again = manager.download("org/tiny-llama")
    assert again.bytes_downloaded == 0 and len(hub.file_gets("org/tiny-llama")) == gets_before


def test_100_mb_repo_streams_at_least_20_progress_events_and_the_same_bytes(hub, manager):
    shards = {f"model-{i:05d}-of-00010.safetensors": random_bytes(10_000_000, seed=i) for i in range(1, 11)}
    index = {"weight_map": {f"w{i}": name for i, name in enumerate(shards)}}
    hub.add_repo("org/big", {"config.json": b'{"model_type": "llama"}',
                             "model.safetensors.index.json": json.dumps(index).encode(), **shards})
    hub.bytes_per_second = 50_000_000  # ~2 s: slow enough that the events are spaced out, as on a real link
    events = _events(manager.start("org/big"))

    downloading = [e for e in events if isinstance(e, DownloadProgress) and e.status == DownloadStatus.DOWNLOADING]
    assert len(downloading) >= 20, len(downloading)
    assert len({e.bytes_done for e in downloading}) >= 11  # 0 and one step per shard at least
    assert any(e.speed_bytes_per_s > 0 and e.eta_s is not None for e in downloading)
    final = events[-1]
    assert isinstance(final, DownloadCompleted) and final.bytes_total == 10 * 10_000_000 + len(json.dumps(index)) + 23
    for name, data in shards.items():
        assert _sha256(final.snapshot_path / name) == hashlib.sha256(data).hexdigest(), name


def test_a_dropped_connection_resumes_with_only_the_rest_of_the_file(hub, manager):
    data = random_bytes(25 * MIB, seed=7)
    repo = hub.add_repo("org/flaky", {"config.json": b"{}", "model.safetensors": data})
    repo.drop_once_after["model.safetensors"] = 15 * MIB
    final = manager.download("org/flaky")

    first, second = hub.file_gets("org/flaky", "model.safetensors")
    assert (first.range_start, first.bytes_sent) == (0, 15 * MIB)
    # huggingface_hub resumes from the last whole chunk it wrote; the stand-in then sends only the rest.
    assert second.range_start == HF_CHUNK and second.status == 206
    assert second.range_start + second.bytes_sent == len(data)
    assert _sha256(final.snapshot_path / "model.safetensors") == hashlib.sha256(data).hexdigest()
    assert final.bytes_total == len(data) + 2


def test_a_failed_download_keeps_finished_files_and_the_retry_fetches_only_the_rest(hub, manager):
    files = {"config.json": b"{}", "tokenizer.json": b'{"model": {}}', "model.safetensors": random_bytes(MIB, 1)}
    repo = hub.add_repo("org/half", files)
    repo.fail_paths.add("model.safetensors")  # the Hub answers 500 for the weights

    failed = manager.start("org/half").wait(WAIT_S)
    assert isinstance(failed, DownloadFailed) and failed.status == DownloadStatus.FAILED
    assert isinstance(failed.error, DownloadFailedError) and "org/half" in failed.error.message
    assert failed.bytes_done == len(b"{}") + len(b'{"model": {}}') and failed.bytes_total == sum(map(len, files.values()))
    cached = find_cached_model("org/half", manager.cache_dir)
    assert cached is not None and not cached.is_complete and cached.download_percentage == 0.0  # 15 B of 1 MiB
    assert (cached.files_expected, cached.files_present, cached.bytes_present) == (3, 2, 15)

    repo.fail_paths.clear()
    served_before = len(hub.file_gets("org/half"))
    final = manager.download("org/half")
    assert [r.path for r in hub.file_gets("org/half")[served_before:]] == ["model.safetensors"]
    assert final.bytes_downloaded == MIB
    assert find_cached_model("org/half", manager.cache_dir).is_complete


def test_two_requests_for_one_repo_are_one_transfer(hub, manager):
    hub.add_repo("org/shared", {"config.json": b"{}", "model.safetensors": random_bytes(30 * MIB, 3)})
    hub.bytes_per_second = 30 * MIB  # ~1 s
    first = manager.start("org/shared")
    early = first.subscribe()
    assert early.get(WAIT_S) is not None  # the first reader is there from the start
    second = manager.start("org/shared")
    assert second is first and [j.download_id for j in manager.downloads()] == [first.download_id]
    late_events = list(second.subscribe())
    early_events = list(early)

    assert late_events[-1] is early_events[-1] and isinstance(late_events[-1], DownloadCompleted)
    assert late_events[-2:] == early_events[-2:]  # the same events, from where the late reader joined
    assert len(hub.file_gets("org/shared", "model.safetensors")) == 1
    assert len(hub.file_gets("org/shared", "config.json")) == 1
    # Once finished, a new request is a new download (that finds everything cached).
    third = manager.start("org/shared")
    assert third is not first and third.wait(WAIT_S).bytes_downloaded == 0


def test_events_reach_an_asyncio_reader(hub, manager):
    hub.add_repo("org/async", {"config.json": b"{}", "model.safetensors": random_bytes(MIB, 4)})

    async def read_all():
        job = manager.start("org/async")
        return [event async for event in job.subscribe()], await job.wait_async()

    events, awaited = asyncio.run(read_all())
    assert events[0].status == DownloadStatus.RESOLVING and isinstance(events[-1], DownloadCompleted)
    assert awaited is events[-1]


def test_unknown_repo_and_revision_are_typed_404s(hub, manager):
    hub.add_repo("org/known", {"config.json": b"{}"})
    missing = manager.start("org/missing").wait(WAIT_S)
    assert isinstance(missing, DownloadFailed) and type(missing.error) is RepoNotFoundError
    assert missing.error.code == "repo_not_found" and missing.error.param == "repo_id"
    assert wire_error(missing.error).status == 404
    with pytest.raises(RevisionNotFoundError) as no_revision:
        manager.download("org/known", revision="no-such-branch")
    assert no_revision.value.param == "revision" and wire_error(no_revision.value).status == 404
    assert find_cached_model("org/missing", manager.cache_dir) is None


def test_an_unreachable_hub_is_a_clear_error(tmp_path):
    manager = DownloadManager(cache_dir=tmp_path / "hf-cache", endpoint="http://127.0.0.1:9")  # nothing listens
    failed = manager.start("org/anything").wait(WAIT_S)
    assert isinstance(failed, DownloadFailed) and type(failed.error) is DownloadFailedError
    assert failed.error.message.startswith(
        "cannot reach the Hugging Face Hub at http://127.0.0.1:9 to download 'org/anything' (ConnectError: ")
    assert failed.error.message.endswith("check the network or HF_ENDPOINT") and wire_error(failed.error).status == 502


def test_a_gated_repo_needs_the_token(hub, manager, monkeypatch, tmp_path):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no token file of the machine's user
    hub.add_repo("org/gated", {"config.json": b"{}", "model.safetensors": random_bytes(MIB, 5)}, gated_token="hf_ok")

    refused = manager.start("org/gated").wait(WAIT_S)
    assert isinstance(refused, DownloadFailed) and isinstance(refused.error, GatedRepoError)
    assert "HF_TOKEN" in refused.error.message and wire_error(refused.error).status == 403
    assert not any(m.is_complete for m in list_cached_models(manager.cache_dir))
    with pytest.raises(GatedRepoError):
        manager.download("org/gated", token="hf_wrong")

    assert manager.download("org/gated", token="hf_ok").files_total == 2
    monkeypatch.setenv("HF_TOKEN", "hf_ok")  # huggingface_hub's convention, read at each call
    from_env = DownloadManager(cache_dir=tmp_path / "other-cache", endpoint=hub.url).download("org/gated")
    assert from_env.bytes_downloaded == from_env.bytes_total == MIB + 2


def test_cancel_stops_the_transfer_and_the_repo_can_then_be_deleted(hub, manager):
    hub.add_repo("org/slow", {"config.json": b"{}", "model.safetensors": random_bytes(40 * MIB, 6)})
    hub.bytes_per_second = 8 * MIB  # ~5 s
    job = manager.start("org/slow")
    events = job.subscribe()
    while not ((event := events.get(WAIT_S)) and event.bytes_done > 2):  # the weights are flowing
        assert event is not None and not event.final
    with pytest.raises(DownloadInProgressError):
        manager.delete("org/slow")
    assert manager.cancel(job.download_id)
    final = job.wait(WAIT_S)
    assert isinstance(final, DownloadFailed) and final.status == DownloadStatus.CANCELLED
    assert isinstance(final.error, DownloadCancelledError) and final.bytes_done < final.bytes_total
    assert not manager.cancel(job.download_id)  # finished
    cached = find_cached_model("org/slow", manager.cache_dir)
    assert not cached.is_complete and not cached.has_partial_files  # huggingface_hub removed its temp file

    freed = manager.delete("org/slow")
    assert freed == 2 and find_cached_model("org/slow", manager.cache_dir) is None
    assert not (manager.cache_dir / "models--org--slow").exists()
    with pytest.raises(CachedModelNotFoundError) as gone:
        manager.delete("org/slow")
    assert wire_error(gone.value).status == 404


@pytest.mark.parametrize("bad", ["gpt2", "a/b/c", "../etc/passwd", "/abs/path", "org/..", "org/na--me", ""])
def test_repo_ids_are_checked_before_anything_happens(manager, bad):
    with pytest.raises(InvalidRequestError) as refused:
        manager.start(bad)
    assert refused.value.param == "repo_id" and "owner/name" in refused.value.message
    with pytest.raises(InvalidRequestError):
        manager.delete(bad)
    assert manager.downloads() == []


@pytest.mark.parametrize("bad", ["../../../tmp/x", "/etc", "main/", "a//b", "-rf", "x" * 300, ""])
def test_revisions_are_checked_before_they_reach_the_cache(manager, bad):
    with pytest.raises(InvalidRequestError) as refused:
        manager.start("org/model", revision=bad)
    assert refused.value.param == "revision"
    with pytest.raises(InvalidRequestError):
        manager.verify("org/model", revision=bad)
    assert manager.downloads() == [] and not manager.cache_dir.exists()


def test_a_pinned_revision_downloads_that_commit(hub, manager):
    repo = hub.add_repo("org/pinned", {"config.json": b"{}", "model.safetensors": random_bytes(MIB, 11)})
    by_commit = manager.download("org/pinned", revision=repo.commit)
    assert by_commit.commit == repo.commit and by_commit.revision == repo.commit
    assert find_cached_model("org/pinned", manager.cache_dir).is_complete
    assert manager.verify("org/pinned", revision=repo.commit).is_complete


def test_a_download_goes_on_when_its_reader_goes_away(hub, manager):
    hub.add_repo("org/orphan", {"config.json": b"{}", "model.safetensors": random_bytes(20 * MIB, 9)})
    hub.bytes_per_second = 20 * MIB
    job = manager.start("org/orphan")
    reader = job.subscribe()
    assert reader.get(WAIT_S).status == DownloadStatus.RESOLVING
    del reader  # the client disconnected
    final = job.wait(WAIT_S)
    assert isinstance(final, DownloadCompleted) and find_cached_model("org/orphan", manager.cache_dir).is_complete
    assert manager.get(job.download_id) is job and job.finished


def test_a_slow_reader_gets_the_newest_progress_and_always_the_final_event():
    subscription = Subscription(max_pending=8)
    common = {"download_id": "dl-1", "repo_id": "org/x", "revision": "main", "files_done": 0, "files_total": 1,
              "current_file": "model.safetensors", "speed_bytes_per_s": 1.0, "eta_s": None, "bytes_total": 1000}
    for done in range(0, 1000, 10):
        subscription.put(DownloadProgress(status=DownloadStatus.DOWNLOADING, bytes_done=done, **common))
    final = DownloadFailed(download_id="dl-1", repo_id="org/x", revision="main", status=DownloadStatus.CANCELLED,
                           error=DownloadCancelledError("cancelled"), bytes_done=990, bytes_total=1000)
    subscription.put(final)
    subscription.put(DownloadProgress(status=DownloadStatus.DOWNLOADING, bytes_done=999, **common))  # after final
    received = list(subscription)
    assert [e.bytes_done for e in received] == [0, 10, 20, 30, 40, 50, 60, 990, 990]
    assert received[-1] is final and received[-2].percent == 99.0
    assert subscription.get(timeout=0.01) is None


def test_verify_with_hub_compares_the_cache_with_the_hub_now(hub, manager):
    files = {"config.json": b"{}", "tokenizer.json": b"{}", "model.safetensors": random_bytes(MIB, 10),
             "README.md": b"not wanted"}
    first = hub.add_repo("org/verified", files)
    never = manager.verify("org/verified")
    assert (never.hub_commit, never.local_commit, never.is_complete) == (first.commit, None, False)
    assert never.missing_files == ("config.json", "model.safetensors", "tokenizer.json")

    manager.download("org/verified")
    fresh = manager.verify("org/verified")
    assert (fresh.is_latest, fresh.is_complete, fresh.missing_files) == (True, True, ())
    weights = find_cached_model("org/verified", manager.cache_dir).snapshot_path / "model.safetensors"
    weights.resolve().write_bytes(b"truncated")  # a damaged blob: same name, other size
    assert manager.verify("org/verified").missing_files == ("model.safetensors",)

    second = hub.add_repo("org/verified", {**files, "config.json": b'{"v": 2}'})  # a new commit on main
    stale = manager.verify("org/verified")
    assert (stale.hub_commit, stale.local_commit, stale.is_latest) == (second.commit, first.commit, False)
    with pytest.raises(RepoNotFoundError):
        manager.verify("org/nowhere")


def test_xet_progress_reaches_the_events_once(manager):
    """The stand-in serves plain HTTP; the Hub serves most repos over Xet, whose reporter drives the same bar class
    differently (network and disk bytes on one bar): bytes are counted once, from the disk side."""
    import logging
    from types import SimpleNamespace

    from huggingface_hub.utils._xet_progress_reporting import (
        XetDownloadProgressReporter,
    )

    from deployments.hub.downloads import DownloadJob

    job = DownloadJob("dl-xet", "org/xet", "main", manager, token=None, allow_patterns=tuple(manager.allow_patterns))  # not started: only its bar is driven
    report = SimpleNamespace(total_bytes_completed=600, total_transfer_bytes_completed=450, total_bytes=1000,
                             total_bytes_completion_rate=100.0, total_transfer_bytes_completion_rate=75.0)
    with XetDownloadProgressReporter(reconstruction_desc="model.safetensors", total=1000, log_level=logging.INFO,
                                     tqdm_class=job._bar_class) as reporter:
        reporter.update_progress(report)
    assert job.latest.bytes_done == 600
