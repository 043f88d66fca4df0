"""Build-on-first-use cache: one directory per recipe key, built once even with many concurrent callers.

The build runs in a child process: it pins torch to `recipe.threads` threads and allocates a few hundred MB,
neither of which should leak into the caller (a test session, a Serve replica).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from filelock import FileLock

from .build import MANIFEST, demo_paths, file_hashes
from .recipe import DEFAULT_RECIPE, Recipe, recipe_key, recipe_to_dict

ENV_CACHE = "LORASERVE_CACHE"
_PACKAGE_ROOT = Path(__file__).resolve().parents[1]   # the directory holding demo/


class DemoBuildError(RuntimeError):
    """The demo build failed or the cached files do not match their manifest."""


def default_cache_dir() -> Path:
    return Path(os.environ.get(ENV_CACHE) or Path.home() / ".cache" / "loraserve")


def verify_demo(root: Path) -> dict:
    """Re-hash the files against manifest.json; raise DemoBuildError naming the first mismatch."""
    manifest = json.loads((root / MANIFEST).read_text())
    actual = file_hashes(root)
    for rel, digest in manifest["sha256"].items():
        if actual.get(rel) != digest:
            raise DemoBuildError(f"demo file {root / rel} does not match its manifest; delete {root} to rebuild")
    return manifest


def ensure_demo(cache_dir: str | Path | None = None, recipe: Recipe = DEFAULT_RECIPE, log=None) -> dict:
    """Return {"model": dir, "adapters": {name: dir}}, building into the cache first if needed (no network).

    Concurrent callers (parallel tests, several replicas) serialise on a file lock; the build goes to a temp
    directory that is renamed into place only when complete, so a reader never sees half a model.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    final = cache / f"demo-{recipe_key(recipe)}"
    if not (final / MANIFEST).exists():
        with FileLock(str(final) + ".lock"):
            if not (final / MANIFEST).exists():
                _build_atomically(final, recipe, log or (lambda line: print(line, file=sys.stderr)))
    verify_demo(final)
    return demo_paths(final, recipe)


def _build_atomically(final: Path, recipe: Recipe, log) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        recipe_file = tmp / "recipe.json"
        recipe_file.write_text(json.dumps(recipe_to_dict(recipe)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_PACKAGE_ROOT),
                                                                         os.environ.get("PYTHONPATH")]))}
        cmd = [sys.executable, "-m", "demo", "build", "--out", str(tmp / "build"),
               "--recipe-json", str(recipe_file)]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        tail: list[str] = []
        for line in proc.stdout:
            log(line.rstrip())
            tail = (tail + [line])[-30:]
        if proc.wait() != 0:
            raise DemoBuildError(f"demo build failed (exit {proc.returncode}):\n{''.join(tail)}")
        if final.exists():   # a stale, incomplete directory from a crashed older layout
            shutil.rmtree(final)
        os.rename(tmp / "build", final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
