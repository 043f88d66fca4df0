"""What a cluster needs of k8s/ beyond its schemas: every Secret and ConfigMap reference resolves, Redis
requires the Secret's password and the Ray pods use it, the base model comes from the registry (no model
volume), probes hit the ingress's health route, GPUs are requested to match the replicas, the LLM deployment
autoscales within the worker group, and compiled kernels live on the compile-cache volume."""

from __future__ import annotations

import re

import pytest

from tests.k8s.manifest_kit import (HARDWARE_KEYS, REPO, configmap_data, container_env, docs, one, ray_containers,
                                    secret_keys, serve_config)


@pytest.fixture(scope="module")
def containers() -> dict[str, dict]:
    return ray_containers()


def _all_containers() -> list[tuple[dict, dict]]:
    """(container, pod spec) of every workload in k8s/."""
    out = [(c, c["_pod"]) for c in ray_containers().values()]
    for d in docs():
        if d["kind"] == "Deployment":
            pod = d["spec"]["template"]["spec"]
            out += [(c, pod) for c in pod["containers"]]
    return out


def test_every_secret_and_configmap_reference_resolves():
    secret, configmap = one("Secret")["metadata"]["name"], one("ConfigMap")["metadata"]["name"]
    for container, _ in _all_containers():
        for src in container.get("envFrom", []):
            assert src.get("secretRef", {}).get("name", secret) == secret
            assert src.get("configMapRef", {}).get("name", configmap) == configmap
        for var in container.get("env", []):
            ref = var.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["name"] == secret and ref["key"] in secret_keys(), var


def test_redis_requires_the_secret_password_and_ray_pods_use_it(containers):
    (redis,) = one("Deployment", "loraserve-redis")["spec"]["template"]["spec"]["containers"]
    assert redis["args"][:2] == ["--requirepass", "$(REDIS_PASSWORD)"]
    assert {"name": "loraserve-secrets", "key": "REDIS_PASSWORD"} in \
        [v["valueFrom"]["secretKeyRef"] for v in redis["env"] if "valueFrom" in v]
    assert "REDIS_URL" not in configmap_data()
    secrets = {"loraserve-secrets": {k: f"<{k}>" for k in secret_keys()}}
    for name, c in containers.items():
        env = container_env(c, {"loraserve-config": configmap_data()}, secrets)
        assert env["REDIS_URL"] == "redis://:<REDIS_PASSWORD>@loraserve-redis:6379/0", name
        assert env["AWS_ACCESS_KEY_ID"] == "<AWS_ACCESS_KEY_ID>" and "AWS_SECRET_ACCESS_KEY" in env
    assert not [k for k in configmap_data() if k.startswith("AWS_") or "PASSWORD" in k or "TOKEN" in k]


def test_base_model_comes_from_the_registry_not_a_volume(containers):
    _, cfg = serve_config()
    (app,) = cfg["applications"]
    assert app["args"]["model"].startswith("registry://")
    for d in docs():
        assert d["kind"] != "PersistentVolumeClaim" or "model" not in d["metadata"]["name"]
    for name, c in containers.items():
        mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
        assert not any(p.startswith("/models") for p in mounts), name
        # The registry's local cache (base model and adapters fetched from S3) is a volume of the pod.
        cache = configmap_data()["LORASERVE_CACHE"]
        assert cache in mounts, name
        (vol,) = [v for v in c["_pod"]["volumes"] if v["name"] == mounts[cache]]
        assert "emptyDir" in vol


def test_probes_use_the_ingress_health_route(containers):
    source = (REPO / "deployments" / "data_plane" / "openai_routes.py").read_text()
    assert 'r.add_api_route("/health", self.health, methods=["GET"])' in source
    _, cfg = serve_config()
    port = cfg["http_options"]["port"]
    for name, c in containers.items():
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": "/health", "port": port}, (name, probe)


def test_gpu_requests_match_the_replicas_and_autoscaling_fits_the_group(containers):
    gpus = int(configmap_data()["LORASERVE_NUM_GPUS_PER_REPLICA"])
    assert configmap_data()["LORASERVE_DEVICE"] == "cuda" and set(HARDWARE_KEYS) <= set(configmap_data())
    cluster = one("RayService")["spec"]["rayClusterConfig"]
    (group,) = cluster["workerGroupSpecs"]
    worker = containers[group["groupName"]]
    assert worker["resources"]["requests"]["nvidia.com/gpu"] == worker["resources"]["limits"]["nvidia.com/gpu"] \
        == str(gpus)
    assert cluster["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    _, cfg = serve_config()
    (llm,) = [d for d in cfg["applications"][0]["deployments"] if d["name"] == "LLMServer"]
    # the app's own config autoscales (AppConfig.autoscaling), not a Serve override beside it
    scaling = cfg["applications"][0]["args"]["autoscaling"]
    assert "num_replicas" not in llm and "autoscaling_config" not in llm and "ray_actor_options" not in llm
    assert 1 <= scaling["min_replicas"] <= scaling["initial_replicas"] <= scaling["max_replicas"]
    assert scaling["max_replicas"] * gpus <= group["maxReplicas"] and cluster["enableInTreeAutoscaling"]


def test_triton_cache_is_on_the_compile_cache_volume(containers):
    pvc = one("PersistentVolumeClaim", "loraserve-compile-cache")
    for name, c in containers.items():
        env = {v["name"]: v.get("value") for v in c.get("env", [])}
        if name == "head":
            continue
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        (vol,) = [v for v in c["_pod"]["volumes"] if v["name"] == mounts[env["TRITON_CACHE_DIR"]]]
        assert vol["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]


def test_images_are_the_one_the_docs_build(containers):
    page = (REPO / "docs" / "kubernetes.md").read_text()
    builds = re.findall(r"docker build -t (\S+) \.", page)
    assert builds, "docs/kubernetes.md builds the image"
    assert {c["image"] for c in containers.values()} == set(builds)
