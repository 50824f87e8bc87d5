"""Keep a replica's inter-deployment gRPC server on loopback when Ray itself runs on loopback (a local server)."""

from __future__ import annotations

import ipaddress
import logging

import ray

logger = logging.getLogger("ray.serve.orchard")
WILDCARD = "[::]:"


def keep_replica_grpc_on_loopback() -> None:
    """Call first thing in a deployment's __init__, which Serve runs before it binds that server.

    Ray 2.60 hard-codes the address, no setting changes it: serve/_private/replica.py:1835 (`_on_initialized`) calls
    the module-global `add_port_to_grpc_server(self._server, "[::]:0")`, every interface. We wrap that private
    function to bind the node IP instead, which its callers dial (serve/_private/request_router/replica_wrapper.py:292);
    only where the node IP is loopback (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0): a multi-node cluster is left alone.
    """
    node_ip = ray.util.get_node_ip_address()
    if not is_loopback(node_ip):
        return
    try:
        from ray._common.network_utils import build_address
        from ray.serve._private import replica

        add_port = replica.add_port_to_grpc_server
    except (ImportError, AttributeError) as exc:  # Ray moved its private parts: serve on, but say it
        logger.error("cannot keep this replica's gRPC server on %s (Ray changed: %r); it listens on [::]", node_ip, exc)
        return
    if getattr(add_port, "orchard_node_ip", None) is not None:
        return

    def add_port_on_node_ip(server, address: str) -> int:
        if address.startswith(WILDCARD):
            address = build_address(node_ip, int(address[len(WILDCARD):]))
        return add_port(server, address)

    add_port_on_node_ip.orchard_node_ip = node_ip
    replica.add_port_to_grpc_server = add_port_on_node_ip


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: Ray's node IP is an address, so not a local server
        return False
