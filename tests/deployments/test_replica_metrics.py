"""Replica series in /metrics: the timer's reports and the responses' snapshots, ordered by the replica's
seq, tenant-private adapters left out, and the placement controller relaying the reports."""

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from deployments.metrics import ServingMetrics
from router.placement import PlacementConfig


def report(seq, drafted, adapters=("pub@1", "secret@1")):
    return {"seq": seq, "num_running": 2, "num_waiting": 0, "free_kv_blocks": 90, "device_adapters": 2,
            "host_adapters": 2,
            "speculative": {"cycles": 10 * seq, "plain_steps": 3, "joined": 2 * seq, "ridden_prompts": 4 * seq,
                            "paced_prompts": 5 * seq,
                            "gate_decisions": {"speculate": 10 * seq, "plain_cost": 3}},
            "adapters": {a: {"requests": 2, "hits": 1, "device_loads": 1, "loads": 1, "load_seconds": 0.1, "tokens": 40,
                             "acceptance_rate": 0.75, "drafted_tokens": drafted, "accepted_tokens": drafted // 2}
                         for a in adapters}}


def samples(m: ServingMetrics) -> dict:
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_timer_reports_export_speculation_per_adapter_and_replica():
    m = ServingMetrics()
    m.replicas.replace_all({"r1": report(1, 40)}, keep=lambda key: key.startswith("pub"))
    s = samples(m)
    ad = (("adapter", "pub@1"), ("replica", "r1"))
    assert s[("loraserve_spec_drafted_tokens_total", ad)] == 40
    assert s[("loraserve_spec_accepted_tokens_total", ad)] == 20
    assert s[("loraserve_spec_acceptance_rate", ad)] == 0.75
    assert s[("loraserve_spec_cycles_total", (("replica", "r1"),))] == 10
    assert s[("loraserve_spec_plain_steps_total", (("replica", "r1"),))] == 3
    assert s[("loraserve_spec_joined_requests_total", (("replica", "r1"),))] == 2
    assert s[("loraserve_spec_ridden_prompts_total", (("replica", "r1"),))] == 4
    assert s[("loraserve_spec_paced_prompts_total", (("replica", "r1"),))] == 5
    assert s[("loraserve_spec_gate_decisions_total", (("decision", "speculate"), ("replica", "r1")))] == 10
    assert not any("secret" in str(labels) for _, labels in s)  # kept out by `keep`


def test_an_older_report_never_takes_a_counter_back_and_gone_replicas_drop():
    m = ServingMetrics()
    m.replicas.update("r1", report(5, 100, adapters=("pub@1",)))  # a response's snapshot, fresher
    m.replicas.replace_all({"r1": report(4, 80), "r2": report(1, 8)}, keep=lambda key: True)  # the timer, older
    s = samples(m)
    assert s[("loraserve_spec_drafted_tokens_total", (("adapter", "pub@1"), ("replica", "r1")))] == 100
    assert s[("loraserve_spec_cycles_total", (("replica", "r1"),))] == 50
    assert s[("loraserve_spec_drafted_tokens_total", (("adapter", "secret@1"), ("replica", "r1")))] == 80
    m.replicas.replace_all({"r2": report(2, 16)}, keep=lambda key: True)
    s = samples(m)
    assert not any(("replica", "r1") in labels for _, labels in s)
    assert s[("loraserve_spec_drafted_tokens_total", (("adapter", "pub@1"), ("replica", "r2")))] == 16


def test_placement_controller_relays_the_reports_of_live_replicas():
    from deployments.placement import PlacementControllerDeployment

    cls = PlacementControllerDeployment.func_or_class

    async def scenario():
        ctl = cls.__new__(cls)
        await cls.__init__(ctl, PlacementConfig(), 4, 8, period_s=60, replica_ttl_s=60)
        share = await ctl.sync("r1", report(1, 4))
        await ctl.sync("r2")  # a heartbeat without a report
        out = await ctl.reports()
        ctl._task.cancel()
        return share, out

    share, out = asyncio.run(scenario())
    assert share["version"] >= 1 and set(out) == {"r1"} and out["r1"]["seq"] == 1


def test_prefix_cache_counters_go_from_the_engine_stats_to_the_series():
    from deployments.replica.report import replica_report

    stats = {"num_running": 1, "num_waiting": 0, "free_kv_blocks": 10, "device_adapters": ["pub@1"],
             "adapters": {"pub@1": {"requests": 3, "tokens": 9}},
             "prefix_cache": {"queries": 300, "hits": 128, "hit_rate": 128 / 300, "cached_blocks": 12, "evictions": 2,
                              "base": {"queries": 100, "hits": 0, "hit_rate": 0.0},
                              "adapters": {"pub@1": {"queries": 200, "hits": 128, "hit_rate": 0.64}}}}
    rep = replica_report(stats, 1, ["pub@1", "new@1"], host_adapters=1)
    assert rep["adapters"]["pub@1"]["prefix_queries"] == 200 and rep["adapters"]["new@1"]["prefix_hits"] == 0
    m = ServingMetrics()
    m.replicas.replace_all({"r1": rep}, keep=lambda key: True)
    s = samples(m)
    ad, r1 = (("adapter", "pub@1"), ("replica", "r1")), (("replica", "r1"),)
    assert s[("loraserve_prefix_cache_queries_total", ad)] == 200
    assert s[("loraserve_prefix_cache_hits_total", ad)] == 128
    assert s[("loraserve_replica_prefix_cache_queries_total", r1)] == 300
    assert s[("loraserve_replica_prefix_cache_hits_total", r1)] == 128
    assert s[("loraserve_prefix_cache_evictions_total", r1)] == 2
    assert s[("loraserve_prefix_cache_blocks", r1)] == 12
    assert "prefix_cache" not in replica_report({k: v for k, v in stats.items() if k != "prefix_cache"}, 2, [], 1)
