"""`orchard pull | ls | rm` as a user runs them: the CLI in a subprocess, against the Hub stand-in."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from tests.support.fake_hub import FakeHub

ROOT = Path(__file__).parents[2]
UNREACHABLE = "http://127.0.0.1:9"  # the discard port: nothing listens, so any network use fails


def _orchard(*args: str, cache: Path, endpoint: str, **extra_env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_ENDPOINT": endpoint, **extra_env}
    env.pop("HF_TOKEN", None)
    return subprocess.run([sys.executable, "-m", "deployments.cli.main", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120, check=False)


def test_pull_ls_rm_end_to_end(tmp_path):
    cache = tmp_path / "hf-cache"
    weights = hashlib.shake_256(b"cli").digest(24 * 1024 * 1024)
    with FakeHub(bytes_per_second=24 * 1024 * 1024) as hub:
        hub.add_repo("org/cli-model", {"config.json": b'{"model_type": "llama"}', "model.safetensors": weights,
                                       "tokenizer.json": b"{}", "run_me.py": b"raise SystemExit(1)"})
        pulled = _orchard("pull", "org/cli-model", cache=cache, endpoint=hub.url)
        missing = _orchard("pull", "org/nothing-here", cache=cache, endpoint=hub.url)

    assert pulled.returncode == 0, pulled.stderr
    snapshot = Path(pulled.stdout.strip())
    assert snapshot.parent.parent == cache / "models--org--cli-model"
    assert sorted(p.name for p in snapshot.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert hashlib.sha256((snapshot / "model.safetensors").read_bytes()).digest() == hashlib.sha256(weights).digest()
    bar_lines = pulled.stderr.splitlines()  # not a terminal: one line per event
    assert bar_lines[0] == "org/cli-model [------------------------]   0.0%  resolving"
    assert any("% " in line and "MB/s" in line and "model.safetensors" in line for line in bar_lines[1:-1])
    assert bar_lines[-1].startswith("org/cli-model [########################] 100.0%  25.2 MB  3 files  done in")

    assert missing.returncode == 1
    assert missing.stderr.strip().splitlines()[-1] == (
        "orchard pull: error: no model repo 'org/nothing-here' on the Hub (or it is private and the token has no "
        "access)")

    # Offline from here on: nothing listens at the endpoint.
    listed = _orchard("ls", cache=cache, endpoint=UNREACHABLE)
    assert listed.returncode == 0, listed.stderr
    header, row = listed.stdout.splitlines()
    assert header.split() == ["REPO", "SIZE", "DONE", "STATUS", "REVISION"]
    assert row.split() == ["org/cli-model", "0.025", "GB", "100.0%", "complete", "main"]
    again = _orchard("pull", "org/cli-model", cache=cache, endpoint=UNREACHABLE, HF_HUB_OFFLINE="1")
    assert again.returncode == 0, again.stderr
    assert Path(again.stdout.strip()) == snapshot  # complete in the cache: nothing to fetch
    uncached = _orchard("pull", "org/other", cache=cache, endpoint=UNREACHABLE, HF_HUB_OFFLINE="1")
    assert (uncached.returncode, uncached.stderr.strip().splitlines()[-1]) == (1, (
        "orchard pull: error: 'org/other' is not (completely) in the local Hugging Face cache and HF_HUB_OFFLINE "
        "is set: unset it to download"))

    removed = _orchard("rm", "org/cli-model", cache=cache, endpoint=UNREACHABLE)
    assert (removed.returncode, removed.stdout.strip()) == (0, "deleted org/cli-model (25.2 MB freed)")
    assert _orchard("ls", cache=cache, endpoint=UNREACHABLE).stdout == ""
    gone = _orchard("rm", "org/cli-model", cache=cache, endpoint=UNREACHABLE)
    assert (gone.returncode, gone.stderr.strip()) == (
        1, "orchard rm: error: 'org/cli-model' is not in the local Hugging Face cache")
    bad = _orchard("rm", "../etc", cache=cache, endpoint=UNREACHABLE)
    assert bad.returncode == 1 and "must be a Hugging Face repo id (owner/name)" in bad.stderr
