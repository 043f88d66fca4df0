"""Where a request goes: adapter-affinity routing for the LLM replicas.

`router.policy` is pure (tiers from replica snapshots); `router.ray_router.AffinityRouter`
is the thin Ray Serve `RequestRouter` around it.
"""

from router.policy import AffinityConfig, ReplicaState, num_homes, rank_for_adapter, rank_for_base
from router.popularity import PopularityTracker
from router.ray_router import ROUTER_CLASS_PATH, AffinityRouter
from router.rendezvous import home_replicas

__all__ = [
    "AffinityConfig",
    "AffinityRouter",
    "PopularityTracker",
    "ROUTER_CLASS_PATH",
    "ReplicaState",
    "home_replicas",
    "num_homes",
    "rank_for_adapter",
    "rank_for_base",
]
