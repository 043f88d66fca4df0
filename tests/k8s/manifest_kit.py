"""Reading k8s/ as the cluster would: the RayService's serveConfigV2 and Ray containers, the ConfigMap and
the Secret's keys, and a container's environment as the kubelet builds it (envFrom first, then `env` in
order, each `$(VAR)` expanded from what is already defined)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping

import yaml

__all__ = ["K8S_DIR", "REPO", "docs", "one", "serve_config", "ray_containers", "configmap_data", "secret_keys",
           "container_env", "HARDWARE_KEYS"]

REPO = Path(__file__).resolve().parents[2]
K8S_DIR = REPO / "k8s"
# config.yaml's hardware profile: the keys a deployment on other hardware swaps (and nothing else).
HARDWARE_KEYS = ("LORASERVE_DEVICE", "LORASERVE_DTYPE", "LORASERVE_NUM_GPUS_PER_REPLICA",
                 "LORASERVE_NUM_CPUS_PER_REPLICA")
_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def docs() -> list[dict]:
    out = []
    for path in sorted(K8S_DIR.glob("*.yaml")):
        out += [d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict)]
    return out


def one(kind: str, name: str | None = None) -> dict:
    (doc,) = [d for d in docs() if d.get("kind") == kind and (name is None or d["metadata"]["name"] == name)]
    return doc


def serve_config() -> tuple[str, dict]:
    """(serveConfigV2 exactly as written, parsed)."""
    raw = one("RayService")["spec"]["serveConfigV2"]
    return raw, yaml.safe_load(raw)


def ray_containers() -> dict[str, dict]:
    """'head' and each worker group's name -> its (single) Ray container, with the pod spec under '_pod'."""
    cluster = one("RayService")["spec"]["rayClusterConfig"]
    groups = {"head": cluster["headGroupSpec"]} | {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    out = {}
    for name, group in groups.items():
        pod = group["template"]["spec"]
        (container,) = pod["containers"]
        out[name] = dict(container, _pod=pod)
    return out


def configmap_data() -> dict[str, str]:
    return dict(one("ConfigMap")["data"])


def secret_keys() -> set[str]:
    return set(one("Secret")["stringData"])


def _expand(value: str, env: Mapping[str, str]) -> str:
    return _REF.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), value)


def container_env(container: dict, configmaps: Mapping[str, Mapping[str, str]],
                  secrets: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
    """The container's environment from these ConfigMaps and Secrets (name -> data), as the kubelet makes it."""
    env: dict[str, str] = {}
    for src in container.get("envFrom", []):
        if "configMapRef" in src:
            env.update(configmaps[src["configMapRef"]["name"]])
        else:
            env.update(secrets[src["secretRef"]["name"]])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = _expand(var["value"], env)
            continue
        ref: dict[str, Any] = var["valueFrom"]
        if "secretKeyRef" in ref:
            env[var["name"]] = secrets[ref["secretKeyRef"]["name"]][ref["secretKeyRef"]["key"]]
        else:
            env[var["name"]] = configmaps[ref["configMapKeyRef"]["name"]][ref["configMapKeyRef"]["key"]]
    return env
