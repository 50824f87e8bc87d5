"""The Hub stand-in and a DownloadManager pointed at it, with a cache of the test's own."""

from __future__ import annotations

import pytest

from engine.models.hub import DownloadManager
from tests.support.fake_hub import FakeHub


@pytest.fixture
def hub():
    with FakeHub() as running:
        yield running


@pytest.fixture
def manager(hub, tmp_path) -> DownloadManager:
    return DownloadManager(cache_dir=tmp_path / "hf-cache", endpoint=hub.url)
