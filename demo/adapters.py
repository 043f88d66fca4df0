"""LoRA adapters on the demo base model, trained with peft and saved in PEFT format (safetensors)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model

from .recipe import BASE_MODEL_NAME, AdapterRecipe
from .train import train_lm


def lora_config(adapter: AdapterRecipe) -> LoraConfig:
    return LoraConfig(
        r=adapter.rank, lora_alpha=adapter.alpha, target_modules=list(adapter.target_modules),
        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
    )


def train_adapter(base: torch.nn.Module, adapter: AdapterRecipe, blocks: torch.Tensor, seed: int
                  ) -> tuple[PeftModel, list[float]]:
    """Wrap `base` in a fresh LoRA (A seeded, B = 0) and train only the LoRA weights on `blocks`."""
    torch.manual_seed(seed)
    model = get_peft_model(base, lora_config(adapter))
    losses = train_lm(model, blocks, adapter.train, seed)
    return model, losses


def save_adapter(model: PeftModel, out_dir: Path) -> None:
    """adapter_config.json + adapter_model.safetensors; the base is named, not pathed (builds are relocatable)."""
    model.save_pretrained(str(out_dir), safe_serialization=True)
    cfg_path = out_dir / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = BASE_MODEL_NAME
    cfg["target_modules"] = sorted(cfg["target_modules"])   # peft keeps a set: its order varies per process
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    readme = out_dir / "README.md"   # peft's model card template embeds a date-free but noisy stub; not needed
    if readme.exists():
        readme.unlink()


def unwrap(model: PeftModel) -> torch.nn.Module:
    """Remove the LoRA layers again so the next adapter starts from the pristine base."""
    return model.unload()
