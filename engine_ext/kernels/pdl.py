"""Programmatic dependent launch (PDL; Hopper and later) for the fused kernels and attention at decode sizes.

A kernel launched with PDL may be scheduled while the kernel before it on the stream is finishing; its
programs wait (griddepcontrol.wait) for that kernel's completion and memory flush before they read or
write anything, so memory is ordered exactly as without PDL and only the launch latency overlaps. Each
also lets the next PDL kernel be scheduled at once (griddepcontrol.launch_dependents at its start: the
rotary kernel's attention then waits, resident, for it to finish).

Only launches of up to MAX_TOKENS tokens use it (decode at batch <= 32, one wave of programs).
Measured in the whole forward on the H200 (bench/forward_ab.py): plain decode at batch 32 1.712 against
1.726 ms (run 18) and 1.709 against 1.724 ms (run 19); the verify passes (64-160 tokens, several waves)
were 1.3-3.3% slower with it, early trigger or not (runs 18, 19), so they launch without it.
LORASERVE_PDL=0 turns it off; it is off under Triton's interpreter and before sm_90. A kernel takes a `PDL`
constexpr and calls `wait_then_release(PDL)` first; its launch passes `**launch(num_tokens)` (the constexpr and
the launch option together).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Launches of up to this many tokens use PDL (decode at batch <= 32: one wave).
MAX_TOKENS = 32


def _enabled() -> bool:
    if os.environ.get("LORASERVE_PDL", "1") != "1" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


PDL = _enabled()


def launch(num_tokens: int) -> dict:
    """The PDL constexpr and launch option of a launch over `num_tokens` tokens."""
    return {"PDL": 1, "launch_pdl": True} if PDL and num_tokens <= MAX_TOKENS else {"PDL": 0}


@triton.jit
def wait_then_release(PDL: tl.constexpr):
    """A PDL kernel's first step, before any load or store: wait for the previous kernel's completion and memory
    flush, then let the next PDL kernel be scheduled."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
