"""The one place this project uses Ray's and Ray Serve's private API, and why.

A replica that loads an adapter tells Serve's controller at once which adapters it holds (and its routing
stats), so every router, ours and Ray's default multiplex-aware one, sees the load within one long-poll
broadcast instead of after the next `record_routing_stats` period. Ray has no public call for this: the
`@serve.multiplexed` decorator makes the same private call, but it owns an LRU cache of loaded models that
cannot follow our placement-driven eviction and pins. Everything else (the replica id, routing stats, the
router) goes through public APIs.

Warm starts (deployments/warm_start.py) fork a Ray worker from a process that imported what a Serve replica's
worker imports: that is the module of Serve's replica actor, and the fork runs the script Ray starts every
Python worker with. Ray names neither publicly.

`tests/deployments/test_serve_internals.py` fails loudly when Ray changes what is used here.
"""

from __future__ import annotations

import os
from typing import Callable

__all__ = ["residency_publisher", "SERVE_REPLICA_MODULE", "ray_worker_script"]

SERVE_REPLICA_MODULE = "ray.serve._private.replica"  # Serve's replica actor: imports what its worker runs


def ray_worker_script() -> str:
    """The script Ray starts each Python worker with (the first argument of a worker's command line)."""
    import ray._private.workers

    return os.path.join(os.path.dirname(ray._private.workers.__file__), "default_worker.py")


def residency_publisher() -> Callable[[list[str], dict], None]:
    """-> publish(adapter keys, routing stats): push them to Serve's controller now. Call inside a replica."""
    from ray import serve
    from ray.serve._private.common import RequestRoutingInfo
    from ray.serve.context import _get_global_client

    replica_id = serve.get_replica_context().replica_id

    def publish(keys: list[str], stats: dict) -> None:
        info = RequestRoutingInfo(replica_id=replica_id, multiplexed_model_ids=list(keys), routing_stats=stats)
        _get_global_client().record_request_routing_info(info)

    return publish
