"""Start-up registration: the base model, and with the embedded demo its adapters; and where each
replica finds the base model's directory.

`model` is one of: unset (the embedded demo `demo_recipe`, made ready on each node), a local Hugging Face directory,
or `registry://NAME`: a base model whose files the registry stores (`lora-registry base-model NAME DIR
--upload`), fetched by each replica from the blob store (S3 on a cluster), so no pod needs a model volume.

Idempotent, so every `serve run` (or each of several builders) may call it: what is
already registered and active is left alone, and nothing is audited twice.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any, Optional

from deployments.config import AppConfig

__all__ = ["make_registry", "bootstrap", "demo_paths", "sha256_of_dir", "replica_model_dir", "stored_base_name",
           "DEMO_BASE_NAME", "SMOLLM2_BASE_NAME", "REGISTRY_MODEL_SCHEME"]

logger = logging.getLogger(__name__)

DEMO_BASE_NAME = "demo"          # the toy demo's name in the registry
SMOLLM2_BASE_NAME = "smollm2"    # the default demo's
REGISTRY_MODEL_SCHEME = "registry://"


def make_registry(cfg: AppConfig, extra_local_roots: Optional[list[Path]] = None):
    from registry import Registry, RegistrySettings

    fields: dict[str, Any] = dict(cfg.registry)
    if extra_local_roots:
        roots = list(RegistrySettings(**fields).allowed_local_roots)
        fields["allowed_local_roots"] = roots + [Path(r) for r in extra_local_roots]
    return Registry.from_settings(RegistrySettings(**fields))


def demo_paths(cfg: AppConfig) -> dict:
    """{"model": dir, "adapters": {name: dir}} of the embedded demo, made ready on first use."""
    from demo import DEFAULT_RECIPE, ensure_demo, ensure_smollm2, quick_recipe

    if cfg.demo_recipe == "smollm2":
        return ensure_smollm2()
    return ensure_demo(recipe=quick_recipe() if cfg.demo_recipe == "quick" else DEFAULT_RECIPE)


def _demo_names(cfg: AppConfig) -> tuple[str, str]:
    """(the demo base's registry name, the name its adapters' configs cite)."""
    if cfg.demo_recipe == "smollm2":
        from demo.smollm2.model import MODEL_NAME

        return SMOLLM2_BASE_NAME, MODEL_NAME
    from demo.recipe import BASE_MODEL_NAME

    return DEMO_BASE_NAME, BASE_MODEL_NAME


def stored_base_name(cfg: AppConfig) -> Optional[str]:
    """NAME when `model` is `registry://NAME`, else None."""
    if cfg.model and cfg.model.startswith(REGISTRY_MODEL_SCHEME):
        return cfg.model[len(REGISTRY_MODEL_SCHEME):]
    return None


def replica_model_dir(cfg: AppConfig, reg) -> str:
    """The local directory this replica loads the base model from (on the replica's own node)."""
    if cfg.model is None:
        return demo_paths(cfg)["model"]
    stored = stored_base_name(cfg)
    if stored is not None:
        return str(reg.materialize_base(stored))
    return cfg.model


def sha256_of_dir(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


def _ensure_base(reg, base: str, model_dir: str, aliases: list[str]) -> None:
    """Register the base model, again when its directory changed (a rebuilt demo)."""
    from registry import BaseModelNotFound

    try:
        if str(Path(model_dir).resolve()) in reg.get_base_model(base).aliases:
            return
    except BaseModelNotFound:
        pass
    reg.register_base_model(base, model_dir, actor="bootstrap", aliases=aliases)


def _ensure_demo_adapter(reg, name: str, adapter_dir: Path, base: str) -> None:
    """Register and activate a demo adapter unless its active version has these exact files
    (a rebuilt demo gets a new version, so old weights are never served on a new base)."""
    from registry import AdapterNotFound

    digests = sha256_of_dir(adapter_dir)
    try:
        state = reg.get(name)
        active = state.versions.get(state.active_version) if state.active_version is not None else None
        if active is not None and {f: e.sha256 for f, e in active.files.items()} == digests:
            return
    except AdapterNotFound:
        pass
    reg.register(name, str(adapter_dir), digests, base, visibility="public", actor="bootstrap",
                 description="embedded demo adapter", activate=True)
    logger.info("registered demo adapter %s", name)


def _check_stored_base(cfg: AppConfig, name: str) -> AppConfig:
    """A `registry://NAME` model must be registered with its files; said here, at deploy time, rather than
    by every replica failing to start."""
    from registry import RegistryError

    if cfg.base_model_name not in (None, name):
        raise ValueError(f"base_model_name {cfg.base_model_name!r} differs from the stored model {name!r}")
    reg = make_registry(cfg)
    try:
        if not reg.get_base_model(name).files:
            raise RegistryError(f"base model {name!r} is registered without its files: upload them with "
                                f"`lora-registry base-model {name} DIR --upload`", code="no_base_files")
    finally:
        reg.close()
    return cfg.model_copy(update={"base_model_name": name})


def bootstrap(cfg: AppConfig) -> AppConfig:
    """Register base (+ demo adapters); return the config with `model`/`base_model_name` filled in."""
    demo_adapters: dict[str, str] = {}
    aliases: list[str] = []
    if cfg.model is None:
        default_name, cited = _demo_names(cfg)
        aliases = [cited]  # the name the demo adapters' configs cite
        paths = demo_paths(cfg)
        model_dir, base = paths["model"], cfg.base_model_name or default_name
        demo_adapters = paths["adapters"] if cfg.register_demo_adapters else {}
    elif (stored := stored_base_name(cfg)) is not None:
        return _check_stored_base(cfg, stored)
    else:
        model_dir, base = cfg.model, cfg.base_model_name or Path(cfg.model).name
    roots = sorted({Path(d).resolve().parent for d in demo_adapters.values()})
    reg = make_registry(cfg, extra_local_roots=roots)
    try:
        _ensure_base(reg, base, model_dir, aliases)
        for name, adapter_dir in sorted(demo_adapters.items()):
            _ensure_demo_adapter(reg, name, Path(adapter_dir).resolve(), base)
    finally:
        reg.close()
    # The model dir is left unset for the demo: each replica resolves it through ensure_demo()
    # on its own node (a path from the builder's node may not exist there).
    return cfg.model_copy(update={"base_model_name": base})
