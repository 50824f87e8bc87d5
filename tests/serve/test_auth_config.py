"""Where keys come from (config wins over the environment), what a key may be, and the bind rule: an ingress that
serves beyond loopback with the admin API on and no admin key refuses to start."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from deployments.api.errors import AuthenticationError
from deployments.ingress_config import ADMIN_KEY_ENV, API_KEYS_ENV, IngressConfig
from deployments.ingress.auth import (
    ApiKeys,
    RouteAccess,
    check_admin_exposure,
    is_loopback_host,
    route_access,
)


@pytest.fixture(autouse=True)
def no_key_env(monkeypatch):
    monkeypatch.delenv(API_KEYS_ENV, raising=False)
    monkeypatch.delenv(ADMIN_KEY_ENV, raising=False)


def test_keys_come_from_the_environment_when_the_config_leaves_them_unset(monkeypatch):
    assert IngressConfig().resolved_api_keys() == [] and IngressConfig().resolved_admin_key() is None
    monkeypatch.setenv(API_KEYS_ENV, " env-one, env-two ,,")
    monkeypatch.setenv(ADMIN_KEY_ENV, "env-admin")
    assert IngressConfig().resolved_api_keys() == ["env-one", "env-two"]
    assert IngressConfig().resolved_admin_key() == "env-admin"
    # The config wins, field by field; an explicit empty list means no inference keys whatever the environment.
    config = IngressConfig(api_keys=["cfg-one"], admin_key="cfg-admin")
    assert config.resolved_api_keys() == ["cfg-one"] and config.resolved_admin_key() == "cfg-admin"
    assert IngressConfig(api_keys=[]).resolved_api_keys() == []
    assert IngressConfig(api_keys=["cfg-one"]).resolved_admin_key() == "env-admin"


def test_keys_are_secret_in_reprs_dumps_and_refusals(monkeypatch):
    config = IngressConfig(api_keys=["sk-secret-one"], admin_key="sk-secret-admin")
    for text in (repr(config), str(config), str(config.model_dump()), config.model_dump_json()):
        assert "sk-secret" not in text
    with pytest.raises(ValidationError) as refused:
        IngressConfig(api_keys=["sk-has space"])
    assert "api_keys" in str(refused.value) and "sk-has" not in str(refused.value)
    with pytest.raises(ValidationError) as refused:
        IngressConfig(admin_key="sk-ünïcode")
    assert "admin_key" in str(refused.value) and "sk-" not in str(refused.value)
    monkeypatch.setenv(API_KEYS_ENV, "sk-good,sk-tab\there")
    with pytest.raises(ValueError, match=API_KEYS_ENV) as refused:
        IngressConfig().resolved_api_keys()
    assert "sk-tab" not in str(refused.value)


def test_the_admin_key_must_differ_from_the_inference_keys():
    with pytest.raises(ValueError, match="must differ") as refused:
        ApiKeys(["sk-same"], "sk-same")
    assert "sk-same" not in str(refused.value)


def test_routes_by_access():
    assert [route_access(p) for p in ("/health", "/openapi.json", "/docs")] == [RouteAccess.OPEN] * 3
    admin = ("/v1/admin/load-model", "/v1/admin/unload-model/a/b", "/v1/admin/loaded-models", "/v1/admin",
             "/v1/admin/download-model-stream", "/v1/models/local/org/name")
    assert [route_access(p) for p in admin] == [RouteAccess.ADMIN] * 6
    inference = ("/v1/chat/completions", "/v1/messages", "/v1/models", "/v1/queue/stats", "/v1/administrator", "/x",
                 "/v1/models/org/name", "/v1/models/localmodel")
    assert [route_access(p) for p in inference] == [RouteAccess.INFERENCE] * 8
    # Bodega's DELETE /v1/models/{id} deletes from the cache: the admin key's, as /v1/models/local/ is.
    assert route_access("/v1/models/org/name", "DELETE") == RouteAccess.ADMIN
    assert route_access("/v1/models/org/name", "delete") == RouteAccess.ADMIN
    assert route_access("/v1/models/org/name", "GET") == RouteAccess.INFERENCE
    # RAG's writes keep what they are sent on the disk; its reads are inference routes.
    assert [route_access(p, m) for p, m in (("/v1/rag/upload", "POST"), ("/v1/rag/documents/f1", "DELETE"))] == [
        RouteAccess.DISK_WRITE] * 2
    assert [route_access(p) for p in ("/v1/rag/query", "/v1/rag/documents")] == [RouteAccess.INFERENCE] * 2
    # So do the Files API's upload and delete; listing and reading files are inference routes.
    assert [route_access(p, m) for p, m in (("/v1/files", "POST"), ("/v1/files/file-1", "DELETE"))] == [
        RouteAccess.DISK_WRITE] * 2
    assert [route_access(p) for p in ("/v1/files", "/v1/files/file-1", "/v1/files/file-1/content")] == [
        RouteAccess.INFERENCE] * 3
    assert route_access("/v1/filesystem", "POST") == RouteAccess.INFERENCE
    # A batch writes its output files there too; reading batches is an inference route.
    assert [route_access(p, "POST") for p in ("/v1/batches", "/v1/batches/batch_1/cancel")] == [
        RouteAccess.DISK_WRITE] * 2
    assert route_access("/v1/batches/batch_1") == RouteAccess.INFERENCE


def test_a_batch_runs_its_lines_with_the_ingress_own_inference_key():
    from deployments.ingress.deployment import _own_key
    from deployments.ingress_config import IngressConfig

    assert _own_key(IngressConfig(api_keys=["sk-user-1", "sk-user-2"], admin_key="sk-admin")) == {
        "Authorization": "Bearer sk-user-1"}
    assert _own_key(IngressConfig(api_keys=[], admin_key="sk-admin")) == {}  # inference routes are open then


def test_rag_writes_follow_the_admin_key_when_no_inference_key_is_set():
    admin_only, both, none = ApiKeys([], "sk-admin"), ApiKeys(["sk-user"], "sk-admin"), ApiKeys([])
    with pytest.raises(AuthenticationError):
        admin_only.authorize(RouteAccess.DISK_WRITE, [])
    admin_only.authorize(RouteAccess.DISK_WRITE, [b"sk-admin"])
    admin_only.authorize(RouteAccess.INFERENCE, [])  # reads and generation stay open
    both.authorize(RouteAccess.DISK_WRITE, [b"sk-user"])  # with inference keys, any of them (or the admin key)
    both.authorize(RouteAccess.DISK_WRITE, [b"sk-admin"])
    none.authorize(RouteAccess.DISK_WRITE, [])  # no keys at all: open, as every route


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost", "LOCALHOST", None])
def test_loopback_hosts(host):
    assert is_loopback_host(host)
    check_admin_exposure(True, ApiKeys([]), host)  # no admin key needed


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.5", "10.0.0.1", "myhost.example"])
def test_beyond_loopback_the_admin_api_needs_its_key(host):
    assert not is_loopback_host(host)
    with pytest.raises(ValueError) as refused:
        check_admin_exposure(True, ApiKeys(["sk-inference-only"]), host)
    message = str(refused.value)
    assert repr(host) in message and "admin_key" in message and "ORCHARD_ADMIN_KEY" in message
    check_admin_exposure(True, ApiKeys([], "sk-admin"), host)
    check_admin_exposure(False, ApiKeys([]), host)  # no admin API: nothing to guard
