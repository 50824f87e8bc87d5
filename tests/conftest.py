"""Settings and shared fixtures for the whole suite."""

import pytest
from hypothesis import settings

from deployments.hub.downloads import DownloadManager
from tests.support.fake_hub import FakeHub

# A test hung for minutes fails with its event loop's tasks in the log (tests/support/hang_watch.py).
pytest_plugins = ["tests.support.hang_watch"]

# No per-example deadline: a loaded 2-core machine can slow any example past Hypothesis's 200 ms default,
# which fails a test that found no bug. Example counts still bound each test's work.
settings.register_profile("orchard", deadline=None)
settings.load_profile("orchard")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Three tiny llamas and a broken folder (tests/support/serving.py), for the serving and graph tests."""
    from tests.support.serving import write_tiny_models

    return write_tiny_models(tmp_path_factory.mktemp("serve-models"))


@pytest.fixture
def hub():
    """The Hugging Face Hub stand-in on loopback (tests/support/fake_hub.py)."""
    with FakeHub() as running:
        yield running


@pytest.fixture
def manager(hub, tmp_path) -> DownloadManager:
    """A DownloadManager pointed at the stand-in, with a hub cache of the test's own."""
    return DownloadManager(cache_dir=tmp_path / "hf-cache", endpoint=hub.url)


@pytest.fixture(scope="session")
def tiny_klein(tmp_path_factory):
    """A tiny random FLUX.2 [klein] image model folder (tests/support/tiny_images.py)."""
    from tests.support.tiny_images import write_tiny_klein

    return write_tiny_klein(tmp_path_factory.mktemp("tiny-klein"))
