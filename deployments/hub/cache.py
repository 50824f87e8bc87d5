"""The local Hugging Face cache as Orchard shows it: each model repo's size, and whether every file an MLX model
needs is there (huggingface_hub's scan_cache_dir, and the tree listing it caches at each snapshot download)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from engine.errors import InvalidRequestError

from deployments.hub.errors import CachedModelNotFoundError, typed_hub_error
from deployments.hub.paths import (
    MLX_ALLOW_PATTERNS,
    check_repo_id,
    check_revision,
    hub_cache_dir,
    hub_endpoint,
)


@dataclass(frozen=True)
class CachedModel:
    repo_id: str
    commit: str
    refs: tuple[str, ...]  # the branch or tag names pointing at `commit` ("main")
    snapshot_path: Path
    size_bytes: int  # on disk, every revision of the repo
    files_expected: int  # wanted files of the revision (MLX patterns); known from the tree listing
    files_present: int
    bytes_expected: int
    bytes_present: int
    has_partial_files: bool  # a `<blob>.<id>.incomplete` whose blob is missing: a transfer runs, or stopped mid-file
    listing_known: bool  # False: no cached tree listing, so completeness is judged from what is there

    @property
    def size_gb(self) -> float:
        return round(self.size_bytes / 1e9, 3)

    @property
    def download_percentage(self) -> float:
        return round(100.0 * self.bytes_present / self.bytes_expected, 1) if self.bytes_expected else 0.0

    @property
    def is_complete(self) -> bool:
        return (self.files_expected > 0 and self.files_present == self.files_expected
                and not self.has_partial_files and (self.snapshot_path / "config.json").is_file())


@dataclass(frozen=True)
class HubVerification:
    """A cached repo against the Hub now (`GET /v1/models?verify_with_hub=true`)."""

    repo_id: str
    revision: str
    hub_commit: str  # what `revision` names on the Hub now
    local_commit: str | None  # what it names in the cache (None: never downloaded)
    missing_files: tuple[str, ...]  # wanted files of hub_commit absent from the cache, or of another size

    @property
    def is_latest(self) -> bool:
        return self.local_commit == self.hub_commit

    @property
    def is_complete(self) -> bool:
        return self.is_latest and not self.missing_files


def list_cached_models(cache_dir: Path | None = None, allow_patterns: list[str] | None = None) -> list[CachedModel]:
    """Every model repo in the cache, by repo id: its `main` revision where it has one, else its newest."""
    cache_dir = Path(cache_dir) if cache_dir is not None else hub_cache_dir()
    return [_cached_model(repo, _default_revision(repo), cache_dir, allow_patterns or MLX_ALLOW_PATTERNS)
            for repo in sorted(_model_repos(cache_dir), key=lambda r: r.repo_id)]


def find_cached_model(repo_id: str, cache_dir: Path | None = None, revision: str | None = None) -> CachedModel | None:
    """The repo's `main` (or newest) revision in the cache; with `revision`, the cached one it names (a branch or tag
    the cache has a ref for, or a commit hash). Only this repo's files are checked against its listing."""
    cache_dir = Path(cache_dir) if cache_dir is not None else hub_cache_dir()
    repo = _named_repo(_model_repos(cache_dir), repo_id)
    if repo is None:
        return None
    if revision is None or revision == "main":
        chosen = _default_revision(repo)
    else:
        chosen = next((c for c in repo.revisions if revision in c.refs or c.commit_hash == revision), None)
    return _cached_model(repo, chosen, cache_dir, MLX_ALLOW_PATTERNS) if chosen is not None else None


def _named_repo(repos: list, repo_id: str):
    """The repo of that id: the exact name, else the one repo whose name differs only in case (the Hub's ids are
    case-insensitive: Bodega's docs name "srswti/..." and "SRSWTI/..." for one repo)."""
    exact = next((r for r in repos if r.repo_id == repo_id), None)
    if exact is not None:
        return exact
    folded = [r for r in repos if r.repo_id.casefold() == repo_id.casefold()]
    return folded[0] if len(folded) == 1 else None


def _model_repos(cache_dir: Path) -> list:
    """The cache's model repos that hold a revision (huggingface_hub's scan: file sizes, no contents read)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        scanned = scan_cache_dir(cache_dir)
    except CacheNotFound:
        return []
    return [repo for repo in scanned.repos if repo.repo_type == "model" and repo.revisions]


def _default_revision(repo):
    return max(repo.revisions, key=lambda r: ("main" in r.refs, r.last_modified))


def delete_cached_model(repo_id: str, cache_dir: Path | None = None) -> int:
    """Delete a repo's folder from the cache (every revision) and its locks; the bytes freed."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    check_repo_id(repo_id, param="repo_id")
    cache_dir = Path(cache_dir) if cache_dir is not None else hub_cache_dir()
    try:
        scanned = scan_cache_dir(cache_dir)
    except CacheNotFound:
        scanned = None
    repo = _named_repo([r for r in (scanned.repos if scanned else ()) if r.repo_type == "model"], repo_id)
    if repo is None:
        raise CachedModelNotFoundError(f"'{repo_id}' is not in the local Hugging Face cache", param="repo_id")
    _check_inside_repo(repo_id, repo.repo_path, cache_dir)
    blobs = repo.repo_path / "blobs"
    freed = sum(p.lstat().st_size for p in blobs.iterdir() if p.is_file() and not p.is_symlink()) if blobs.is_dir() else 0
    # The repo's own folder (links in it removed, never followed), not huggingface_hub's delete_revisions: that one
    # picks revisions by commit hash across every repo of the cache, so a repo holding another's hash took it along.
    shutil.rmtree(repo.repo_path)
    shutil.rmtree(cache_dir / ".locks" / repo.repo_path.name, ignore_errors=True)
    return freed  # its own blobs: a link's target elsewhere was not freed


def _check_inside_repo(repo_id: str, repo_path: Path, cache_dir: Path) -> None:
    """Refuse a repo folder that is itself a link out of the cache: huggingface_hub would leave it (rmtree refuses a
    link) while the delete reported success. Links inside the folder are removed, never followed (rmtree)."""
    if repo_path.is_symlink() or repo_path.resolve().parent != cache_dir.resolve():
        raise InvalidRequestError(f"'{repo_id}' is a link out of the Hugging Face cache: not deleted", param="repo_id")


def _cached_model(repo, revision, cache_dir: Path, allow_patterns: list[str]) -> CachedModel:
    from huggingface_hub import get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError
    from huggingface_hub.utils import filter_repo_objects

    present = {f.file_path.relative_to(revision.snapshot_path).as_posix(): f.size_on_disk for f in revision.files}
    try:
        tree = get_cached_repo_tree(repo.repo_id, revision=revision.commit_hash, cache_dir=cache_dir)
        expected = {f.path: f.size for f in filter_repo_objects(tree, allow_patterns=allow_patterns,
                                                                key=lambda f: f.path)}
        listing_known = True
    except CachedRepoTreeNotFoundError:  # downloaded by something that did not cache the listing
        expected, listing_known = dict(present), False
    present_wanted = {path: size for path, size in present.items() if path in expected}
    blobs = repo.repo_path / "blobs"
    # One left by a killed process stays beside the blob a later download completed: that one is not partial.
    partial = any(not (blobs / p.name.split(".")[0]).exists() for p in blobs.glob("*.incomplete"))
    return CachedModel(
        repo_id=repo.repo_id, commit=revision.commit_hash, refs=tuple(sorted(revision.refs)),
        snapshot_path=revision.snapshot_path, size_bytes=repo.size_on_disk, files_expected=len(expected),
        files_present=len(present_wanted), bytes_expected=sum(expected.values()),
        bytes_present=sum(present_wanted.values()), has_partial_files=partial, listing_known=listing_known)


def verify_with_hub(repo_id: str, revision: str | None = None, cache_dir: Path | None = None,
                    endpoint: str | None = None, token: str | None = None,
                    allow_patterns: list[str] | None = None) -> HubVerification:
    """Ask the Hub which commit `revision` names and which files it holds; compare with the cache (by size: hashing
    gigabytes is for huggingface_hub's verify_repo_checksums). Downloads nothing."""
    from huggingface_hub import HfApi
    from huggingface_hub.file_download import repo_folder_name
    from huggingface_hub.hf_api import RepoFile
    from huggingface_hub.utils import filter_repo_objects

    check_repo_id(repo_id, param="repo_id")
    cache_dir = Path(cache_dir) if cache_dir is not None else hub_cache_dir()
    endpoint, revision = endpoint or hub_endpoint(), check_revision(revision)
    api = HfApi(endpoint=endpoint, token=token)
    try:
        hub_commit = api.repo_info(repo_id, revision=revision).sha
        tree = [f for f in api.list_repo_tree(repo_id, revision=hub_commit, recursive=True) if isinstance(f, RepoFile)]
    except Exception as exc:
        raise typed_hub_error(exc, repo_id, cache_dir, endpoint) from exc
    repo_dir = cache_dir / repo_folder_name(repo_id=repo_id, repo_type="model")
    ref = repo_dir / "refs" / revision
    local_commit = ref.read_text().strip() if ref.is_file() else None
    if local_commit is None and (repo_dir / "snapshots" / revision).is_dir():  # a commit hash
        local_commit = revision
    snapshot = repo_dir / "snapshots" / hub_commit
    wanted = filter_repo_objects(tree, allow_patterns=allow_patterns or MLX_ALLOW_PATTERNS, key=lambda f: f.path)
    missing = tuple(sorted(f.path for f in wanted
                           if not (snapshot / f.path).is_file() or (snapshot / f.path).stat().st_size != f.size))
    return HubVerification(repo_id=repo_id, revision=revision, hub_commit=hub_commit, local_commit=local_commit,
                           missing_files=missing)
