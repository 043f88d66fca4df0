"""Base-model specs: the linear modules a LoRA may target and their (in, out) features, derived from a
Hugging Face `config.json`, so adapter tensors can be checked without loading the model."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from registry.errors import RegistryValidationError
from registry.records import FileEntry

__all__ = ["BaseModelSpec", "ModuleShape", "spec_from_config", "load_config", "ATTN_MODULES", "MLP_MODULES"]

# Module names are constants in one place; the parent block decides the PEFT tensor path.
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


class ModuleShape(BaseModel):
    block: str = Field(description="'self_attn' or 'mlp': the parent of the module in each decoder layer")
    in_features: int
    out_features: int


class BaseModelSpec(BaseModel):
    name: str
    architecture: str = Field(description="config.json architectures[0], e.g. LlamaForCausalLM")
    model_type: str
    num_hidden_layers: int
    hidden_size: int
    modules: dict[str, ModuleShape] = Field(description="module name -> shape of its nn.Linear")
    aliases: list[str] = Field(default_factory=list, description="other names adapters may cite as base model")
    files: dict[str, FileEntry] = Field(
        default_factory=dict, description="the model's files in the blob store (config, tokenizer, safetensors); "
        "empty: only the config was registered and replicas read the model from a local directory")
    blob_location: str | None = Field(None, description="the blob store holding `files`")

    def accepts_base_name(self, cited: str) -> bool:
        """PEFT writes `base_model_name_or_path` as whatever the trainer loaded: a hub id or a local path.
        Accept the spec name, an alias, or a path whose last component is one of those."""
        names = {self.name, *self.aliases}
        names |= {os.path.basename(n.rstrip("/")) for n in names}
        return cited in names or os.path.basename(cited.rstrip("/")) in names


def load_config(model_dir_or_config: str | os.PathLike | dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """-> (config dict, aliases). A directory contributes its absolute path as an alias."""
    if isinstance(model_dir_or_config, dict):
        cfg = model_dir_or_config
        aliases = []
    else:
        path = Path(model_dir_or_config)
        cfg_path = path / "config.json" if path.is_dir() else path
        try:
            cfg = json.loads(cfg_path.read_text())
        except (OSError, ValueError) as e:
            raise RegistryValidationError(f"cannot read base model config {cfg_path}: {e}", code="bad_base_model") from e
        aliases = [str(cfg_path.parent.resolve())]
    if not isinstance(cfg, dict):
        raise RegistryValidationError("base model config must be a JSON object", code="bad_base_model")
    if isinstance(cfg.get("_name_or_path"), str) and cfg["_name_or_path"]:
        aliases.append(cfg["_name_or_path"])
    return cfg, aliases


def _int_field(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise RegistryValidationError(f"base model config lacks {key!r}", code="bad_base_model")
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise RegistryValidationError(f"base model config {key!r} must be a positive integer, got {value!r}", code="bad_base_model")
    return value


def spec_from_config(name: str, cfg: dict[str, Any], aliases: list[str] | None = None,
                     files: dict[str, FileEntry] | None = None, blob_location: str | None = None) -> BaseModelSpec:
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise RegistryValidationError(
            f"unsupported base model type {model_type!r}; supported: {sorted(SUPPORTED_MODEL_TYPES)}", code="bad_base_model"
        )
    hidden = _int_field(cfg, "hidden_size")
    heads = _int_field(cfg, "num_attention_heads")
    kv_heads = _int_field(cfg, "num_key_value_heads", heads)
    # Qwen3 and some Mistral configs set head_dim explicitly (it need not equal hidden / heads).
    head_dim = _int_field(cfg, "head_dim", cfg.get("head_dim") or hidden // heads)
    inter = _int_field(cfg, "intermediate_size")
    modules = {
        "q_proj": ModuleShape(block="self_attn", in_features=hidden, out_features=heads * head_dim),
        "k_proj": ModuleShape(block="self_attn", in_features=hidden, out_features=kv_heads * head_dim),
        "v_proj": ModuleShape(block="self_attn", in_features=hidden, out_features=kv_heads * head_dim),
        "o_proj": ModuleShape(block="self_attn", in_features=heads * head_dim, out_features=hidden),
        "gate_proj": ModuleShape(block="mlp", in_features=hidden, out_features=inter),
        "up_proj": ModuleShape(block="mlp", in_features=hidden, out_features=inter),
        "down_proj": ModuleShape(block="mlp", in_features=inter, out_features=hidden),
    }
    archs = cfg.get("architectures") or [f"{model_type}ForCausalLM"]
    return BaseModelSpec(
        name=name,
        architecture=str(archs[0]),
        model_type=model_type,
        num_hidden_layers=_int_field(cfg, "num_hidden_layers"),
        hidden_size=hidden,
        modules=modules,
        aliases=sorted(set(aliases or [])),
        files=files or {},
        blob_location=blob_location if files else None,
    )
