"""Batched multi-LoRA math: one op applies a different adapter to every token.

    y[i] += (x[i] @ A[slot[i]]) @ B[slot[i]] * scale[slot[i]]

`A` is `[num_slots, in, R]`, `B` is `[num_slots, R, out]`, `scale` is `[num_slots]`; ranks below R are
zero-padded (exact: the padding contributes zeros). The last slot is all zeros and serves base-only
tokens. `add_lora_reference` is the plain-torch definition (a per-token gather of A and B);
`add_lora_dense` computes the same with two dense matrix products over all slots, which avoids
materialising a [T, in, R] gather and is the default on the CPU. The Triton kernel
(kernels/triton_lora.py, lora_backend "triton") has the same signature; backend.py picks the op.
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


def add_lora_dense(y, x, a, b, scale, slots) -> None:
    """Same contract: shrink against every slot, keep each token's own slot (scaled), expand once.

    (x @ [A_0 | A_1 | ...]) masked to the token's slot block, then @ [B_0; B_1; ...]: the other
    slots contribute exact zeros, so the sum equals the per-token definition."""
    num_slots, fan_in, rank = a.shape
    shrunk = (x @ a.permute(1, 0, 2).reshape(fan_in, num_slots * rank)).view(-1, num_slots, rank)
    keep = torch.zeros(slots.shape[0], num_slots, dtype=shrunk.dtype, device=shrunk.device)
    keep.scatter_(1, slots[:, None], scale[slots][:, None].to(shrunk.dtype))
    y.add_((shrunk * keep[:, :, None]).view(-1, num_slots * rank) @ b.reshape(num_slots * rank, -1))


_BACKENDS: dict[str, LoRAOp] = {"torch": add_lora_dense, "gather": add_lora_reference}


def get_lora_op(name: str) -> LoRAOp:
    """The plain-torch LoRA op called `name` ("torch" or "gather")."""
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown lora_backend {name!r}; available: {sorted(_BACKENDS)}") from None
