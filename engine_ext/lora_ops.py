"""Batched multi-LoRA math: one op applies a different adapter to every token.

    y[i] += (x[i] @ A[slot[i]]) @ B[slot[i]] * scale[slot[i]]

`A` is `[num_slots, in, R]`, `B` is `[num_slots, R, out]`, `scale` is `[num_slots]`; ranks below R are
zero-padded (exact: the padding contributes zeros). The last slot is all zeros and serves base-only
tokens, so the op needs no masking. `add_lora_reference` is the plain-torch definition; a faster
backend (a Triton kernel) registers under another name with the same signature.
"""

from __future__ import annotations

from typing import Callable

import torch

LoRAOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def add_lora_reference(
    y: torch.Tensor,  # [T, out] (may be a column slice of a fused output)
    x: torch.Tensor,  # [T, in]
    a: torch.Tensor,  # [S, in, R]
    b: torch.Tensor,  # [S, R, out]
    scale: torch.Tensor,  # [S]
    slots: torch.Tensor,  # [T] long
) -> None:
    shrunk = torch.bmm(x.unsqueeze(1), a[slots])  # (T, 1, R)
    expanded = torch.bmm(shrunk, b[slots]).squeeze(1)  # (T, out)
    y.add_(expanded * scale[slots].unsqueeze(1).to(expanded.dtype))


_BACKENDS: dict[str, LoRAOp] = {"torch": add_lora_reference}


def register_lora_backend(name: str, op: LoRAOp) -> None:
    _BACKENDS[name] = op


def get_lora_op(name: str) -> LoRAOp:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown lora_backend {name!r}; available: {sorted(_BACKENDS)}") from None
