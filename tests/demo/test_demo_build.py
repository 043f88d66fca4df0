"""Building the demo is reproducible given the seed, and the cache builds once even under concurrency."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from demo import ensure_demo, quick_recipe
from demo.build import MANIFEST, file_hashes

REPO = Path(__file__).resolve().parents[2]


def _cli_builds(root: Path, runs: dict[str, tuple[str, ...]]) -> dict[str, dict]:
    """The real command with the tiny --quick recipe, one process per build (it pins torch threads), all running at
    once (a build is mostly single-threaded parsing): {name: its printed paths}, each built into root/name."""
    procs = {name: subprocess.Popen([sys.executable, "-m", "demo", "build", "--quick", "--out", str(root / name),
                                     *extra], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, extra in runs.items()}
    out = {}
    try:
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=300)
            assert proc.returncode == 0, stderr[-3000:]
            out[name] = json.loads(stdout.strip().splitlines()[-1])   # contract: the last line is the JSON
    finally:
        for proc in procs.values():   # a failed build ends the others
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return out


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, dict]:
    """"a" and "b" with the recipe's seed, "c" with seed 7."""
    return _cli_builds(tmp_path_factory.mktemp("determinism"), {"a": (), "b": (), "c": ("--seed", "7")})


@pytest.fixture(scope="module")
def two_same_seed_builds(builds):
    return builds["a"], builds["b"]


def test_cli_prints_model_and_adapter_dirs(two_same_seed_builds):
    paths, _ = two_same_seed_builds
    assert Path(paths["model"], "model.safetensors").is_file()
    assert set(paths["adapters"]) == {a.name for a in quick_recipe().adapters}
    for d in paths["adapters"].values():
        assert Path(d, "adapter_model.safetensors").is_file()


def test_same_seed_gives_identical_tokenizer_and_weights(two_same_seed_builds):
    a, b = (file_hashes(Path(p["model"]).parent) for p in two_same_seed_builds)
    assert "model/tokenizer.json" in a and "model/model.safetensors" in a
    assert a == b


def test_another_seed_gives_other_weights(builds):
    same, other = builds["a"], builds["c"]
    h_same, h_other = file_hashes(Path(same["model"]).parent), file_hashes(Path(other["model"]).parent)
    assert h_same["model/tokenizer.json"] == h_other["model/tokenizer.json"]   # the corpus does not depend on it
    assert h_same["model/model.safetensors"] != h_other["model/model.safetensors"]


def test_concurrent_ensure_demo_builds_once_and_atomically(tmp_path):
    recipe = quick_recipe(seed=99)
    logs, results, errors = [], [], []

    def call():
        try:
            results.append(ensure_demo(tmp_path, recipe, log=logs.append))
        except Exception as exc:   # surfaced below; a thread cannot fail the test itself
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert len(results) == 3 and all(r == results[0] for r in results)
    assert sum("corpus + tokenizer" in line for line in logs) == 1          # one build, not three
    built = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert len(built) == 1 and (built[0] / MANIFEST).is_file()               # no temp dirs left behind
    mtime = (built[0] / MANIFEST).stat().st_mtime_ns
    assert ensure_demo(tmp_path, recipe, log=logs.append) == results[0]
    assert (built[0] / MANIFEST).stat().st_mtime_ns == mtime                 # found, not rebuilt
