"""Reading a Hugging Face model directory's safetensors weights (single file or sharded)."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open

from .constants import PICKLE_SUFFIXES
from .model_config import ModelLoadError


def weight_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(model_dir, s))]
        if missing:
            raise ModelLoadError(f"{model_dir}: shards listed in model.safetensors.index.json are missing: {missing}")
        return [os.path.join(model_dir, s) for s in shards]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if files:
        return files
    pickled = [f for f in os.listdir(model_dir) if f.endswith(PICKLE_SUFFIXES)]
    hint = f" (found pickled weights {pickled}, which are refused: convert them to safetensors)" if pickled else ""
    raise ModelLoadError(f"{model_dir}: no *.safetensors weights{hint}")


def iter_tensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    for path in weight_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
