"""A full disk under a download (issue 29): a clear DiskFullError, and no cache entry reported complete."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from deployments.api.errors import wire_error
from deployments.hub.errors import DiskFullError
from tests.support.fake_hub import random_bytes

MIB = 1024 * 1024


DISK_FULL_SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from deployments.hub.downloads import DownloadManager
    from deployments.hub.cache import list_cached_models
    disk, endpoint = Path(sys.argv[1]), sys.argv[2]
    manager = DownloadManager(cache_dir=disk / "hub", endpoint=endpoint)

    def outcome(final):
        return {"status": final.status.value, "error": type(final.error).__name__, "code": final.error.code,
                "message": final.error.message,
                "listing": [[m.repo_id, m.is_complete, m.files_present] for m in list_cached_models(disk / "hub")]}

    print(json.dumps(outcome(manager.start("org/huge").wait(60))))  # can never fit: refused before any transfer
    events = manager.start("org/fits").subscribe()  # fits, until something else fills the disk mid-transfer
    for event in events:
        if getattr(event, "current_file", None) == "model.safetensors":
            (disk / "filler").write_bytes(bytes(3 * 1024 * 1024))
            break
    print(json.dumps(outcome(manager.get("dl-2").wait(60))))
""")


def test_a_full_disk_is_a_clear_error_and_no_complete_cache_entry(hub, tmp_path):
    """A real full disk: a 4 MiB tmpfs mounted in a private mount namespace (as root, or in a user namespace)."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to mount a small tmpfs")
    hub.add_repo("org/huge", {"config.json": b"{}", "model.safetensors": random_bytes(12 * MIB, 8)})
    hub.add_repo("org/fits", {"config.json": b"{}", "model.safetensors": random_bytes(3 * MIB, 9)})
    hub.bytes_per_second = 2 * MIB  # the weights take ~1.5 s: the filler lands while they are in flight
    disk = tmp_path / "small-disk"
    disk.mkdir()
    userns = [] if os.geteuid() == 0 else ["-r"]
    mount_and_run = f'mount -t tmpfs -o size=4m tmpfs "$1" && echo mounted && exec "{sys.executable}" -c "$2" "$1" "$3"'
    result = subprocess.run(["unshare", *userns, "-m", "sh", "-c", mount_and_run, "sh", str(disk),
                             DISK_FULL_SCRIPT, hub.url], check=False, capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).parents[2])
    if not result.stdout.startswith("mounted\n"):  # no mount namespace or no tmpfs here (e.g. userns disallowed)
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr
    refused, filled = (json.loads(line) for line in result.stdout.strip().splitlines()[-2:])

    assert (refused["status"], refused["error"], refused["code"]) == ("failed", "DiskFullError", "insufficient_storage")
    assert refused["message"].startswith("'org/huge' needs 0.013 GB more but the Hugging Face cache ")
    assert refused["message"].endswith("free: free disk space or set HF_HUB_CACHE elsewhere")
    assert [r.path for r in hub.file_gets("org/huge")] == []  # nothing was transferred

    assert (filled["status"], filled["error"], filled["code"]) == ("failed", "DiskFullError", "insufficient_storage")
    assert filled["message"].startswith("no space left for 'org/fits' in the Hugging Face cache ")
    assert "(No space left on device): free disk space or set HF_HUB_CACHE elsewhere" in filled["message"]
    assert refused["listing"] == []  # no snapshot at all (only huggingface_hub's refs and file listing)
    # Listed, but not complete: config.json is there, the weights are not (and no partial file is left).
    assert filled["listing"] == [["org/fits", False, 1]]
    assert wire_error(DiskFullError("x")).status == 507
