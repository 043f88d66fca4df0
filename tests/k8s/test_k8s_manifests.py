"""Every RayService/RayCluster manifest in k8s/ validates against the KubeRay CRDs (closed
to unknown fields) and its serveConfigV2 against Ray Serve's schema; broken copies fail."""

import shutil
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from k8s_manifest_check import DEFAULT_SCHEMA_DIR, load_docs, main, manifest_errors  # noqa: E402

K8S_DIR = Path(__file__).resolve().parents[2] / "k8s"


def test_repo_manifests_are_valid():
    errors, checked = manifest_errors(load_docs(K8S_DIR), DEFAULT_SCHEMA_DIR)
    assert checked >= 1
    assert errors == []
    kinds = {doc.get("kind") for _, doc in load_docs(K8S_DIR) if isinstance(doc, dict)}
    assert {"RayService", "Deployment", "Service", "ConfigMap", "Secret"} <= kinds


def _rayservice(tmp_path):
    copy = tmp_path / "k8s"
    shutil.copytree(K8S_DIR, copy)
    path = copy / "rayservice.yaml"
    return path, yaml.safe_load(path.read_text())


def _break_unknown_field(doc):
    doc["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParms"] = {}  # typo


def _break_type(doc):
    doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "two"


def _break_missing_required(doc):
    del doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["groupName"]


def _break_container_field(doc):
    doc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["imagee"] = "x"


def _break_serve_unknown_key(doc):
    cfg = yaml.safe_load(doc["spec"]["serveConfigV2"])
    cfg["applications"][0]["deployments"][0]["num_replicaz"] = 2
    doc["spec"]["serveConfigV2"] = yaml.safe_dump(cfg)


def _break_serve_type(doc):
    cfg = yaml.safe_load(doc["spec"]["serveConfigV2"])
    cfg["applications"][0]["deployments"][0]["num_replicas"] = "many"
    doc["spec"]["serveConfigV2"] = yaml.safe_dump(cfg)


def _break_serve_missing_import_path(doc):
    cfg = yaml.safe_load(doc["spec"]["serveConfigV2"])
    del cfg["applications"][0]["import_path"]
    doc["spec"]["serveConfigV2"] = yaml.safe_dump(cfg)


def _break_app_args(doc):
    cfg = yaml.safe_load(doc["spec"]["serveConfigV2"])
    cfg["applications"][0]["args"]["num_replicaz"] = 2
    doc["spec"]["serveConfigV2"] = yaml.safe_dump(cfg)


def _break_serve_yaml(doc):
    doc["spec"]["serveConfigV2"] = "applications: [unclosed"


@pytest.mark.parametrize(
    "breaker",
    [
        _break_unknown_field,
        _break_type,
        _break_missing_required,
        _break_container_field,
        _break_serve_unknown_key,
        _break_serve_type,
        _break_serve_missing_import_path,
        _break_app_args,
        _break_serve_yaml,
    ],
)
def test_broken_copy_fails(tmp_path, breaker, capsys):
    path, doc = _rayservice(tmp_path)
    breaker(doc)
    path.write_text(yaml.safe_dump(doc))
    errors, checked = manifest_errors(load_docs(path.parent), DEFAULT_SCHEMA_DIR)
    assert checked >= 1 and errors, breaker.__name__
    assert main(["check", str(path.parent), str(DEFAULT_SCHEMA_DIR)]) == 1


def test_raycluster_kind_is_checked_too(tmp_path):
    _, doc = _rayservice(tmp_path)
    cluster = {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": "c"},
        "spec": doc["spec"]["rayClusterConfig"],
    }
    (tmp_path / "only").mkdir()
    (tmp_path / "only" / "cluster.yaml").write_text(yaml.safe_dump(cluster))
    assert manifest_errors(load_docs(tmp_path / "only"), DEFAULT_SCHEMA_DIR) == ([], 1)
    cluster["spec"]["headGroupSpec"]["bogus"] = 1
    (tmp_path / "only" / "cluster.yaml").write_text(yaml.safe_dump(cluster))
    errors, _ = manifest_errors(load_docs(tmp_path / "only"), DEFAULT_SCHEMA_DIR)
    assert any("bogus" in e for e in errors)


def test_serve_config_example_is_valid_and_checked():
    from k8s_manifest_check import serve_config_errors

    path = Path(__file__).resolve().parents[2] / "deployments" / "serve_config.example.yaml"
    cfg = yaml.safe_load(path.read_text())
    assert serve_config_errors(cfg, path.name) == []
    cfg["applications"][0]["args"]["num_replicas"] = -1
    assert serve_config_errors(cfg, path.name)


def test_grafana_dashboard_uses_exported_series():
    import json

    dash = json.loads((K8S_DIR / "grafana-dashboard.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    for series in ("loraserve_ttft_seconds_bucket", "loraserve_adapter_hits_total", "loraserve_spec_acceptance_rate",
                   "loraserve_batch_size_bucket", "loraserve_queue_seconds_bucket"):
        assert series in exprs
