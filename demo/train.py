"""The one training loop, shared by the base model and the LoRA adapters.

Deterministic by construction: batches come from a seeded generator, no dropout, a fixed thread count
(set by the build process), and no data-dependent control flow.
"""
from __future__ import annotations

import math

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from .recipe import ModelRecipe, TrainRecipe


def pack(ids: list[int], seq_len: int) -> torch.Tensor:
    """Flat token stream -> (num_blocks, seq_len), the ragged tail dropped."""
    n = len(ids) // seq_len
    if n == 0:
        raise ValueError(f"not enough text for one block of {seq_len} tokens ({len(ids)} tokens)")
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def new_base_model(recipe: ModelRecipe, bos_id: int, eos_id: int, pad_id: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=recipe.vocab_size, hidden_size=recipe.hidden_size, intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_hidden_layers, num_attention_heads=recipe.num_attention_heads,
        num_key_value_heads=recipe.num_key_value_heads, max_position_embeddings=recipe.max_position_embeddings,
        tie_word_embeddings=True, bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id,
        rms_norm_eps=1e-5, rope_theta=10000.0, attention_dropout=0.0, torch_dtype="float32",
    )
    return LlamaForCausalLM(config)


def lr_at(step: int, train: TrainRecipe) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < train.warmup:
        return train.lr * (step + 1) / train.warmup
    progress = (step - train.warmup) / max(1, train.steps - train.warmup)
    return train.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_lm(model: torch.nn.Module, blocks: torch.Tensor, train: TrainRecipe, seed: int) -> list[float]:
    """Next-token training on random blocks; only parameters with requires_grad move. Returns per-step losses."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=train.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    losses = []
    for step in range(train.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, train)
        idx = torch.randint(0, blocks.shape[0], (train.batch_size,), generator=gen)
        batch = blocks[idx]                                   # (B, T)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
    model.eval()
    return losses
