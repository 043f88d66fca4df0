"""Reading and checking a PEFT LoRA adapter directory against the loaded model."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

import torch
from safetensors import SafetensorError, safe_open

from .constants import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PICKLE_SUFFIXES
from .lora_config import LoraConfigError, match_tensors, parse_tensor_name, plan_adapter
from .model_config import ModelSpec

logger = logging.getLogger(__name__)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what the registry accepts too (F32, F16, BF16)


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


def _read_config(name: str, path: str) -> dict:
    cfg_path = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(cfg_path):
        raise AdapterError(name, f"missing {ADAPTER_CONFIG} in {path}")
    try:
        with open(cfg_path) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise AdapterError(name, f"malformed {ADAPTER_CONFIG}: {e}") from None


def load_lora_adapter(name: str, path: str, spec: ModelSpec, max_rank: int, model_name: str | None = None) -> LoRAWeights:
    """Parse and validate `path`; raise AdapterError naming the problem. Never unpickles anything.

    What the config targets, with which rank and scale, is decided by `lora_config.plan_adapter` (PEFT's rules,
    or a refusal), and the file must hold exactly the factors of those modules (`match_tensors`)."""
    if not os.path.isdir(path):
        raise AdapterError(name, f"adapter directory not found: {path}")
    pickled = sorted(f for f in os.listdir(path) if f.endswith(PICKLE_SUFFIXES))
    if pickled:
        raise AdapterError(name, f"pickled weight files are refused ({', '.join(pickled)}); use safetensors")
    cfg = _read_config(name, path)
    weights_path = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(weights_path):
        raise AdapterError(name, f"missing {ADAPTER_WEIGHTS} in {path}")
    base = cfg.get("base_model_name_or_path") if isinstance(cfg, dict) else None
    if model_name and base and os.path.basename(str(base).rstrip("/")) != os.path.basename(model_name.rstrip("/")):
        logger.warning("adapter %r was trained on %r; serving it on %r (names differ, shapes are checked)", name, base, model_name)
    shapes = spec.module_shapes()
    try:
        plan = plan_adapter(cfg, spec.num_layers)
        with safe_open(weights_path, framework="pt") as f:
            names = list(f.keys())
            if not names:
                raise AdapterError(name, f"{ADAPTER_WEIGHTS} holds no LoRA tensors")
            factors = match_tensors(plan, {t: f.get_slice(t).get_shape() for t in names}, shapes)
            if plan.max_rank > max_rank:
                raise AdapterError(name, f"rank {plan.max_rank} exceeds max_lora_rank={max_rank}")
            tensors = {t: f.get_tensor(t) for t in names}
    except LoraConfigError as e:
        raise AdapterError(name, e.message) from None
    except SafetensorError as e:
        raise AdapterError(name, f"unreadable {ADAPTER_WEIGHTS}: {e}") from None

    out = LoRAWeights(name=name, rank=plan.max_rank)
    for path_key, ab in sorted(factors.items()):
        _, layer, module, _ = parse_tensor_name(ab["A"])
        a, b = tensors[ab["A"]], tensors[ab["B"]]
        if a.dtype not in _DTYPES or b.dtype != a.dtype:
            raise AdapterError(name, f"layers.{layer}.{module} factors are {a.dtype}/{b.dtype}; one of "
                                     f"{[str(d) for d in _DTYPES]} expected")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(name, f"layers.{layer}.{module} contains NaN or Inf values")
        out.scale[(layer, module)] = plan.modules[path_key].scale
        out.a[(layer, module)] = a.t().contiguous()  # [in, r]
        out.b[(layer, module)] = b.t().contiguous()  # [r, out]
    return out
