"""A valid PEFT LoRA adapter for a registered base model, made from the base model's spec alone (its module
shapes): `lora-registry init-example DIR --base-model NAME`. Small random factors (seeded), so it loads, serves
and shifts the base model's outputs a little; for trying the registry and the serving path, not for quality."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from registry.base_model import ATTN_MODULES, MLP_MODULES

__all__ = ["write_example_adapter", "DEFAULT_TARGETS"]

DEFAULT_TARGETS = ("q_proj", "v_proj")


def write_example_adapter(out: Path, spec: dict, rank: int = 8, seed: int = 0,
                          targets: tuple[str, ...] = DEFAULT_TARGETS) -> dict[str, int]:
    """Write `adapter_config.json` and `adapter_model.safetensors` into `out` (created; must be empty) for the
    base model `spec` (a BaseModelSpec as JSON) -> file name -> size in bytes."""
    from safetensors.numpy import save_file

    unknown = sorted(set(targets) - set(ATTN_MODULES + MLP_MODULES))
    if unknown:
        raise ValueError(f"unknown target modules {unknown}; choose among {list(ATTN_MODULES + MLP_MODULES)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise ValueError(f"{out} is not empty")
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(spec["num_hidden_layers"]):
        for module in targets:
            shape = spec["modules"][module]
            prefix = f"base_model.model.model.layers.{layer}.{shape['block']}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, shape["in_features"])) * 0.02
                                                  ).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (rng.standard_normal((shape["out_features"], rank)) * 0.02
                                                  ).astype(np.float32)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": spec["name"], "r": rank,
              "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "inference_mode": True, "target_modules": sorted(targets)}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return {p.name: p.stat().st_size for p in sorted(out.iterdir())}
