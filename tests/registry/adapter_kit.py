"""Helpers shared by the registry tests: constants, hashing, building PEFT adapters, uploading to S3."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

__all__ = ["BASE", "BACKENDS", "INCOMING_BUCKET", "TEST_LIMITS", "sha_map", "build_adapter", "stage_copy",
           "upload_dir"]

BASE = "tiny-llama"
BACKENDS = ["sqlite+local", "redis+s3"]
INCOMING_BUCKET = "incoming"
TEST_LIMITS = dict(max_lora_rank=8, max_file_bytes=256 * 1024, max_total_bytes=512 * 1024, max_files=4)


def sha_map(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


def stage_copy(template: Path, incoming_root: Path, name: str, mutate=None) -> Path:
    """A fresh copy of a template adapter under the allowed root, optionally mutated in place."""
    import shutil

    dst = incoming_root / f"{name}-{uuid.uuid4().hex[:8]}"
    shutil.copytree(template, dst)
    if mutate:
        mutate(dst)
    return dst


def build_adapter(base_dir: Path, out: Path, seed: int, r: int = 4, lora_kwargs: dict | None = None,
                  std: float = 0.02) -> None:
    """A PEFT adapter on the tiny base: LoraConfig(**lora_kwargs) (default: rank r on q/v/down_proj),
    lora_B drawn with `std` (PEFT initialises it to zero, which would hide factor mix-ups)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM.from_pretrained(base_dir)
    kwargs = lora_kwargs or dict(r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj", "down_proj"])
    peft_model = get_peft_model(model, LoraConfig(**kwargs))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=std)
    peft_model.save_pretrained(out)
    cfg = json.loads((out / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = BASE
    (out / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    (out / "README.md").unlink(missing_ok=True)


def upload_dir(endpoint: str, directory: Path, bucket: str = INCOMING_BUCKET, prefix: str = "uploads") -> str:
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint)
    key = f"{prefix}/{directory.name}-{uuid.uuid4().hex[:6]}"
    for p in directory.iterdir():
        s3.upload_file(str(p), bucket, f"{key}/{p.name}")
    return f"s3://{bucket}/{key}"


# A standalone control plane: the registry's app mounted at /admin of a server root, as `serve run` mounts it.
CONTROL_PLANE = """
import sys, uvicorn
from fastapi import FastAPI
from registry.api import create_app
root = FastAPI()
root.mount("/admin", create_app())
uvicorn.run(root, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def start_control_plane(port: int, cwd: Path, env: dict[str, str], timeout_s: float = 60) -> subprocess.Popen:
    """Start CONTROL_PLANE on `port` in its own process (settings from `env`) and wait until it answers."""
    import httpx

    proc = subprocess.Popen([sys.executable, "-c", CONTROL_PLANE, str(port)], cwd=cwd, env=env)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/admin/healthz", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("control plane did not start")
        time.sleep(0.1)
