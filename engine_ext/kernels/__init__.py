"""GPU kernels behind the engine's plain-torch references (Triton; imported lazily, only on a GPU).

`install()` registers them: the batched LoRA op as lora_backend "triton" and the paged attention
kernel as attn_backend "triton". Nothing here imports Triton at package import time, so the CPU
build of the engine never needs it.
"""

from __future__ import annotations

__all__ = ["install", "set_cache_dir", "triton_available"]


def triton_available() -> bool:
    try:
        import torch
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def install() -> None:
    """Register the Triton kernels as lora_backend / attn_backend "triton" (idempotent). Needs Triton."""
    from ..attention import register_attention_backend
    from ..lora_ops import register_lora_backend
    from .triton_attention import paged_attention_triton
    from .triton_lora import add_lora_group_triton, add_lora_triton

    register_lora_backend("triton", add_lora_triton, add_lora_group_triton)
    register_attention_backend("triton", paged_attention_triton)


def set_cache_dir(path: str) -> None:
    """Keep Triton's compiled kernels in `path` (created if missing), for this process's later compiles."""
    import os

    from triton import knobs

    os.makedirs(path, exist_ok=True)
    knobs.cache.dir = path
