"""The tensor-parallel example (k8s/tensor-parallel/worker-group-tp2.yaml) applied to k8s/rayservice.yaml gives a
RayService the KubeRay CRDs and Ray Serve's schema accept, whose LLM replica's placement group (2 bundles, one node)
fits one pod of its worker group."""

import copy
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).parent))
from k8s_manifest_check import DEFAULT_SCHEMA_DIR, load_docs, manifest_errors  # noqa: E402
from manifest_kit import K8S_DIR, configmap_data, one  # noqa: E402

OVERLAY = K8S_DIR / "tensor-parallel" / "worker-group-tp2.yaml"


def applied() -> dict:
    overlay = yaml.safe_load(OVERLAY.read_text())
    doc = copy.deepcopy(one("RayService"))
    serve = yaml.safe_load(doc["spec"]["serveConfigV2"])
    args = serve["applications"][0]["args"]
    args.update(overlay["appArgs"])
    doc["spec"]["serveConfigV2"] = yaml.safe_dump(serve)
    groups = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    (i,) = [i for i, g in enumerate(groups) if g["groupName"] == "gpu-workers"]
    group = copy.deepcopy(groups[i])
    fields = dict(overlay["workerGroup"])
    group["template"]["spec"]["containers"][0]["resources"] = fields.pop("resources")
    group.update(fields)
    groups[i] = group
    return doc


def test_the_applied_overlay_is_a_valid_rayservice(tmp_path):
    (tmp_path / "rayservice.yaml").write_text(yaml.safe_dump(applied()))
    assert manifest_errors(load_docs(tmp_path), DEFAULT_SCHEMA_DIR) == ([], 1)


def test_a_replicas_placement_group_fits_one_pod():
    from deployments.config import AppConfig
    from deployments.replica.resources import llm_replica_resources

    doc = applied()
    args = yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"][0]["args"]
    device = configmap_data()["LORASERVE_DEVICE"]
    cfg = AppConfig.model_validate({k: v for k, v in args.items() if k != "model"} | {"engine": {
        **args["engine"], "device": device}})
    assert cfg.engine["tensor_parallel_size"] == 2
    res = llm_replica_resources(cfg)
    assert res["placement_group_strategy"] == "STRICT_PACK" and len(res["placement_group_bundles"]) == 2
    (pod,) = [g for g in doc["spec"]["rayClusterConfig"]["workerGroupSpecs"] if g["groupName"] == "gpu-workers-tp2"]
    requests = pod["template"]["spec"]["containers"][0]["resources"]["requests"]
    bundles = res["placement_group_bundles"]
    assert sum(b.get("GPU", 0) for b in bundles) == int(requests["nvidia.com/gpu"]) == 2
    assert bundles[0]["GPU"] == 2  # the replica's own bundle: its ranks inherit its visible GPUs
    assert sum(b["CPU"] for b in bundles) <= float(requests["cpu"])
    assert res["ray_actor_options"]["num_gpus"] == 2
