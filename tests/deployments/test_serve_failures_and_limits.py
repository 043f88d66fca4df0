"""Acceptance 1 and 3 of the data plane under the real Serve app (local Ray cluster, 2 CPU LLM replicas, the
official `openai` client over HTTP, bounded loopback load):

- oversized chat bodies (5 MB, 20 MB) get a 4xx in under 1 s each while normal load runs, and no process's
  memory grows; the normal requests' p99 with and without them is reported (bench/RESULTS.md);
- killing one LLM replica under load (42 and 9 concurrent requests): no request that had not received a token
  fails (retried on the other replica), the others end with an OpenAI error event; the test prints how many of
  each, and when the replacement (forked from the node's warm start server) ran and served.

Both print a one-line JSON report (`-s` shows it)."""

import concurrent.futures as cf
import json
import subprocess
import sys
import threading
import time
from typing import NamedTuple

import httpx
import openai
import pytest

from tests.deployments.serve_harness import AFFINITY_ADAPTERS, APP_NAME, KEYS, LOAD_KEY, refused_in_proxy

pytestmark = pytest.mark.slow
ACME, GLOBEX = list(KEYS)[:2]
CHAT = [{"role": "user", "content": "Write a function that adds two numbers."}]


OVERSIZED = """
import json, sys, time, httpx
url, key, model = sys.argv[1:4]
bodies = {n: json.dumps({"model": model, "messages": [{"role": "user", "content": "x" * n}]}).encode()
          for n in (5_000_000, 20_000_000)}
print("ready", flush=True)
out = []
while sys.stdin.readline().strip() == "go":  # one window: a 5 MB body, then a 20 MB one
    for n in (5_000_000, 20_000_000):
        time.sleep(1.0)
        t0 = time.perf_counter()
        r = httpx.post(url + "/v1/chat/completions", content=bodies[n], timeout=60,
                       headers={"Authorization": "Bearer " + key, "Content-Type": "application/json"})
        out.append([n, r.status_code, time.perf_counter() - t0, r.json()["error"]["code"]])
print(json.dumps(out), flush=True)
"""


REPLACEMENT_BOUND_S = 120  # a replacement that has not served by then counts as lost


def replacement_startup(old_names: set[str]):
    """describe()["startup"] of the LLM replica that is not one of `old_names`, or None while there is none."""
    import ray

    names = [n["name"] if isinstance(n, dict) else n for n in ray.util.list_named_actors(all_namespaces=True)]
    new = [n for n in names if n.startswith(f"SERVE_REPLICA::{APP_NAME}#LLMServer#") and n not in old_names]
    if not new:
        return None
    def startup(replica_actor):  # nested: cloudpickle ships it by value
        # Serve's private path from its replica actor to our LLMDeployment (tests only; describe() is public
        # through a handle, which would route the call to any replica)
        deployment = replica_actor._replica_impl._user_callable_wrapper.user_callable
        return getattr(deployment, "startup", None)

    try:
        return ray.get(ray.get_actor(new[0], namespace="serve").__ray_call__.remote(startup), timeout=5)
    except Exception:  # noqa: BLE001 - an actor still starting
        return None


def seconds_after(marks: dict, t0: float) -> dict:
    """A replica's start-up marks: wall-clock times as seconds after `t0`, the engine's seconds rounded, the rest
    as they are."""
    def value(v):
        if isinstance(v, dict):
            return {n: round(x, 2) for n, x in v.items()}
        return round(v - t0, 2) if isinstance(v, float) else v

    return {k: value(v) for k, v in marks.items()}


def client(app, key=ACME):
    return openai.OpenAI(base_url=app.base_url + "/v1", api_key=key, max_retries=0, timeout=120)


def p99(xs):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def normal_load(app, seconds, threads=4):
    """Latencies of back-to-back small chat requests from `threads` clients for `seconds` (a tenant without a
    practical rate limit: on a fast machine they would pass acme's 50/s)."""
    c, stop, out = client(app, LOAD_KEY), time.monotonic() + seconds, []

    def worker():
        lat = []
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            c.chat.completions.create(model=app.base_name, messages=CHAT, max_tokens=8, temperature=0)
            lat.append(time.perf_counter() - t0)
        return lat

    with cf.ThreadPoolExecutor(threads) as pool:
        for f in [pool.submit(worker) for _ in range(threads)]:
            out += f.result()
    return out


def serve_rss():
    """actor name -> RSS bytes of every Serve actor (proxy, controller, ingress, LLM replicas)."""
    import psutil
    import ray

    def getpid(_self):  # nested: cloudpickle ships it by value (the test module is not importable in workers)
        import os

        return os.getpid()

    out = {}
    for info in ray.util.list_named_actors(all_namespaces=True):
        if info["namespace"] != "serve" or not info["name"].startswith("SERVE"):
            continue
        try:
            pid = ray.get(ray.get_actor(info["name"], namespace="serve").__ray_call__.remote(getpid), timeout=10)
            out[info["name"]] = psutil.Process(pid).memory_info().rss
        except Exception:  # noqa: BLE001 - an actor going away meanwhile
            pass
    return out


def test_oversized_bodies_refused_fast_without_slowing_others_or_leaking(serve_app):
    # The oversized bodies go from another process (building and sending 20 MB would otherwise hold this
    # process's GIL while it measures latency), with its bodies built before anything is measured. Windows with
    # and without them alternate, so drift in the (shared, 2-core) machine's load hits both alike.
    sender = subprocess.Popen([sys.executable, "-c", OVERSIZED, serve_app.base_url, ACME, serve_app.base_name],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert sender.stdout.readline().strip() == "ready"
    normal_load(serve_app, 3)  # warm up
    before = serve_rss()
    baseline, loaded = [], []
    for window in range(8):
        if window % 2:
            sender.stdin.write("go\n")
            sender.stdin.flush()
        (loaded if window % 2 else baseline).extend(normal_load(serve_app, 5))
    sender.stdin.write("done\n")
    sender.stdin.flush()
    refusals = [tuple(x) for x in json.loads(sender.communicate(timeout=120)[0].strip().splitlines()[-1])]
    time.sleep(1.0)
    after = serve_rss()
    growth = {k: (after[k] - before[k]) / 2**20 for k in before if k in after}
    assert len(growth) >= 4, (before, after)  # controller, proxy, ingress, LLM replicas
    report = {"baseline_p99_s": round(p99(baseline), 4), "with_oversized_p99_s": round(p99(loaded), 4),
              "baseline_n": len(baseline), "loaded_n": len(loaded),
              "oversized": [{"bytes": s, "status": st, "seconds": round(t, 3), "code": c} for s, st, t, c in refusals],
              "rss_growth_mib": {k.split("::")[-1][:40]: round(v, 1) for k, v in growth.items()}}
    print("BODY_LIMIT_REPORT", json.dumps(report))
    assert len(refusals) == 8 and {st for _, st, _, _ in refusals} == {413}
    assert all(t < 1.0 for _, _, t, _ in refusals), report
    # The p99 ratio is a measurement (BODY_LIMIT_REPORT, bench/RESULTS.md), not asserted: on a shared 2-core CI
    # machine it moves by more than the 20% it is held to (speed is judged by benchmarks, not timed tests).
    assert all(v < 50 for v in growth.values()), report  # 20 MB bodies were never held


class KillLoad(NamedTuple):
    """Requests around the kill: `looping` clients back to back, then bursts of `long_prompts` slow prefills and
    `cold_adapters` requests for adapters no replica holds just before it, and `after_kill` right after it."""

    looping: int
    long_prompts: int
    cold_adapters: int
    after_kill: int

    @property
    def concurrent(self) -> int:
        return self.looping + self.long_prompts + self.cold_adapters + self.after_kill


KILL_LOADS = [KillLoad(10, 8, 8, 16), KillLoad(3, 2, 2, 2)]


def warm_server_answers(replica_name: str) -> bool:
    """Whether the warm start server of the replica's node is up (asked inside the replica)."""
    import ray

    def answers(_replica_actor):  # nested: cloudpickle ships it by value
        from deployments.warm_start import server_answers

        return server_answers()

    return ray.get(ray.get_actor(replica_name, namespace="serve").__ray_call__.remote(answers), timeout=10)


@pytest.mark.parametrize("load", KILL_LOADS, ids=lambda load: f"{load.concurrent}-concurrent")
def test_killing_an_llm_replica_under_load_fails_no_request_before_its_first_token(serve_app, load):
    import ray

    names = [n["name"] if isinstance(n, dict) else n for n in ray.util.list_named_actors(all_namespaces=True)]
    victims = sorted(n for n in names if n.startswith(f"SERVE_REPLICA::{APP_NAME}#LLMServer#"))
    assert len(victims) >= 2
    # The first replica ready on a node starts its warm start server (deployments.warm_start), whose imports
    # take seconds; the replacement is to be forked from it.
    deadline = time.monotonic() + REPLACEMENT_BOUND_S
    while not warm_server_answers(victims[-1]) and time.monotonic() < deadline:
        time.sleep(0.5)
    c = client(serve_app, LOAD_KEY)  # 42 concurrent streams: past acme's 50/s on a fast machine
    stop_at = time.monotonic() + 20
    outcomes = []  # (outcome, tokens received before the end)
    lock = threading.Lock()
    replaced = {"done": False}  # the watcher's findings, below

    def one(messages=CHAT, model=None):
        got = 0
        try:
            stream = c.chat.completions.create(model=model or serve_app.base_name, messages=messages, max_tokens=96,
                                               temperature=0, stream=True)
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    got += 1
            kind = "ok"
        except openai.APIError as e:  # an error event mid-stream, or an HTTP error before it
            kind = ("error_event_after_first_token" if got else f"failed_before_first_token:{getattr(e, 'code', '')}")
        except Exception as e:  # noqa: BLE001 - a dropped connection: what must not happen
            kind = f"{'dropped_after' if got else 'dropped_before'}:{type(e).__name__}"
        with lock:
            outcomes.append((kind, got))

    def worker():  # the load runs its 20 s, and on until the replacement has served a request (or gave up)
        give_up_at = stop_at + REPLACEMENT_BOUND_S
        while time.monotonic() < stop_at or (not replaced["done"] and time.monotonic() < give_up_at):
            one()

    with cf.ThreadPoolExecutor(load.concurrent) as pool:
        futures = [pool.submit(worker) for _ in range(load.looping)]
        time.sleep(5)
        # a burst just before the kill, so some requests are still before their first token when it lands
        long_prompt = [{"role": "user", "content": "def f(x):\n    return x\n" * 30}]  # a slower prefill
        futures += [pool.submit(one, long_prompt) for _ in range(load.long_prompts)]
        # and requests for adapters no replica holds yet: they wait for the load before their first token
        futures += [pool.submit(one, CHAT, name) for name in AFFINITY_ADAPTERS[-load.cold_adapters:]]
        time.sleep(0.02)
        killed_at, killed_wall = time.monotonic(), time.time()

        def watch():  # Serve notices the death (fewer than 2 running), runs a replacement (2 again), which serves
            from ray import serve

            try:
                while time.monotonic() < killed_at + REPLACEMENT_BOUND_S:
                    states = serve.status().applications[APP_NAME].deployments["LLMServer"].replica_states
                    running = states.get("RUNNING", 0)
                    if running < 2 and "noticed_s" not in replaced:
                        replaced["noticed_s"] = round(time.monotonic() - killed_at, 1)
                    if running >= 2 and "noticed_s" in replaced and "running_s" not in replaced:
                        replaced["running_s"] = round(time.monotonic() - killed_at, 1)
                    if "running_s" in replaced:
                        startup = replacement_startup(set(victims))
                        if startup is not None and "first_chunk_sent" in startup:
                            # the replacement's own marks, as seconds after the kill (one clock: this machine's)
                            replaced["startup"] = seconds_after(startup, killed_wall)
                            return
                    time.sleep(0.25)
            finally:
                replaced["done"] = True

        watcher = threading.Thread(target=watch)
        ray.kill(ray.get_actor(victims[0], namespace="serve"), no_restart=True)
        watcher.start()
        # and right after it, before routers can know: some of these are sent to the dead replica
        futures += [pool.submit(one) for _ in range(load.after_kill)]
        for f in futures:
            f.result()
    counts = {}
    for kind, _ in outcomes:
        counts[kind] = counts.get(kind, 0) + 1
    watcher.join()
    replaced.pop("done")
    report = {"concurrent": load.concurrent, "requests": len(outcomes), "outcomes": counts,
              "replacement_after_s": replaced}
    text = httpx.get(serve_app.base_url + "/metrics").text
    report["retries_metric"] = [line for line in text.splitlines() if line.startswith("loraserve_replica_failures_total")]
    print("REPLICA_KILL_REPORT", json.dumps(report))
    assert counts.get("ok", 0) > 0
    assert not any(k.startswith(("failed_before_first_token", "dropped")) for k in counts), report
    # The replacement's speed is a measurement (RESULTS section 8); asserted only that it came up and served
    # within a bound generous enough for a loaded 2-core CI machine, forked from the warm start server.
    assert "startup" in replaced, report
    assert replaced["startup"]["warm_start"] is True, report
    assert replaced["startup"]["engine_core_forked"] is True, report  # its engine core too
    # and froze its start-up heap (AppConfig.gc_freeze): full collections no longer walk the engine's objects
    assert replaced["startup"]["gc_frozen_objects"] > 10_000, report


def test_a_flood_of_malformed_requests_is_benched_and_others_keep_serving(serve_app):
    """Malformed requests at concurrency 32 from one tenant while another tenant's requests run: past 20 refusals
    in a second the flooding tenant is benched (RefusalHold), so its further requests are 429s held before their
    bodies are parsed; the other tenant's requests all succeed. Reports their latency (quiet, and during the
    flood). Once the flood stops and its bench is waited out, the flooding tenant is served again."""
    other = openai.OpenAI(base_url=serve_app.base_url + "/v1", api_key=GLOBEX, max_retries=0, timeout=120)

    def normal(n):
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            other.chat.completions.create(model=serve_app.base_name, messages=CHAT, max_tokens=4, temperature=0)
            out.append(time.perf_counter() - t0)
        return out

    quiet = normal(40)
    bad = json.dumps({"model": serve_app.base_name, "prompt": 5}).encode()
    stop = threading.Event()

    # the flood's clients made before anything is measured: making one (its SSL context) holds this process's GIL
    # for tens of milliseconds, which the other tenant's client here would wait behind
    https = [httpx.Client(timeout=60) for _ in range(32)]

    def flood(http):
        codes = []
        with http:
            while not stop.is_set():
                codes.append(http.post(serve_app.base_url + "/v1/completions", content=bad, headers={
                    "Authorization": f"Bearer {ACME}", "Content-Type": "application/json"}).status_code)
        return codes

    with cf.ThreadPoolExecutor(33) as pool:
        flooding = [pool.submit(flood, http) for http in https]
        time.sleep(1.0)  # the flood under way
        during = pool.submit(normal, 40).result()
        stop.set()
        codes = [c for f in flooding for c in f.result()]
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    print("\nmalformed flood:", json.dumps({"flood": {str(c): codes.count(c) for c in sorted(set(codes))},
                                           "normal_median_s": [round(median(quiet), 3), round(median(during), 3)],
                                           "normal_max_s": [round(max(quiet), 3), round(max(during), 3)]}))
    assert set(codes) <= {400, 429} and codes.count(429) > 0
    # benched after 20 refusals: no more bodies parsed (without the bench the tenant's burst of 100 and then its
    # 50/s would all be parsed and refused)
    assert codes.count(400) < 20 + 32 + 20, codes.count(400)  # (the 20, those in flight, one more second's)
    assert len(during) == 40  # every normal request of the other tenant succeeded
    held = [line for line in httpx.get(serve_app.base_url + "/metrics").text.splitlines()
            if line.startswith("loraserve_rate_limited_held_total")]
    assert held and float(held[0].split()[-1]) > 0, held
    time.sleep(1.5)  # its bench waited out (hold_s 1 after its last request)
    client(serve_app).chat.completions.create(model=serve_app.base_name, messages=CHAT, max_tokens=2, temperature=0)


def test_the_front_door_knows_the_caller_before_the_body_and_benches_only_the_failing_client(serve_app):
    """Through the real app: a body that is not JSON gets 401 without a key and with a wrong one (raw HTTP, as
    curl sends it); one client (127.0.0.1) floods a key with such bodies and is benched (429s), while another
    client on the same key (127.0.0.2, the official `openai` client) is answered throughout: the bench holds
    the (tenant, client host) that keeps failing, not the tenant."""
    url = serve_app.base_url + "/v1/chat/completions"
    broken = b'{"model": "' + serve_app.base_name.encode() + b'", "messages": ['
    json_header = {"Content-Type": "application/json"}
    for headers in ({}, {"Authorization": "Bearer sk-wrong-key-0000"}):
        r = httpx.post(url, content=broken, headers={**headers, **json_header}, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text

    elsewhere = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=120)
    good = openai.OpenAI(base_url=serve_app.base_url + "/v1", api_key=ACME, max_retries=0, http_client=elsewhere)
    stop = threading.Event()
    https = [httpx.Client(timeout=60) for _ in range(16)]

    def flood(http):
        codes = []
        with http:
            while not stop.is_set():
                codes.append(http.post(url, content=broken, headers={"Authorization": f"Bearer {ACME}",
                                                                     **json_header}).status_code)
        return codes

    with cf.ThreadPoolExecutor(16) as pool:
        flooding = [pool.submit(flood, http) for http in https]
        time.sleep(1.5)  # benched by now
        answered = []
        for _ in range(10):
            r = good.chat.completions.create(model=serve_app.base_name, messages=CHAT, max_tokens=2, temperature=0)
            answered.append(r.choices[0].finish_reason)
        stop.set()
        codes = [c for f in flooding for c in f.result()]
    print("\nfront door:", json.dumps({"flood": {str(c): codes.count(c) for c in sorted(set(codes))},
                                      "other_client_answered": len(answered)}))
    assert set(codes) <= {400, 429} and codes.count(429) > 0 and codes.count(400) < 20 + 16 + 20
    assert len(answered) == 10


def test_a_prompt_past_the_replicas_bound_is_refused_in_serves_proxy(serve_app):
    """The ingress has asked a replica for its PromptBound (through the deployment handle) and published it; Serve's
    proxy (its callback named as `serve run deployments.app` names it) refuses a 1.9 MB prompt without sending its
    body on, the ingress answering after it knows the caller. (That no replica saw it is pinned in-process,
    test_ingress_api and test_proxy_guard; how fast, bench/front_door.py.)"""
    assert refused_in_proxy(serve_app.base_url, GLOBEX, serve_app.base_name, 1_900_000) > 0
    body = json.dumps({"model": serve_app.base_name, "messages": [{"role": "user", "content": "x" * 1_900_000}]})
    for key in (None, "sk-not-a-key"):  # the caller is known first
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        r = httpx.post(serve_app.base_url + "/v1/chat/completions", content=body.encode(), timeout=60, headers=headers)
        assert r.status_code == 401
