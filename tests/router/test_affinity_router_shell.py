"""`AffinityRouter` (the Ray class) turns Serve's replica objects into policy input and back,
and remembers its own assignments: affinity from the very first request, before any report."""

import asyncio
from dataclasses import dataclass, field

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest

from router.ray_router import AffinityRouter
from router.rendezvous import home_replicas

DEP = DeploymentID(name="LLMServer", app_name="test")


@dataclass
class FakeReplica:
    """The RunningReplica attributes the router reads."""

    uid: str
    routing_stats: dict = field(default_factory=dict)
    multiplexed_model_ids: set = field(default_factory=set)
    max_ongoing_requests: int = 8

    @property
    def replica_id(self):
        return ReplicaID(unique_id=self.uid, deployment_id=DEP)


def make_router(**kwargs):
    r = AffinityRouter(deployment_id=DEP, handle_source=DeploymentHandleSource.UNKNOWN)
    r.initialize_state(**kwargs)
    return r


def pending(model_id: str, rid: str = "r") -> PendingRequest:
    meta = RequestMetadata(request_id=rid, internal_request_id=rid, multiplexed_model_id=model_id)
    return PendingRequest(args=[], kwargs={}, metadata=meta, future=None)


def choose(router, replicas, req):
    return asyncio.run(router.choose_replicas(replicas, req))


def test_first_request_goes_home_and_second_follows_without_reports():
    router = make_router()
    reps = [FakeReplica(f"r{i}") for i in range(3)]
    home = home_replicas("ad", [r.uid for r in reps], 1)[0]
    tiers = choose(router, reps, pending("ad@1"))
    assert tiers[0][0].uid == home
    # it was sent elsewhere (say, a spill): the router's own memory now prefers that replica,
    # before any replica report, and the home comes second
    other = next(r for r in reps if r.uid != home)
    router.on_request_routed(pending("ad@1"), other.replica_id, None)
    tiers = choose(router, reps, pending("ad@1"))
    assert [r.uid for r in tiers[0]] == [other.uid] and [r.uid for r in tiers[1]] == [home]


def test_reported_residency_and_multiplex_ids_count():
    router = make_router()
    reps = [FakeReplica("a"), FakeReplica("b", routing_stats={"device_adapters": ["x@1"], "host_adapters": ["x@1"],
                                                             "reported_at": 1.0}),
            FakeReplica("c", multiplexed_model_ids={"x@1"})]
    tiers = choose(router, reps, pending("x@1"))
    assert [t[0].uid for t in tiers] == ["b", "c", "a"]  # device > host (multiplexed id) > none


def test_report_newer_than_assignment_that_omits_adapter_wins():
    router = make_router()
    reps = [FakeReplica("a"), FakeReplica("b")]
    router.on_request_routed(pending("x@1"), reps[0].replica_id, None)
    reps[0].routing_stats = {"host_adapters": [], "reported_at": 1e12}  # evicted since
    home = home_replicas("x", ["a", "b"], 1)[0]
    assert [r.uid for r in choose(router, reps, pending("x@1"))[0]] == [home]


def test_base_requests_two_choices_and_kwargs_validated():
    router = make_router()
    reps = [FakeReplica(f"r{i}") for i in range(4)]
    (tier,) = choose(router, reps, pending(""))
    assert len(tier) == 2
    assert choose(router, [], pending("x")) == []
    with pytest.raises(ValueError):
        make_router(saturation=0)


def test_a_replica_whose_engine_died_gets_nothing_unless_none_is_left():
    router = make_router()
    dead = FakeReplica("d", routing_stats={"engine_alive": False, "device_adapters": ["x@1"], "reported_at": 1.0})
    reps = [dead, FakeReplica("a"), FakeReplica("b")]
    for key in ("x@1", ""):  # not even for the adapter it holds
        assert "d" not in {r.uid for tier in choose(router, reps, pending(key)) for r in tier}
    assert [r.uid for tier in choose(router, [dead], pending("")) for r in tier] == ["d"]
