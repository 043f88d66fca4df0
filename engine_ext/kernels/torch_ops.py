"""The Triton kernels as PyTorch custom ops, so `torch.compile` treats them as opaque calls and fuses
only the model's own element-wise work around them (norms, rotary embedding, SiLU, residual adds).

Same contracts as the kernels: `add_lora_compiled` is a LoRA op (lora_ops.py signature, mutates
y in place), `paged_attention_compiled` an attention kernel (attention.paged_attention signature).
"""

from __future__ import annotations

import torch

from ..attention import AttnMetadata
from .triton_attention import paged_attention_triton
from .triton_lora import add_lora_triton


@torch.library.custom_op("loraserve::add_lora_", mutates_args=("y",))
def _add_lora_(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
               slots: torch.Tensor) -> None:
    add_lora_triton(y, x, a, b, scale, slots)


@_add_lora_.register_fake
def _(y, x, a, b, scale, slots) -> None:
    return None


@torch.library.custom_op("loraserve::paged_attention", mutates_args=())
def _paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     token_seq: torch.Tensor, positions: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    meta = AttnMetadata(positions=positions, slot_mapping=positions, block_tables=block_tables, token_seq=token_seq,
                        token_qidx=positions, max_query_len=0)
    return paged_attention_triton(q, k_cache, v_cache, meta, scale, window or None)


@_paged_attention.register_fake
def _(q, k_cache, v_cache, block_tables, token_seq, positions, scale, window) -> torch.Tensor:
    return torch.empty_like(q)


def add_lora_compiled(y, x, a, b, scale, slots) -> None:
    """y[i] += (x[i] @ A[slots[i]]) @ B[slots[i]] * scale[slots[i]]   (the Triton op, opaque to torch.compile)."""
    torch.ops.loraserve.add_lora_(y, x, a, b, scale, slots)


def paged_attention_compiled(q, k_cache, v_cache, meta: AttnMetadata, scale: float, sliding_window=None):
    """out[t] = softmax(q[t] . K[seq(t), :pos(t)+1]^T * scale) @ V[...]   (the Triton kernel, opaque)."""
    return torch.ops.loraserve.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.token_seq,
                                               meta.positions, scale, sliding_window or 0)
