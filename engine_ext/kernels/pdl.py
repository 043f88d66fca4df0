"""Programmatic dependent launch (PDL; Hopper and later) for the fused decode kernels and attention.

A kernel launched with PDL may be scheduled while the kernel before it on the stream is finishing; its
programs wait (griddepcontrol.wait) for that kernel's completion and memory flush before they read or
write anything, so memory is ordered exactly as without PDL and only the launch latency overlaps. At
decode sizes a kernel also lets the next PDL kernel be scheduled at once (griddepcontrol.launch_dependents
at its start: the rotary kernel's attention then waits, resident, for it to finish). Larger launches run
in several waves, which programs waiting that early would crowd out (run 18: every verify pass 1.6-3.3%
slower with the early trigger at every size), so they trigger at exit.

Measured in the whole forward on the H200 (bench/forward_ab.py, run 18): plain decode at batch 32 1.712
against 1.726 ms. LORASERVE_PDL=0 turns it off; it is off under Triton's interpreter and before sm_90.
`flag(num_tokens)` is the kernels' PDL constexpr (0 off, 1 wait, 2 wait and trigger early), `LAUNCH` the
launch options that go with it.
"""

from __future__ import annotations

import os

import torch

# Launches of up to this many tokens trigger their dependents at once (decode at batch <= 32: one wave).
EARLY_TRIGGER_TOKENS = 32


def _enabled() -> bool:
    if os.environ.get("LORASERVE_PDL", "1") != "1" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


PDL = _enabled()
LAUNCH = {"launch_pdl": True} if PDL else {}


def flag(num_tokens: int) -> int:
    if not PDL:
        return 0
    return 2 if num_tokens <= EARLY_TRIGGER_TOKENS else 1
