"""Programmatic dependent launch (PDL; Hopper and later) for the fused kernels and attention at decode sizes.

A kernel launched with PDL may be scheduled while the kernel before it on the stream is finishing; its
programs wait (griddepcontrol.wait) for that kernel's completion and memory flush before they read or
write anything, so memory is ordered exactly as without PDL and only the launch latency overlaps. Each
also lets the next PDL kernel be scheduled at once (griddepcontrol.launch_dependents at its start: the
rotary kernel's attention then waits, resident, for it to finish).

Only launches of up to KernelSettings.pdl_max_tokens tokens use it: at decode sizes (one wave of programs) the
overlap shortens the forward, while forwards of several waves measured slower with it (`git show
211e305:bench/RESULTS.md`).
It needs a CUDA device of compute capability 9.0 or later; tensors elsewhere (the CPU tensors of Triton's
interpreter) launch without it. A kernel takes a `PDL` constexpr and calls `wait_then_release(PDL)` first;
its launch passes `**launch(num_tokens, device, settings.pdl_max_tokens)` (the constexpr and the launch option
together).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

@functools.cache
def supported(device: torch.device) -> bool:
    """Whether kernels on `device` can launch with PDL (a CUDA device of compute capability 9.0 or later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def launch(num_tokens: int, device: torch.device, max_tokens: int) -> dict:
    """The PDL constexpr and launch option of a launch over `num_tokens` tokens on `device` (PDL up to
    `max_tokens`)."""
    return {"PDL": 1, "launch_pdl": True} if num_tokens <= max_tokens and supported(device) else {"PDL": 0}


@triton.jit
def wait_then_release(PDL: tl.constexpr):
    """A PDL kernel's first step, before any load or store: wait for the previous kernel's completion and memory
    flush, then let the next PDL kernel be scheduled."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
