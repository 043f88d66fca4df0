"""What one LLM replica asks Ray for: its CPU and GPU shares, and with tensor parallelism a placement group.

A tensor-parallel engine (`engine.tensor_parallel_size` N > 1) runs N processes: the replica (rank 0) and the
N - 1 worker ranks it starts itself, which are its child processes, not Ray actors. So the group has N bundles
on one node (STRICT_PACK): bundle 0 holds the replica actor, bundles 1 .. N-1 reserve each worker rank's CPU
share. On a GPU every rank's GPU is in bundle 0, the replica's own: Ray makes a process's visible GPUs
(CUDA_VISIBLE_DEVICES) those of its own resources, and the worker ranks inherit the replica's, taking
cuda:1 .. cuda:N-1 of them."""

from __future__ import annotations

from typing import Any

__all__ = ["llm_replica_resources"]


def llm_replica_resources(cfg: Any) -> dict[str, Any]:
    """`LLMDeployment.options` fields for an AppConfig: ray_actor_options' num_cpus/num_gpus, and for more than one
    rank placement_group_bundles and placement_group_strategy. num_cpus/num_gpus_per_replica are per rank."""
    size = cfg.engine["tensor_parallel_size"]
    cpus, gpus = cfg.num_cpus_per_replica, cfg.num_gpus_per_replica
    actor = {"num_cpus": cpus, "num_gpus": gpus * size}
    if cfg.replica_resources:  # custom resources, on the replica actor (rank 0) only
        actor["resources"] = dict(cfg.replica_resources)
    if size == 1:
        return {"ray_actor_options": actor}
    first = {"CPU": cpus} | ({"GPU": gpus * size} if gpus else {}) | dict(cfg.replica_resources)
    return {"ray_actor_options": actor,
            "placement_group_bundles": [first] + [{"CPU": cpus} for _ in range(size - 1)],
            "placement_group_strategy": "STRICT_PACK"}
