"""Programmatic dependent launch (PDL; Hopper and later) for the decode kernels, LORASERVE_PDL=1.

A kernel launched with PDL may be scheduled while the kernel before it on the stream is finishing; its
programs wait (griddepcontrol.wait) for that kernel's completion and memory flush before they read or
write anything, so memory is ordered exactly as without PDL and only the launch latency overlaps. Each
such kernel also lets the next PDL kernel be scheduled early (griddepcontrol.launch_dependents), which
then waits the same way. Off under Triton's interpreter and before sm_90; `PDL` is the kernels'
constexpr flag and `LAUNCH` the launch options that go with it.
"""

from __future__ import annotations

import os

import torch


def _enabled() -> bool:
    if os.environ.get("LORASERVE_PDL", "0") != "1" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


PDL = _enabled()
LAUNCH = {"launch_pdl": True} if PDL else {}
