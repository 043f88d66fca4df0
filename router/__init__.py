"""Where a request goes and where adapters live.

`router.placement` (tiers, homes, eviction order) and `router.policy` (replica ranking) are pure;
`router.controller.PlacementController` runs the placement over reported counts;
`router.ray_router.AffinityRouter` is the thin Ray Serve `RequestRouter` around the ranking; it is not imported
here, so the pure policy (and the replica code that uses it) imports without Ray.
"""

from router.controller import PlacementController, PlacementView
from router.keys import AdapterKey
from router.placement import PlacementConfig
from router.policy import AffinityConfig, ReplicaState, num_homes, rank_for_adapter, rank_for_base, rank_replicas
from router.popularity import PopularityTracker
from router.rendezvous import home_replicas

__all__ = [
    "AdapterKey",
    "AffinityConfig",
    "PlacementConfig",
    "PlacementController",
    "PlacementView",
    "PopularityTracker",
    "ReplicaState",
    "home_replicas",
    "num_homes",
    "rank_for_adapter",
    "rank_for_base",
    "rank_replicas",
]
