"""Start-up registration against a real SQLite registry and the (quick) demo build."""

import shutil
from pathlib import Path

import pytest

from deployments.bootstrap import _ensure_demo_adapter, bootstrap, demo_paths, make_registry
from deployments.config import load_config


@pytest.fixture()
def cfg(tmp_path):
    registry = {"registry_db": str(tmp_path / "r.db"), "blob_dir": str(tmp_path / "blobs"),
                "materialize_dir": str(tmp_path / "mat"), "allowed_local_roots": [str(tmp_path / "in")]}
    return load_config({"demo_recipe": "quick", "registry": registry}, env={})


def test_bootstrap_registers_demo_once(cfg):
    out = bootstrap(cfg)
    assert out.base_model_name == "demo"
    reg = make_registry(cfg)
    names = set(demo_paths(cfg)["adapters"])
    listed = {r.name: r for r in reg.list_adapters(tenant=None)}
    assert names <= set(listed) and all(listed[n].base_model == "demo" for n in names)
    revision = reg.revision()
    bootstrap(cfg)  # idempotent: no mutation at all
    assert reg.revision() == revision
    reg.close()


def test_changed_demo_files_get_a_new_active_version(cfg, tmp_path):
    bootstrap(cfg)
    name, src = sorted(demo_paths(cfg)["adapters"].items())[0]
    copy = tmp_path / "in" / "rebuilt"
    shutil.copytree(src, copy)
    (copy / "adapter_config.json").write_text((Path(src) / "adapter_config.json").read_text() + "\n")
    reg = make_registry(cfg)
    before = reg.get(name).active_version
    _ensure_demo_adapter(reg, name, copy, "demo")
    assert reg.get(name).active_version == before + 1
    _ensure_demo_adapter(reg, name, copy, "demo")
    assert reg.get(name).active_version == before + 1
    reg.close()


def test_registry_model_is_checked_at_deploy_and_fetched_by_replicas(cfg, tmp_path):
    from deployments.bootstrap import replica_model_dir
    from registry import BaseModelNotFound, RegistryError

    model = Path(demo_paths(cfg)["model"])
    stored = cfg.model_copy(update={"model": "registry://stored"})
    with pytest.raises(BaseModelNotFound):
        bootstrap(stored)
    reg = make_registry(cfg)
    reg.register_base_model("stored", model)  # config only: no files a replica could fetch
    with pytest.raises(RegistryError, match="--upload"):
        bootstrap(stored)
    reg.register_base_model("stored", model, upload=True)
    out = bootstrap(stored)
    assert out.base_model_name == "stored" and out.model == "registry://stored"
    local = Path(replica_model_dir(out, reg))
    assert local.is_relative_to(tmp_path / "mat")
    assert {p.name: p.read_bytes() for p in model.iterdir() if p.is_file()} == \
        {p.name: p.read_bytes() for p in local.iterdir() if p.name in {q.name for q in model.iterdir()}}
    with pytest.raises(ValueError, match="differs"):
        bootstrap(stored.model_copy(update={"base_model_name": "other"}))
    reg.close()
