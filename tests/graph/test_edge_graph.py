"""The ingress's edge under real Ray Serve (no models needed): the ingress learns the proxies' bind host from Serve's
controller and refuses to start beyond loopback with the admin API on and no admin key; keys and the body limit
act through Serve's HTTP proxy.

Serve is restarted on 0.0.0.0 for this module (inside the loopback-only namespace that is still loopback only),
then put back on 127.0.0.1 for the rest of the session. It runs after the shared graph's tests (restarts_serve), so
the shared graph (tests/graph/shared_graph.py) is deployed again only if a test still to run uses it (a selection
that orders them otherwise); that redeploy cost 73 s of every CI run.
"""

from __future__ import annotations

import socket

import httpx
import pytest

from tests.graph.conftest import GRAPH_START_S, ServeCluster, deploy_graph, shared_graph_needed_again
from tests.support.serving import wait_until
from tests.graph.shared_graph import deploy_shared_graph

ADMIN = "sk-graph-admin"
INFERENCE = "sk-graph-inference"
LIMIT = 64 * 1024
pytestmark = pytest.mark.restarts_serve


def _ingress_schema(state_dir, **args):
    from ray.serve.schema import ServeDeploySchema

    # rag: null: no RAG deployment to start beside the ingress (nor to keep documents in ~/.cache).
    ingress = {"name": "orchard", "route_prefix": "/", "import_path": "deployments.app:build_app",
               "args": {"state_dir": str(state_dir), "status_poll_interval_s": 0.5, "rag": None, **args}}
    return ServeDeploySchema.model_validate({"applications": [ingress]})


@pytest.fixture(scope="module")
def serve_on_all_interfaces(serve_cluster) -> ServeCluster:
    from ray import serve

    serve.shutdown()
    serve.start(http_options={"host": "0.0.0.0", "port": serve_cluster.port})
    try:
        yield serve_cluster
    finally:
        serve.shutdown()
        serve.start(http_options={"host": "127.0.0.1", "port": serve_cluster.port})
        if serve_cluster.shared_schema is not None and shared_graph_needed_again():
            deploy_shared_graph(serve_cluster.shared_schema, serve_cluster.base_url)


def test_beyond_loopback_admin_without_its_key_refuses_to_start(serve_on_all_interfaces, tmp_path):
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ApplicationStatus

    _get_global_client().deploy_apps(_ingress_schema(tmp_path, api_keys=[INFERENCE]))

    def failed_message() -> str | None:  # the deployment's message says why (the application's only that it failed)
        app = serve.status().applications.get("orchard")
        failed = app is not None and app.status == ApplicationStatus.DEPLOY_FAILED
        return app.deployments["Ingress"].message if failed else None

    message = wait_until(failed_message, GRAPH_START_S, interval_s=0.5, what="the ingress to fail")
    assert "Refusing to start: HTTP binds to '0.0.0.0' (beyond loopback)" in message
    assert INFERENCE not in message


def _raw_post(port: int, head: str, body_parts: list[bytes]) -> tuple[bytes, int]:
    """Send a request's head and as many body parts as the server takes before it answers; the answer's first
    bytes and how many body bytes went out."""
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(head.encode())
        conn.settimeout(0.05)
        for part in body_parts:
            try:
                answer = conn.recv(4096)
                if answer:
                    return answer, sent
            except TimeoutError:
                pass
            try:
                conn.sendall(part)
            except OSError:  # the server closed after answering
                break
            sent += len(part)
        conn.settimeout(30)
        return conn.recv(4096), sent


def test_keys_and_body_limit_through_the_proxy(serve_on_all_interfaces, tmp_path):
    deploy_graph(_ingress_schema(tmp_path, api_keys=[INFERENCE], admin_key=ADMIN, max_body_bytes=LIMIT))
    port = serve_on_all_interfaces.port
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
        assert http.get("/health").status_code == 503  # open, and no model yet
        missing = http.get("/v1/models")
        assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
        assert http.get("/v1/models", headers={"Authorization": f"Bearer {INFERENCE}"}).status_code == 200
        assert http.get("/v1/admin/loaded-models", headers={"x-api-key": INFERENCE}).status_code == 403
        assert http.get("/v1/admin/loaded-models", headers={"x-api-key": ADMIN}).status_code == 200
        anthropic = http.post("/v1/messages", content=b" " * (LIMIT + 1),
                              headers={"x-api-key": INFERENCE, "Content-Type": "application/json"})
        assert anthropic.status_code == 413 and anthropic.json()["error"]["type"] == "request_too_large"

    # A declared 1 GiB: answered before the body comes (the proxy reads what is sent; nothing more is sent here, so
    # an answer at all shows that none was waited for; the socket's timeout bounds a hang).
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {INFERENCE}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {1 << 30}\r\n\r\n")
    answer, sent = _raw_post(port, head, [])
    assert answer.startswith(b"HTTP/1.1 413")
    # Chunked, no length: refused once past the limit; the sender is stopped long before its 4 MiB are out.
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {INFERENCE}\r\n"
            f"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunk = b"%x\r\n%s\r\n" % (4096, b" " * 4096)
    answer, sent = _raw_post(port, head, [chunk] * 1024)
    assert answer.startswith(b"HTTP/1.1 413") and LIMIT < sent < 1024 * len(chunk), sent
