"""Where and how many: a model's replicas as Ray Serve runs them (a model's and the ingress's `ray_actor_options`, a
model's `autoscaling`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator


class RayActorOptions(BaseModel):
    """Ray's per-replica resources. CPUs are scheduling tokens only (MLX is not bound by them)."""

    model_config = ConfigDict(extra="forbid")

    num_cpus: float = Field(0.1, ge=0, description="CPUs Ray reserves for the replica (a scheduling token)")
    num_gpus: float = Field(0.0, ge=0, description="GPUs Ray reserves for the replica")
    memory: int | None = Field(None, ge=0, description="bytes Ray reserves for the replica")
    resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources the replica needs")

    def to_ray(self) -> dict[str, Any]:
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.memory is not None:
            options["memory"] = self.memory
        if self.resources:
            options["resources"] = dict(self.resources)
        return options


class Autoscaling(BaseModel):
    """Serve's autoscaling of a model's replicas (its autoscaling_config): between min and max, by the requests
    each replica has running or queued."""

    model_config = ConfigDict(extra="forbid")

    # At least one: a model with no replica is an on_demand model's job (it loads at a request, idle_unload_s).
    min_replicas: int = Field(1, ge=1, description="replicas kept at least")
    max_replicas: int = Field(2, ge=1, description="replicas at most (each its own engine and copy of the weights)")
    target_ongoing_requests: float = Field(
        32.0, gt=0, description="requests per replica Serve aims at: more add a replica, fewer remove one")
    upscale_delay_s: float = Field(10.0, ge=0, description="load above the target this long adds a replica")
    downscale_delay_s: float = Field(300.0, ge=0, description="load below the target this long removes one")

    @model_validator(mode="after")
    def _check(self) -> "Autoscaling":
        if self.min_replicas > self.max_replicas:
            raise ValueError("autoscaling: min_replicas is over max_replicas")
        return self


__all__ = ["Autoscaling", "RayActorOptions"]
