"""`AffinityRouter`: the Ray Serve `RequestRouter` shell around `router.policy`.

Serve calls `choose_replicas` for each routing attempt and takes the least-loaded replica
with room from the first non-empty tier we return; this class only turns Serve's replica
objects into `ReplicaState` snapshots and back. Configure it with

    RequestRouterConfig(request_router_class="router.ray_router.AffinityRouter",
                        request_router_kwargs={...AffinityConfig fields...})
"""

from __future__ import annotations

import random
from typing import Any, List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from router.assignments import AssignmentMemory
from router.keys import AdapterKey
from router.policy import AffinityConfig, ReplicaState, num_homes, rank_for_adapter, rank_for_base
from router.popularity import PopularityTracker
from router.prefixes import PrefixMemory

__all__ = ["AffinityRouter", "ROUTER_CLASS_PATH", "replica_state", "request_fingerprint"]

ROUTER_CLASS_PATH = "router.ray_router.AffinityRouter"


def replica_state(replica: RunningReplica, queue_len: Optional[int], believed: frozenset[str]) -> ReplicaState:
    """Snapshot of one replica from its routing stats (see `LLMServer.record_routing_stats`)."""
    stats: dict[str, Any] = replica.routing_stats or {}
    device = frozenset(stats.get("device_adapters", ())) | believed
    host = frozenset(stats.get("host_adapters", ())) | frozenset(replica.multiplexed_model_ids)
    homes = stats.get("homes")
    return ReplicaState(
        replica_id=replica.replica_id.unique_id,
        queue_len=int(queue_len if queue_len is not None else stats.get("num_ongoing", 0)),
        max_ongoing=replica.max_ongoing_requests,
        device_adapters=device,
        host_adapters=host,
        free_kv_blocks=stats.get("free_kv_blocks"),
        homes=None if homes is None else frozenset(homes),
    )


def request_fingerprint(pending_request: PendingRequest) -> Optional[str]:
    """The prompt-prefix fingerprint the ingress put on the request (deployments.data_plane.protocol.GenerateRequest, the
    handle call's one argument); None for a call without one."""
    args = pending_request.args
    return getattr(args[0], "prefix_fingerprint", None) if args else None


class AffinityRouter(RequestRouter):
    """Adapter-affinity routing: bounded load, then resident (device > host) > placement homes >
    least loaded; base-model requests by 2 choices."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._cfg = AffinityConfig(**kwargs)
        self._popularity = PopularityTracker(half_life_s=self._cfg.popularity_half_life_s)
        self._assignments = AssignmentMemory(ttl_s=self._cfg.assignment_ttl_s)
        self._prefixes = PrefixMemory(ttl_s=self._cfg.prefix_ttl_s)
        self._rng = random.Random()

    def _ensure_state(self) -> None:
        # Serve calls initialize_state only when kwargs are configured; default them.
        if not hasattr(self, "_cfg"):
            self.initialize_state()

    def _snapshot(self, replica: RunningReplica) -> ReplicaState:
        stats = replica.routing_stats or {}
        rid = replica.replica_id.unique_id
        reported = frozenset(stats.get("device_adapters", ())) | frozenset(stats.get("host_adapters", ()))
        believed = self._assignments.adapters_on(rid, reported, stats.get("reported_at"))
        return replica_state(replica, self._replica_queue_len_cache.get(replica.replica_id), believed)

    async def choose_replicas(
        self,
        candidate_replicas: List[RunningReplica],
        pending_request: Optional[PendingRequest] = None,
    ) -> List[List[RunningReplica]]:
        self._ensure_state()
        # A replica whose engine died takes nothing (it answers at once, so it would look least loaded) while Serve
        # replaces it; unless none is left
        candidate_replicas = [r for r in candidate_replicas if (r.routing_stats or {}).get("engine_alive", True)] \
            or candidate_replicas
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        states = [self._snapshot(r) for r in candidate_replicas]
        key = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if not key:
            tiers = rank_for_base(states, self._rng)
        else:
            family = AdapterKey.family(key)
            homes = num_homes(
                self._popularity.share(family), self._popularity.count(family), len(states), self._cfg
            )
            sent = self._prefixes.recency(key, request_fingerprint(pending_request))
            tiers = rank_for_adapter(key, states, homes, self._cfg, self._rng, prefix_sent=sent)
        return [[by_id[rid] for rid in tier] for tier in tiers]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self._ensure_state()
        key = pending_request.metadata.multiplexed_model_id
        if key:
            self._assignments.note(key, replica_id.unique_id)
            self._popularity.record(AdapterKey.family(key))
            fingerprint = request_fingerprint(pending_request)
            if fingerprint is not None:
                self._prefixes.note(key, fingerprint, replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        if hasattr(self, "_assignments"):
            self._assignments.forget_replica(replica_id.unique_id)
            self._prefixes.forget_replica(replica_id.unique_id)
