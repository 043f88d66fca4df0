"""The SmolLM2 adapters committed with the repo (demo/smollm2/adapters/), and their manifest.

manifest.json records the recipe they were trained by, the libraries and the base weights (sha256) they were
trained on, their training losses and the sha256 of every file; `python -m demo adapters --out DIR --check`
retrains them and compares.
"""
from __future__ import annotations

import json
from pathlib import Path

ADAPTERS_DIR = Path(__file__).resolve().parent / "adapters"
MANIFEST = ADAPTERS_DIR / "manifest.json"


def manifest() -> dict:
    return json.loads(MANIFEST.read_text())


def file_hashes(root: Path) -> dict[str, str]:
    """sha256 of every adapter file under `root`, keyed by `<name>/<file>`."""
    from ..build import sha256_file

    return {p.relative_to(root).as_posix(): sha256_file(p) for p in sorted(root.glob("*/*")) if p.is_file()}


def verified_dirs(root: Path = ADAPTERS_DIR) -> dict[str, str]:
    """{name: dir} of the adapters in `root`, each file checked against the manifest (DemoBuildError if not)."""
    from ..cache import DemoBuildError

    expected, actual = manifest()["sha256"], file_hashes(root)
    if actual != expected:
        wrong = sorted(set(expected.items()) ^ set(actual.items()))
        raise DemoBuildError(f"adapter files in {root} do not match {MANIFEST.name}: {wrong[0][0]} differs "
                             f"(restore them with git, or rebuild with `python -m demo adapters`)")
    return {name: str(root / name) for name in sorted({rel.split("/")[0] for rel in expected})}


def write_manifest(out: Path, model_dir: str, results: dict, recipe=None) -> None:
    """manifest.json for freshly trained adapters in `out` (copy both into ADAPTERS_DIR to commit them)."""
    import importlib.metadata
    import sys

    from ..build import sha256_file
    from .model import MODEL_NAME
    from .recipe import DEFAULT_ADAPTERS, recipe_to_dict

    env = {"python": "%d.%d.%d" % sys.version_info[:3],
           **{pkg: importlib.metadata.version(pkg) for pkg in ("torch", "transformers", "peft")}}
    doc = {"base": {"model": MODEL_NAME, "weights_sha256": sha256_file(Path(model_dir) / "model.safetensors")},
           "recipe": recipe_to_dict(recipe or DEFAULT_ADAPTERS), "trained_with": env, "training": results,
           "sha256": file_hashes(out)}
    (out / "manifest.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
