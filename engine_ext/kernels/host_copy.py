"""A host-to-device copy done by a kernel reading pinned host memory directly (mapped into the device's
address space by unified virtual addressing), instead of by the copy engine.

The CUDA graphs' per-step inputs (token ids, positions, KV slots, block tables) are a few tens of KB. Sent
with `copy_(non_blocking=True)` they queue on the host-to-device copy engine behind whatever it is already
moving, such as a cold adapter's load (22.5 MB at rank 16, about 0.4 ms), so every running request's step
waits for that load. Read by a kernel on the compute stream, they never touch the copy engine.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def copy_from_pinned(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src on the current stream, read by a kernel from pinned host memory. Both contiguous, same
    shape and dtype; `src` pinned (pageable memory is not mapped into the device's address space)."""
    if src.device.type != "cpu" or not src.is_pinned():
        raise ValueError("copy_from_pinned reads pinned host memory: src must be a pinned CPU tensor")
    if dst.device.type != "cuda" or dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(f"copy_from_pinned needs a CUDA dst of src's shape and dtype, got {dst.shape} {dst.dtype} "
                         f"on {dst.device} for {src.shape} {src.dtype}")
    if not (dst.is_contiguous() and src.is_contiguous()):
        raise ValueError("copy_from_pinned needs contiguous tensors")
    n = dst.numel()
    if n:
        with torch.cuda.device(dst.device):
            _copy_kernel[(triton.cdiv(n, _BLOCK),)](src, dst, n, BLOCK=_BLOCK, num_warps=4)
