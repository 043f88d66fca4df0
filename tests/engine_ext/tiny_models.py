"""Small random-weight Llama-family models (transformers) and LoRA adapters (peft) for oracle tests."""

from __future__ import annotations

import json
import os

import torch

ARCH_CONFIGS = {
    "llama": dict(
        cls="LlamaConfig", vocab_size=211, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    ),
    "qwen2": dict(
        cls="Qwen2Config", vocab_size=199, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
        rms_norm_eps=1e-6,
    ),
    "mistral": dict(
        cls="MistralConfig", vocab_size=223, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
        rms_norm_eps=1e-5, sliding_window=None,
    ),
}

MODEL_CLASSES = {"LlamaConfig": "LlamaForCausalLM", "Qwen2Config": "Qwen2ForCausalLM",
                 "MistralConfig": "MistralForCausalLM"}


def build_model(kind: str, out_dir: str, seed: int = 0, **overrides) -> str:
    import transformers

    spec = dict(ARCH_CONFIGS[kind], **overrides)
    cls_name = spec.pop("cls")
    config = getattr(transformers, cls_name)(**spec)
    torch.manual_seed(seed)
    model = getattr(transformers, MODEL_CLASSES[cls_name])(config)
    with torch.no_grad():  # larger-than-default init so logits are far from ties
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.08)
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def build_adapter(model_dir: str, out_dir: str, seed: int, r: int = 8, alpha: float = 16,
                  target_modules=("q_proj", "v_proj"), use_rslora: bool = False, rank_pattern=None,
                  alpha_pattern=None, std: float = 0.15) -> str:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=target_modules if isinstance(target_modules, str)
                     else list(target_modules), use_rslora=use_rslora, rank_pattern=rank_pattern or {},
                     alpha_pattern=alpha_pattern or {}, lora_dropout=0.0)
    model = get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def hf_oracle(model_dir: str, adapters: dict[str, str]):
    """An HF model with every adapter loaded through PEFT; returns a function
    (prompt ids, adapter name | None, n) -> (greedy tokens, per-step logits [n, V])."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    base.eval()
    names = list(adapters)
    model = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0]) if names else base
    for n in names[1:]:
        model.load_adapter(adapters[n], adapter_name=n)
    model.eval()

    @torch.no_grad()
    def greedy(prompt: list[int], adapter: str | None, n: int):
        ids = list(prompt)
        all_logits = []
        for _ in range(n):
            x = torch.tensor([ids])
            if adapter is None:
                if names:
                    with model.disable_adapter():
                        logits = model(input_ids=x).logits[0, -1]
                else:
                    logits = model(input_ids=x).logits[0, -1]
            else:
                model.set_adapter(adapter)
                logits = model(input_ids=x).logits[0, -1]
            all_logits.append(logits.float())
            ids.append(int(logits.argmax()))
        return ids[len(prompt):], torch.stack(all_logits)

    return greedy


def rewrite_config(model_dir: str, **changes) -> None:
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
