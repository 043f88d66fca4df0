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
LORASERVE_PDL=0 turns it off; it is off under Triton's interpreter and before sm_90. `flag(num_tokens)`
is the kernels' PDL constexpr (0 off, 1 on) and `launch(num_tokens)` the launch options that go with it.
"""

from __future__ import annotations

import os

import torch

# Launches of up to this many tokens use PDL (decode at batch <= 32: one wave).
MAX_TOKENS = 32


def _enabled() -> bool:
    if os.environ.get("LORASERVE_PDL", "1") != "1" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


PDL = _enabled()


def flag(num_tokens: int) -> int:
    return int(PDL and num_tokens <= MAX_TOKENS)


def launch(num_tokens: int) -> dict:
    return {"launch_pdl": True} if flag(num_tokens) else {}
