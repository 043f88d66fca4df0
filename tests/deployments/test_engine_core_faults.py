"""An LLM replica's engine core killed (SIGKILL) under a bounded load, through the real Serve app (2 CPU LLM
replicas, each with its core in a process of its own) and the official `openai` client: 200 streaming chat
requests, 16 at a time. No request hangs or drops its connection; a stream the dead core was serving ends with an
OpenAI error event within 2 s of the kill when its client had tokens, and is retried on the other replica when it
had none (as for a replica that dies); the replica reports unhealthy, Serve replaces it, and the replacement
serves. Prints a one-line JSON report (`-s` shows it)."""

import concurrent.futures as cf
import json
import os
import signal
import threading
import time

import openai
import pytest

from tests.deployments.serve_harness import APP_NAME, LOAD_KEY, llm_replicas

pytestmark = pytest.mark.slow
CHAT = [{"role": "user", "content": "Write a function that adds two numbers."}]
REQUESTS, CONCURRENCY = 200, 16
DETECTION_BOUND_S = 2.0
REPLACEMENT_BOUND_S = 120


def core_pid(replica_actor) -> int:
    def pid(replica):  # nested: cloudpickle ships it by value (the test module is not importable in workers)
        return replica._replica_impl._user_callable_wrapper.user_callable.server.engine.core_pid

    import ray

    return ray.get(replica_actor.__ray_call__.remote(pid), timeout=10)


def test_a_killed_engine_core_ends_its_streams_within_2s_and_its_replica_is_replaced(serve_app):
    replicas = llm_replicas(APP_NAME)
    assert len(replicas) >= 2
    victim = sorted(replicas)[0]
    pid = core_pid(replicas[victim])
    assert pid is not None and pid != os.getpid()
    client = openai.OpenAI(base_url=serve_app.base_url + "/v1", api_key=LOAD_KEY, max_retries=0, timeout=60)
    outcomes, lock = [], threading.Lock()
    retries_before = replica_failures(serve_app)

    def one(i: int) -> None:
        got, start = 0, time.monotonic()
        try:
            stream = client.chat.completions.create(model=serve_app.base_name, messages=CHAT, max_tokens=48,
                                                    temperature=0.8, seed=i, stream=True)
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    got += 1
            kind = "ok"
        except openai.APIError as e:  # an error event mid-stream, or an HTTP error before it
            kind = "error_event" if got else f"failed_before_first_token:{getattr(e, 'code', '')}"
        except Exception as e:  # noqa: BLE001 - a dropped connection: what must not happen
            kind = f"dropped:{type(e).__name__}"
        with lock:
            outcomes.append({"kind": kind, "tokens": got, "start": start, "end": time.monotonic()})

    with cf.ThreadPoolExecutor(CONCURRENCY) as pool:
        futures = [pool.submit(one, i) for i in range(REQUESTS)]
        while len(outcomes) < REQUESTS // 4 or not ongoing(replicas[victim]):  # under way, the victim busy
            time.sleep(0.01)
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        for f in futures:
            f.result(timeout=300)  # nothing hangs
    errors = [o for o in outcomes if o["kind"] != "ok"]
    counts = {}
    for o in outcomes:
        counts[o["kind"]] = counts.get(o["kind"], 0) + 1
    report = {"requests": len(outcomes), "outcomes": counts,
              "errors_after_kill_s": sorted(round(o["end"] - killed, 2) for o in errors),
              "retried_on_the_other_replica": replica_failures(serve_app) - retries_before}
    report["replacement_s"] = wait_replaced(serve_app, victim, set(replicas))
    print("ENGINE_CORE_KILL_REPORT", json.dumps(report))
    assert len(outcomes) == REQUESTS and set(counts) <= {"ok", "error_event"}, report
    assert errors or report["retried_on_the_other_replica"], report  # the kill hit requests in flight
    assert all(o["end"] - killed < DETECTION_BOUND_S for o in errors), report
    assert "served_by_replacement" in report["replacement_s"], report


def ongoing(replica_actor) -> int:
    import ray

    return ray.get(replica_actor.record_routing_stats.remote(), timeout=10)["num_ongoing"]


def replica_failures(serve_app) -> float:
    """The ingress's count of requests moved off a failed replica (loraserve_replica_failures_total, summed)."""
    import httpx

    text = httpx.get(serve_app.base_url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("loraserve_replica_failures_total"))


def wait_replaced(serve_app, victim: str, before: set[str]) -> dict:
    """Wait until Serve has replaced `victim` and a request is served by the new replica -> seconds it took."""
    client = openai.OpenAI(base_url=serve_app.base_url + "/v1", api_key=LOAD_KEY, max_retries=0, timeout=60)
    start = time.monotonic()
    out = {}
    while time.monotonic() - start < REPLACEMENT_BOUND_S:
        now = set(llm_replicas(APP_NAME))
        new = now - before
        if victim not in now and "gone_s" not in out:
            out["gone_s"] = round(time.monotonic() - start, 1)
        if new:
            raw = client.chat.completions.with_raw_response.create(model=serve_app.base_name, messages=CHAT,
                                                                   max_tokens=4, temperature=0)
            if raw.headers.get("x-loraserve-replica") in new:
                out["served_by_replacement"] = round(time.monotonic() - start, 1)
                return out
        time.sleep(0.5)
    return out
