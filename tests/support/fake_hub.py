"""A local stand-in of the Hugging Face Hub's HTTP API: the endpoints huggingface_hub 2.4.0 calls to download.

- GET  /api/models/{repo}[/revision/{rev}]     model_info / repo_info (snapshot_download resolves the commit here)
- GET  /api/models/{repo}/tree/{rev}            list_repo_tree (recursive listing, one page)
- HEAD /{repo}/resolve/{rev}/{path}             file metadata: X-Repo-Commit, ETag, X-Linked-Etag, X-Linked-Size
- GET  /{repo}/resolve/{rev}/{path}             the bytes; `Range: bytes=N-` answers 206 with the rest

Errors carry the Hub's X-Error-Code header (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo), which is
what huggingface_hub turns into its typed errors. Like the Hub, a gated repo's metadata is public and its files
answer 401 without the right token. Every request is recorded (method, path, Range, bytes sent) for the tests.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Self
from urllib.parse import unquote, urlsplit

CHUNK_BYTES = 64 * 1024
_API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+)|/tree/(?P<tree_rev>[^/]+))?$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")
_RANGE = re.compile(r"^bytes=(?P<start>\d+)-$")


@dataclass
class FakeRepo:
    files: dict[str, bytes]
    commit: str
    gated_token: str | None = None  # set: files answer 401 GatedRepo unless `Authorization: Bearer <token>`
    # One connection per path is closed after this many body bytes (the first GET of that path only).
    drop_once_after: dict[str, int] = field(default_factory=dict)
    fail_paths: set[str] = field(default_factory=set)  # GETs of these answer 500 (HEAD still answers)

    def etag(self, path: str) -> str:
        return hashlib.sha256(self.files[path]).hexdigest()


@dataclass
class ServedRequest:
    """Recorded before its body goes out (bytes_sent counts each chunk before it is written), so a client that has
    read a response always finds it recorded."""

    method: str
    repo_id: str
    path: str  # the file's path in the repo ("" for API calls)
    range_start: int
    bytes_sent: int
    status: int


class FakeHub:
    """Serve repos over HTTP on 127.0.0.1 in a thread; `url` is the HF_ENDPOINT / `endpoint=` to use."""

    def __init__(self, bytes_per_second: int | None = None) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.bytes_per_second = bytes_per_second
        self.requests: list[ServedRequest] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_class(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-hub", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def add_repo(self, repo_id: str, files: dict[str, bytes], gated_token: str | None = None) -> FakeRepo:
        commit = hashlib.sha1(repr(sorted((p, hashlib.sha256(b).hexdigest()) for p, b in files.items())).encode())
        repo = FakeRepo(files=dict(files), commit=commit.hexdigest(), gated_token=gated_token)
        self.repos[repo_id] = repo
        return repo

    def add_folder(self, repo_id: str, folder: Path, gated_token: str | None = None) -> FakeRepo:
        files = {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        return self.add_repo(repo_id, files, gated_token)

    def file_gets(self, repo_id: str, path: str | None = None) -> list[ServedRequest]:
        with self._lock:
            return [r for r in self.requests
                    if r.method == "GET" and r.repo_id == repo_id and r.path and (path is None or r.path == path)]

    def record(self, served: ServedRequest) -> None:
        with self._lock:
            self.requests.append(served)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def _handler_class(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(_HubHandler):
        pass

    Handler.hub = hub
    return Handler


class _HubHandler(BaseHTTPRequestHandler):
    hub: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # keep test output quiet
        pass

    def do_GET(self) -> None:
        self._route(send_body=True)

    def do_HEAD(self) -> None:
        self._route(send_body=False)

    def _route(self, send_body: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        if (match := _API.match(path)) and send_body:
            self._api(match["repo"], match["rev"], match["tree_rev"])
        elif match := _RESOLVE.match(path):
            self._resolve(match["repo"], match["rev"], match["path"], send_body)
        else:
            self._error(404, "EntryNotFound", "Not found")

    def _repo(self, repo_id: str, rev: str | None) -> FakeRepo | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found")
        elif rev not in (None, "main", repo.commit):
            self._error(404, "RevisionNotFound", "Invalid rev id: " + rev, commit=None)
            repo = None
        return repo

    def _api(self, repo_id: str, rev: str | None, tree_rev: str | None) -> None:
        repo = self._repo(repo_id, rev or tree_rev)
        if repo is None:
            return
        if tree_rev is not None:
            body = [{"type": "file", "path": p, "size": len(b), "oid": repo.etag(p)} for p, b in repo.files.items()]
        else:
            body = {"id": repo_id, "sha": repo.commit, "private": False, "gated": "manual" if repo.gated_token else False,
                    "siblings": [{"rfilename": p} for p in repo.files]}
        data = json.dumps(body).encode()
        self.hub.record(ServedRequest("GET", repo_id, "", 0, len(data), 200))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _resolve(self, repo_id: str, rev: str, path: str, send_body: bool) -> None:
        repo = self._repo(repo_id, rev)
        if repo is None:
            return
        if repo.gated_token and self.headers.get("Authorization") != f"Bearer {repo.gated_token}":
            self._error(401, "GatedRepo", "Access to model " + repo_id + " is restricted.", commit=repo.commit)
            return
        if path not in repo.files:
            self._error(404, "EntryNotFound", "Entry not found", commit=repo.commit)
            return
        if send_body and path in repo.fail_paths:
            self.hub.record(ServedRequest("GET", repo_id, path, 0, 0, 500))
            self._error(500, None, "Internal Error", commit=repo.commit)
            return
        data = repo.files[path]
        range_match = _RANGE.match(self.headers.get("Range", ""))
        start = int(range_match["start"]) if range_match else 0
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", repo.commit)
        self.send_header("ETag", f'"{repo.etag(path)}"')
        self.send_header("X-Linked-Etag", f'"{repo.etag(path)}"')
        self.send_header("X-Linked-Size", str(len(data)))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(len(data) - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        if not send_body:
            self.hub.record(ServedRequest("HEAD", repo_id, path, 0, 0, 200))
            self.end_headers()
            return
        self.end_headers()
        served = ServedRequest("GET", repo_id, path, start, 0, 206 if start else 200)
        self.hub.record(served)
        self._send_body(data[start:], repo.drop_once_after.pop(path, None), served)

    def _send_body(self, body: bytes, drop_after: int | None, served: ServedRequest) -> None:
        """Write the body in chunks at the hub's rate; stop and close the connection after `drop_after` bytes."""
        limit = len(body) if drop_after is None else min(drop_after, len(body))
        rate = self.hub.bytes_per_second
        started = time.monotonic()
        try:
            while served.bytes_sent < limit:
                chunk = body[served.bytes_sent:min(served.bytes_sent + CHUNK_BYTES, limit)]
                served.bytes_sent += len(chunk)
                self.wfile.write(chunk)
                if rate:  # sleep until the bytes sent so far fit the rate
                    time.sleep(max(0.0, served.bytes_sent / rate - (time.monotonic() - started)))
        except (BrokenPipeError, ConnectionResetError):
            served.bytes_sent -= len(chunk)  # counted, not delivered
            self.close_connection = True
            return
        if drop_after is not None:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True

    def _error(self, status: int, code: str | None, message: str, commit: str | None = None) -> None:
        data = json.dumps({"error": message}).encode()
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        if commit:
            self.send_header("X-Repo-Commit", commit)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


def random_bytes(n: int, seed: int) -> bytes:
    """Incompressible, reproducible file content."""
    return hashlib.shake_256(seed.to_bytes(4, "little")).digest(n)
