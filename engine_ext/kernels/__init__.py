"""GPU kernels behind the engine's plain-torch references (Triton; imported lazily, only where used).

- triton_lora: the batched LoRA op (EngineConfig.lora_backend "triton")
- triton_attention: paged attention (attn_backend "triton")
- triton_fused: the decoder layer's element-wise work, LoRA folded in at decode sizes (layer_ops "triton")
- triton_metadata: a forward's metadata fix-ups on the device, batch.apply_sources and batch.advance_forward in
  one launch each (layer_ops "triton"; nothing in them to tune: they take no settings)
- triton_verify: a cycle's commit (speculation/verify.commit_rows) in one launch (layer_ops "triton"; no settings)

Every launch wrapper takes its launch settings as a KernelSettings (settings.py, EngineConfig.kernels);
engine_ext.backend binds them. Nothing here imports Triton at package import time, so the CPU build of the
engine never needs it.
"""

from __future__ import annotations

from .settings import KernelSettings

__all__ = ["KernelSettings", "set_cache_dir", "triton_available"]


def triton_available() -> bool:
    try:
        import torch
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def set_cache_dir(path: str) -> None:
    """Keep Triton's compiled kernels in `path` (created if missing), for this process's later compiles."""
    import os

    from triton import knobs

    os.makedirs(path, exist_ok=True)
    knobs.cache.dir = path
