"""What an admin load over HTTP may reserve: the operator's maxima (serve_config.yaml's `admin_loads`) and what the
cluster's largest node could ever hold.

A replica is placed on one node, so a replica asking more than any node has waits forever: Serve keeps the
application deploying and its replicas pending (a hostile `num_cpus: 1000` held a load slot for good). Such a load
is refused at once, naming the field; serve_config.yaml's own models are the operator's and are not checked here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deployments.config import ModelConfig
from deployments.ingress_config import AdminLoadLimits
from engine.errors import InvalidRequestError


@dataclass(frozen=True)
class NodeCapacity:
    """One Ray node's total resources (what a replica placed there could ever get)."""

    cpus: float
    gpus: float
    memory_bytes: float
    custom: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ClusterCapacity:
    nodes: tuple[NodeCapacity, ...]

    @property
    def total_gpus(self) -> float:
        return sum(node.gpus for node in self.nodes)

    def largest(self, resource: str) -> float:
        return max((_amount(node, resource) for node in self.nodes), default=0.0)


def check_load_resources(config: ModelConfig, limits: AdminLoadLimits, capacity: ClusterCapacity) -> None:
    """Refuse (400 naming the field) a load over the operator's maxima, or one whose replicas no node could hold."""
    max_replicas = limits.max_replicas or max(1, int(capacity.total_gpus))
    if config.max_replicas > max_replicas:
        field = "autoscaling.max_replicas" if config.autoscaling is not None else "num_replicas"
        raise InvalidRequestError(
            f"{field} {config.max_replicas} is over this server's limit for loads over HTTP ({max_replicas}; "
            "serve_config.yaml's admin_loads.max_replicas)", param=field)
    options = config.ray_actor_options
    _check_at_most(options.num_cpus, limits.max_cpus_per_replica, "num_cpus", "max_cpus_per_replica", capacity)
    _check_at_most(options.num_gpus, limits.max_gpus_per_replica, "num_gpus", "max_gpus_per_replica", capacity)
    if options.memory is not None:
        _check_at_most(float(options.memory), None, "memory", None, capacity)
    if options.resources and not limits.allow_custom_resources:
        raise InvalidRequestError(
            "custom Ray resources are an operator setting (serve_config.yaml's admin_loads.allow_custom_resources)",
            param="ray_actor_options.resources")
    for name, amount in options.resources.items():
        _check_at_most(amount, None, name, None, capacity, param=f"ray_actor_options.resources.{name}")


def _check_at_most(asked: float, operator_max: float | None, resource: str, limit_name: str | None,
                   capacity: ClusterCapacity, param: str | None = None) -> None:
    param = param or f"ray_actor_options.{resource}"
    if operator_max is not None and asked > operator_max:
        raise InvalidRequestError(
            f"{param} {asked:g} is over this server's limit for loads over HTTP ({operator_max:g}; "
            f"serve_config.yaml's admin_loads.{limit_name})", param=param)
    largest = capacity.largest(resource)
    if asked > largest:
        raise InvalidRequestError(
            f"{param} {asked:g} is more than any node of the cluster has ({largest:g}): its replica could never "
            "be placed", param=param)


def _amount(node: NodeCapacity, resource: str) -> float:
    if resource == "num_cpus":
        return node.cpus
    if resource == "num_gpus":
        return node.gpus
    if resource == "memory":
        return node.memory_bytes
    return node.custom.get(resource, 0.0)
