"""Reading and checking a PEFT LoRA adapter directory against the loaded model."""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass, field

import torch
from safetensors import SafetensorError, safe_open

from .constants import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LORA_MODULES, MODULE_PARENT, PICKLE_SUFFIXES
from .model_config import ModelSpec

logger = logging.getLogger(__name__)

# base_model.model.model.layers.3.self_attn.q_proj.lora_A[.adapter].weight
_TENSOR_RE = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.lora_(A|B)(?:\.[\w-]+)?\.weight$"
)


class AdapterError(ValueError):
    """An adapter the engine refuses; the message names the adapter and what is wrong."""

    def __init__(self, adapter: str, problem: str):
        super().__init__(f"adapter {adapter!r}: {problem}")
        self.adapter = adapter
        self.problem = problem


@dataclass
class LoRAWeights:
    """One adapter, parsed: per (layer, module) the A [in, r] and B [r, out] matrices and the scale."""

    name: str
    rank: int  # the largest rank over its modules
    a: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    b: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    scale: dict[tuple[int, str], float] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.a, self.b) for t in d.values())


def _pattern_value(patterns: dict, module_key: str, default):
    # PEFT's rule (peft.utils.other.get_pattern_key): the first key that matches the end of the module name.
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module_key):
            return value
    return default


def _read_config(name: str, path: str) -> dict:
    cfg_path = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(cfg_path):
        raise AdapterError(name, f"missing {ADAPTER_CONFIG} in {path}")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(name, f"malformed {ADAPTER_CONFIG}: {e}") from None
    if not isinstance(cfg, dict):
        raise AdapterError(name, f"{ADAPTER_CONFIG} must hold a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(name, f"peft_type {cfg.get('peft_type')!r} is not supported (only LORA)")
    for flag in ("use_dora",):
        if cfg.get(flag):
            raise AdapterError(name, f"{flag}=true is not supported")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(name, f"bias={cfg['bias']!r} is not supported (only 'none')")
    if cfg.get("modules_to_save"):
        raise AdapterError(name, f"modules_to_save {cfg['modules_to_save']} is not supported")
    for key in ("r", "lora_alpha"):
        if not isinstance(cfg.get(key, 8), (int, float)) or isinstance(cfg.get(key), bool):
            raise AdapterError(name, f"{key} must be a number, got {cfg.get(key)!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(cfg.get(key) or {}, dict):
            raise AdapterError(name, f"{key} must be an object")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted({t.split(".")[-1] for t in targets} - set(LORA_MODULES))
        if unknown:
            raise AdapterError(name, f"target_modules {unknown} are not supported (supported: {list(LORA_MODULES)})")
    elif targets is not None and not isinstance(targets, str):
        raise AdapterError(name, "target_modules must be a list or a regex string")
    return cfg


def load_lora_adapter(name: str, path: str, spec: ModelSpec, max_rank: int, model_name: str | None = None) -> LoRAWeights:
    """Parse and validate `path`; raise AdapterError naming the problem. Never unpickles anything."""
    if not os.path.isdir(path):
        raise AdapterError(name, f"adapter directory not found: {path}")
    pickled = sorted(f for f in os.listdir(path) if f.endswith(PICKLE_SUFFIXES))
    if pickled:
        raise AdapterError(name, f"pickled weight files are refused ({', '.join(pickled)}); use safetensors")
    cfg = _read_config(name, path)
    weights_path = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(weights_path):
        raise AdapterError(name, f"missing {ADAPTER_WEIGHTS} in {path}")
    base = cfg.get("base_model_name_or_path")
    if model_name and base and os.path.basename(str(base).rstrip("/")) != os.path.basename(model_name.rstrip("/")):
        logger.warning("adapter %r was trained on %r; serving it on %r (names differ, shapes are checked)", name, base, model_name)

    shapes = spec.module_shapes()
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(weights_path, framework="pt") as f:
            for tname in f.keys():
                m = _TENSOR_RE.match(tname)
                if not m or m.group(3) not in shapes or MODULE_PARENT[m.group(3)] != m.group(2):
                    raise AdapterError(name, f"tensor {tname!r} does not fit a {spec.architecture} LoRA target")
                layer = int(m.group(1))
                if layer >= spec.num_layers:
                    raise AdapterError(name, f"tensor {tname!r} names layer {layer}; the model has {spec.num_layers}")
                pairs.setdefault((layer, m.group(3)), {})[m.group(4)] = f.get_tensor(tname)
    except SafetensorError as e:
        raise AdapterError(name, f"unreadable {ADAPTER_WEIGHTS}: {e}") from None
    if not pairs:
        raise AdapterError(name, f"{ADAPTER_WEIGHTS} holds no LoRA tensors")

    out = LoRAWeights(name=name, rank=0)
    r_default, alpha_default = cfg.get("r", 8), cfg.get("lora_alpha", 8)
    for (layer, module), ab in sorted(pairs.items()):
        where = f"layers.{layer}.{module}"
        if set(ab) != {"A", "B"}:
            raise AdapterError(name, f"{where} has lora_{next(iter(ab))} but not its partner")
        a, b = ab["A"], ab["B"]
        fan_in, fan_out = shapes[module]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != fan_in or tuple(b.shape) != (fan_out, r):
            raise AdapterError(
                name, f"{where} shapes A{tuple(a.shape)} B{tuple(b.shape)} do not fit the model "
                f"(expected A[r, {fan_in}] and B[{fan_out}, r])"
            )
        if r > max_rank:
            raise AdapterError(name, f"rank {r} at {where} exceeds max_lora_rank={max_rank}")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(name, f"{where} contains NaN or Inf values")
        key = f"model.layers.{layer}.{MODULE_PARENT[module]}.{module}"
        expected_r = _pattern_value(cfg.get("rank_pattern") or {}, key, r_default)
        if expected_r != r:
            raise AdapterError(name, f"{where} has rank {r} but the config says {expected_r}")
        alpha = _pattern_value(cfg.get("alpha_pattern") or {}, key, alpha_default)
        out.scale[(layer, module)] = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        out.a[(layer, module)] = a.t().contiguous()  # [in, r]
        out.b[(layer, module)] = b.t().contiguous()  # [r, out]
        out.rank = max(out.rank, r)
    return out
