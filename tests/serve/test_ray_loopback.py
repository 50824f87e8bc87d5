"""deployments/ray_loopback.py in this process, on a real gRPC server: the address Serve asks for is rewritten to the
node IP; if Ray's private function is gone, an ERROR is logged and nothing raises. (The graph test
test_serve_graph.py::test_every_socket_of_the_cluster_listens_on_loopback_only checks real replicas.)"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import ray
from ray.serve._private import replica

from deployments.ray_loopback import is_loopback, keep_replica_grpc_on_loopback
from tests.support.sockets import listening_sockets


@pytest.fixture
def serve_add_port(monkeypatch):
    """Serve's module global, put back after the test (the wrapper replaces it for the whole process)."""
    if not is_loopback(ray.util.get_node_ip_address()):
        pytest.skip("Ray's node IP is not loopback: run through scripts/test.sh (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0)")
    monkeypatch.setattr(replica, "add_port_to_grpc_server", replica.add_port_to_grpc_server)


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc/net/tcp")
def test_the_wildcard_address_serve_asks_for_binds_the_node_ip(serve_add_port):
    keep_replica_grpc_on_loopback()
    keep_replica_grpc_on_loopback()  # a second call wraps nothing twice
    assert replica.add_port_to_grpc_server.orchard_node_ip == ray.util.get_node_ip_address()
    server = grpc.server(ThreadPoolExecutor(max_workers=1))
    port = replica.add_port_to_grpc_server(server, "[::]:0")  # what replica.py's _on_initialized asks for
    server.start()
    try:
        bound = [(s.address, s.port) for s in listening_sockets() if s.port == port]
        assert bound == [(ray.util.get_node_ip_address(), port)]
    finally:
        server.stop(None)


def test_a_ray_without_the_private_function_gets_an_error_log_not_a_crash(serve_add_port, monkeypatch, caplog):
    monkeypatch.delattr(replica, "add_port_to_grpc_server")
    with caplog.at_level(logging.ERROR, logger="ray.serve.orchard"):
        keep_replica_grpc_on_loopback()
    [record] = caplog.records
    assert record.levelno == logging.ERROR and "Ray changed" in record.getMessage()
    assert "add_port_to_grpc_server" in record.getMessage()
