"""The private Ray Serve API in deployments/serve_internals.py: fails loudly when Ray changes it."""

import dataclasses
import inspect

import pytest


def test_ray_still_has_the_private_calls_we_use():
    from ray.serve._private.client import ServeControllerClient
    from ray.serve._private.common import RequestRoutingInfo
    from ray.serve._private.controller import ServeController
    from ray.serve.context import _get_global_client

    fields = {f.name for f in dataclasses.fields(RequestRoutingInfo)}
    assert {"replica_id", "multiplexed_model_ids", "routing_stats"} <= fields, fields
    assert list(inspect.signature(ServeControllerClient.record_request_routing_info).parameters) == ["self", "info"]
    assert hasattr(ServeController, "record_request_routing_info")
    assert callable(_get_global_client)


def test_ray_still_starts_serve_replicas_as_warm_starts_expect():
    import importlib
    import os

    from deployments.serve_internals import SERVE_REPLICA_MODULE, ray_worker_script

    assert hasattr(importlib.import_module(SERVE_REPLICA_MODULE), "ReplicaActor")
    script = ray_worker_script()  # beside it, the script Ray runs first for a worker with a runtime env
    assert os.path.isfile(script) and os.path.isfile(os.path.join(os.path.dirname(script), "setup_worker.py"))


def test_publisher_sends_keys_and_stats_for_this_replica(monkeypatch):
    import ray.serve.context as context
    from ray import serve
    from ray.serve._private.common import RequestRoutingInfo

    from deployments.serve_internals import residency_publisher

    sent = []

    class Client:
        def record_request_routing_info(self, info):
            sent.append(info)

    class Ctx:
        replica_id = "replica-1"

    monkeypatch.setattr(context, "_get_global_client", lambda: Client())
    monkeypatch.setattr(serve, "get_replica_context", lambda: Ctx())
    residency_publisher()(["a@1", "b@2"], {"num_running": 3})
    assert len(sent) == 1 and isinstance(sent[0], RequestRoutingInfo)
    assert (sent[0].replica_id, sent[0].multiplexed_model_ids, sent[0].routing_stats) == (
        "replica-1", ["a@1", "b@2"], {"num_running": 3})


def test_no_other_module_uses_ray_private_api():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    private = ("ray.serve._private", "ray._private", "_get_global_client", "_get_internal_replica_context")
    users = sorted(str(p.relative_to(root)) for pkg in ("deployments", "router", "registry", "engine_ext")
                   for p in (root / pkg).rglob("*.py")
                   if p.name != "serve_internals.py" and any(name in p.read_text() for name in private))
    assert users == [], f"Ray private API outside deployments/serve_internals.py: {users}"


pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
