"""Train the SmolLM2 adapters with peft on their chat data, and save them small (bfloat16) in PEFT's layout.

Only the reply is learned: the prompt's tokens (system, user, the assistant header) carry no loss, the reply's
tokens and its closing `<|im_end|>` do. Batches come from a seeded generator, there is no dropout and the thread
count is fixed by the caller, so one machine rebuilds the same bytes.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from safetensors.torch import save_file

from ..recipe import TrainRecipe
from ..train import lr_at
from .data import conversations
from .model import MODEL_NAME
from .recipe import AdapterSpec, AdaptersRecipe
from .samples import chat_ids

IGNORE = -100   # the label transformers' loss skips


def encode(tok, pairs: list[tuple[str, str]], max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(input ids, labels) per conversation in the chat template; labels are IGNORE up to the reply."""
    out = []
    for user, reply in pairs:
        prompt, full = chat_ids(tok, user), chat_ids(tok, user, reply)
        end = full.index(tok.eos_token_id, len(prompt)) + 1   # the reply and its <|im_end|>, not the newline after
        if full[:len(prompt)] != prompt or end > max_tokens:
            continue
        out.append((full[:end], [IGNORE] * len(prompt) + full[len(prompt):end]))
    return out


def _batch(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id)          # (B, T), right-padded
    labels = torch.full((len(examples), width), IGNORE)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (x, y) in enumerate(examples):
        ids[i, :len(x)], labels[i, :len(y)], mask[i, :len(x)] = torch.tensor(x), torch.tensor(y), 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def lora_config(spec: AdapterSpec) -> LoraConfig:
    return LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.target_modules),
                      lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")


def train_adapter(base, tok, spec: AdapterSpec, recipe: AdaptersRecipe, seed: int, log=print):
    """A fresh LoRA on `base` trained on the spec's behaviour; returns (peft model, per-step losses)."""
    examples = encode(tok, conversations(spec.behaviour, "train", recipe.seed), recipe.max_tokens)
    torch.manual_seed(seed)
    model = get_peft_model(base, lora_config(spec))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = TrainRecipe(steps=spec.steps, batch_size=spec.batch_size, seq_len=recipe.max_tokens, lr=spec.lr,
                           warmup=recipe.warmup)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    losses = []
    for step in range(spec.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, schedule)
        pick = torch.randint(0, len(examples), (spec.batch_size,), generator=gen).tolist()
        loss = model(**_batch([examples[i] for i in pick], tok.pad_token_id)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 10 == 0 or step == spec.steps - 1:
            log(f"[adapters] {spec.name} step {step + 1}/{spec.steps} loss {losses[-1]:.3f}")
    model.eval()
    return model, losses


def save_adapter(model, out_dir: Path) -> None:
    """adapter_config.json + adapter_model.safetensors in bfloat16 (half the size; what is served and measured)."""
    model.save_pretrained(str(out_dir), safe_serialization=True)
    (out_dir / "README.md").unlink(missing_ok=True)   # peft's model-card stub
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in get_peft_model_state_dict(model).items()}
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    cfg_path = out_dir / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = MODEL_NAME                # named, not pathed: relocatable, same bytes anywhere
    cfg["target_modules"] = sorted(cfg["target_modules"])      # peft keeps a set: its order varies per process
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def train_all(model_dir: Path, out: Path, recipe: AdaptersRecipe, only: tuple[str, ...] = (), log=print) -> dict:
    """Train the recipe's adapters (or those named in `only`) into out/<name>/; returns {name: losses}."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(recipe.threads)
    torch.use_deterministic_algorithms(True)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    results = {}
    for i, spec in enumerate(recipe.adapters):
        if only and spec.name not in only:
            continue
        t0 = time.time()
        model, losses = train_adapter(base, tok, spec, recipe, recipe.seed + 1 + i, log)
        save_adapter(model, out / spec.name)
        base = model.unload()
        results[spec.name] = {"loss": [losses[0], losses[-1]], "seconds": round(time.time() - t0, 1)}
        log(f"[adapters] {spec.name}: loss {losses[0]:.3f} -> {losses[-1]:.3f} in {time.time() - t0:.0f}s")
    return results
