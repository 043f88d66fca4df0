"""Prefix affinity: among the replicas holding a request's adapter, the router prefers the one it last sent the same
prompt prefix (for the same adapter version), within the load bound; the fingerprint the ingress computes, the
router's memory of where each prefix went, and the Ray shell noting and using both."""

import asyncio

from ray.serve._private.common import RequestMetadata
from ray.serve.request_router import PendingRequest

from deployments.data_plane.protocol import GenerateRequest
from router.policy import AffinityConfig, ReplicaState, rank_for_adapter
from router.prefixes import PREFIX_CHARS, PREFIX_IDS, PrefixMemory, prefix_fingerprint
from router.ray_router import request_fingerprint
from test_affinity_router_shell import FakeReplica, make_router

CFG = AffinityConfig()


def rs(rid, q=0, dev=(), host=()):
    return ReplicaState(rid, q, 16, frozenset(dev), frozenset(host))


def test_the_holder_last_sent_the_prefix_comes_first_even_from_host_memory():
    reps = [rs("r0", q=0, dev=["x@1"]), rs("r1", q=2, host=["x@1"]), rs("r2", q=0)]
    assert rank_for_adapter("x@1", reps, 1, CFG)[0] == ["r0"]  # no prefix known: device residency, then load
    assert rank_for_adapter("x@1", reps, 1, CFG, prefix_sent={"r1": 5.0})[0] == ["r1"]
    # the most recent of two holders; a replica that does not hold the adapter never wins on a prefix
    assert rank_for_adapter("x@1", reps, 1, CFG, prefix_sent={"r0": 4.0, "r1": 5.0, "r2": 9.0})[:2] == [["r1"], ["r0"]]
    assert rank_for_adapter("x@1", reps, 1, AffinityConfig(prefix_affinity=False), prefix_sent={"r1": 5.0})[0] == ["r0"]


def test_prefix_preference_stays_within_the_load_bound():
    reps = [rs("r0", q=12, dev=["x@1"]), rs("r1", q=1, dev=["x@1"]), rs("r2", q=0)]
    # bound = max(4, ceil(1.6 * 14 / 3)) = 8: r0 is over it, so its cached prefix does not pull more onto it
    assert rank_for_adapter("x@1", reps, 1, CFG, prefix_sent={"r0": 5.0})[0] == ["r1"]


def test_memory_keys_by_adapter_version_forgets_old_entries_and_dead_replicas():
    now = [0.0]
    mem = PrefixMemory(ttl_s=10, max_entries=2, clock=lambda: now[0])
    mem.note("x@1", "f", "r0")
    now[0] = 3
    mem.note("x@1", "f", "r1")
    assert mem.recency("x@1", "f") == {"r0": 0.0, "r1": 3.0}
    assert mem.recency("x@2", "f") == {} and mem.recency("x@1", None) == {}
    now[0] = 11
    assert mem.recency("x@1", "f") == {"r1": 3.0}  # r0's is past the ttl
    mem.forget_replica("r1")
    assert mem.recency("x@1", "f") == {}
    mem.note("x@1", "g", "r0"), mem.note("x@1", "h", "r0")  # over max_entries: the least recently noted goes
    assert mem.recency("x@1", "f") == {} and mem.recency("x@1", "h") == {"r0": 11}


def test_fingerprint_of_a_long_enough_head_of_text_ids_or_messages():
    system = "You are a careful support agent. " * 20
    assert len(system) >= PREFIX_CHARS
    assert prefix_fingerprint(system + "question one") == prefix_fingerprint(system + "another question")
    assert prefix_fingerprint("x" + system) != prefix_fingerprint(system)
    assert prefix_fingerprint("short prompt") is None
    ids = list(range(PREFIX_IDS))
    assert prefix_fingerprint(ids + [1]) == prefix_fingerprint(ids + [2]) and prefix_fingerprint(ids[:-1]) is None
    chat = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
    assert prefix_fingerprint(chat) == prefix_fingerprint(chat[:1] + [{"role": "user", "content": "bye"}])
    req = GenerateRequest("r", "x@1", {}, messages=chat)
    assert req.prefix_fingerprint == prefix_fingerprint(chat)
    assert GenerateRequest("r", None, {}, prompt="hi").prefix_fingerprint is None


def test_the_ray_shell_sends_a_prefix_back_where_it_went_last():
    router = make_router()
    reps = [FakeReplica(f"r{i}", routing_stats={"device_adapters": ["x@1"]}) for i in range(3)]
    req = GenerateRequest("q", "x@1", {}, prompt="You are a careful support agent. " * 20 + "a question")
    meta = RequestMetadata(request_id="q", internal_request_id="q", multiplexed_model_id="x@1")
    pending = PendingRequest(args=[req], kwargs={}, metadata=meta, future=None)
    assert request_fingerprint(pending) == req.prefix_fingerprint is not None
    for target in ("r2", "r1"):
        router.on_request_routed(pending, reps[int(target[1])].replica_id, None)
        tiers = asyncio.run(router.choose_replicas(reps, pending))
        assert tiers[0][0].uid == target  # the last one sent this prefix
    bare = PendingRequest(args=[], kwargs={}, metadata=meta, future=None)
    assert request_fingerprint(bare) is None


def test_the_benchmark_mix_repeats_long_prefixes_and_scores_where_they_went():
    from bench.affinity_mix import prefix_mix, prefix_score

    mix = prefix_mix(["a", "b"], 40, prefixes=3)
    assert all(len(prompt) >= PREFIX_CHARS for _, prompt in mix)
    assert len({(a, prefix_fingerprint(p)) for a, p in mix}) <= 6
    results = [{"adapter": "a", "prefix": "p", "replica": r} for r in ("r0", "r0", "r1", "r0")]
    assert prefix_score(results) == {"prefixes": 1, "prefix_routed_back": 2 / 3, "prefix_computations": 2}
