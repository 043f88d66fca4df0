"""Build-on-first-use cache: one directory per recipe key, built once even with many concurrent callers.

The build runs in a child process: it pins torch's thread count and allocates hundreds of MB (the toy's
training, the default model's conversion), neither of which should leak into the caller (a test session, a
Serve replica).
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
    """The toy model: {"model": dir, "adapters": {name: dir}}, trained into the cache first if needed (no network).

    Concurrent callers (parallel tests, several replicas) serialise on a file lock; the build goes to a temp
    directory that is renamed into place only when complete, so a reader never sees half a model.
    """
    final = _cache(cache_dir) / f"demo-{recipe_key(recipe)}"

    def build_args(tmp: Path) -> list[str]:
        (tmp / "recipe.json").write_text(json.dumps(recipe_to_dict(recipe)))
        return ["build", "--recipe-json", str(tmp / "recipe.json")]

    _ensure_built(final, build_args, log)
    verify_demo(final)
    return demo_paths(final, recipe)


def ensure_smollm2(cache_dir: str | Path | None = None, log=None) -> dict:
    """The default model: {"model": dir, "adapters": {name: dir}}; fetched and converted into the cache first if
    needed (`python -m demo fetch`), then checked: the converted files against their manifest, the weights against
    those the committed adapters were trained on, the adapters against theirs."""
    from .smollm2 import committed
    from .smollm2.model import cache_key

    final = _cache(cache_dir) / f"smollm2-{cache_key()}"
    _ensure_built(final, lambda tmp: ["fetch"], log)
    manifest = verify_demo(final)
    trained_on = committed.manifest()["base"]["weights_sha256"]
    if manifest["sha256"]["model/model.safetensors"] != trained_on:
        raise DemoBuildError(f"the converted weights in {final} are not those the committed adapters were trained on "
                             f"(sha256 {trained_on}): this transformers or gguf version converts the GGUF differently")
    return {"model": str(final / "model"), "adapters": committed.verified_dirs()}


def _cache(cache_dir: str | Path | None) -> Path:
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    return cache


def _ensure_built(final: Path, build_args, log) -> None:
    """Unless `final` holds a manifest: `python -m demo BUILD_ARGS --out TMP` under a file lock, TMP renamed to
    `final` when complete. `build_args(tmp)` may write files into the temp directory."""
    if (final / MANIFEST).exists():
        return
    with FileLock(str(final) + ".lock"):
        if (final / MANIFEST).exists():
            return
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
        try:
            _run_build([*build_args(tmp), "--out", str(tmp / "build")],
                       log or (lambda line: print(line, file=sys.stderr)))
            if final.exists():   # a stale, incomplete directory from a crashed older layout
                shutil.rmtree(final)
            os.rename(tmp / "build", final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _run_build(args: list[str], log) -> None:
    """`python -m demo ARGS` in a child process, its output passed to `log`; DemoBuildError on failure."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_PACKAGE_ROOT),
                                                                     os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "demo", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    for line in proc.stdout:
        log(line.rstrip())
        tail = (tail + [line])[-30:]
    if proc.wait() != 0:
        raise DemoBuildError(f"demo build failed (exit {proc.returncode}):\n{''.join(tail)}")
