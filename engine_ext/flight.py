"""A step queued on the device and not read yet.

The engine reads a step's tokens one step late: it queues step N + 1 (whose inputs come from step N's tokens on the
device) before it waits for step N, so the device never waits for the host between steps. A Flight is what the
host keeps of a queued step until then: its rows (row r is sequence `seqs[r]`), the device tensors the next step
reads (each row's last token, and how many more tokens than the host assumes the row commits), a pinned host copy
of what each row commits, queued after the step's last forward, and what the step queued that the scheduler
applies to its sequences (`Scheduler.on_queued`: the rows it holds, the prompt positions whose KV it writes).
Built in one place, `StepExecutor._flight`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .sequence import Sequence
from .speculation.plan import StepPlan


@dataclass
class Flight:
    seqs: list[Sequence]  # row r's sequence
    plan: StepPlan  # the plan it ran (no drafting pass: a plain step)
    lo: list[int]  # per row: the tokens it commits at least (the host's assumption until it reads the step)
    hi: list[int]  # per row: at most
    last: torch.Tensor  # [R] long, device: each row's last committed token (the next step's input)
    shift: torch.Tensor | None  # [R] long, device: committed - lo; None when every row commits exactly lo
    # [R, L + 1] long, host (pinned on a GPU): each row's tokens in commit order, then the count; [R, 1] when every row
    # commits exactly lo (a plain step): its token
    host: torch.Tensor
    ready: torch.cuda.Event | None  # recorded after the copy to `host` (None on a CPU: already there)
    # per forward: [start, end] marks around it (from just before it is queued to after its tokens are drawn):
    # CUDA events on a GPU, perf_counter on a CPU
    marks: list[list]
    passes: list[tuple[str, int, int]]  # per forward, in order: (kind, tokens, adapters it reads)
    kept: dict[int, torch.Tensor] = field(default_factory=dict)  # token buffer index -> its logits row (float32)
    published: list[int] = field(default_factory=list)  # per row: leading tokens already committed (first tokens)
    launched: float = field(default_factory=time.perf_counter)  # when the engine began to schedule it
    drafts: list[int] | None = None  # per row: tokens it drafted (for the acceptance estimates); None: none
    commits: list[list[int]] = field(default_factory=list)  # per row: token buffer indices in commit order
    counted: bool = True  # `host` ends with each row's count (else every row commits exactly lo)
    adjusts: bool = True  # some row's logits are adjusted from its history (penalties, bias): read before planning
    computed: dict[int, int] = field(default_factory=dict)  # row -> positions whose KV it queued (its prompt's)
    wait_s: float = 0.0  # host seconds blocked on the device while it was queued (between passes, first tokens)
    host_s: float = 0.0  # host seconds the engine spent queueing it (scheduling, planning, launching), waits excluded
    after: object = None  # the end mark of the step queued before it, when that one was still queued (else None)

    def pending(self, r: int) -> tuple[int, int]:
        """(at least, at most) the tokens row r commits when read, beyond those committed early (`published`)."""
        return self.lo[r] - self.published[r], self.hi[r] - self.published[r]

    def read(self) -> tuple[np.ndarray, np.ndarray]:
        """(tokens [R, L], counts [R]) on the host, waiting for the device to get there."""
        if self.ready is not None:
            self.ready.synchronize()
        table = self.host.numpy()
        if not self.counted:  # every row commits what it was assumed to
            return table, np.array(self.lo)
        return table[:, :-1], table[:, -1]

    def spans(self) -> list[float]:
        """Seconds of each forward (after `read`), from its start mark to its end mark: on a GPU its own stretch of
        the device timeline (the host's work between forwards is outside it); on a CPU, where a forward runs on the
        host as it is queued, its wall time."""
        return [_seconds(a, b) for a, b in self.marks]

    def period(self) -> float:
        """Seconds from the end of the step before it (`after`) to its own end (after `read`): on a GPU, the device
        timeline's, its idle time waiting for this step's launch included; 0.0 without a step before it."""
        if self.after is None or not self.marks:
            return 0.0
        return _seconds(self.after, self.marks[-1][1])

    def logits_rows(self, r: int, first: int, count: int) -> list[torch.Tensor | None]:
        """The kept logits rows of row r's committed tokens first .. first + count - 1 (None where not kept)."""
        if not self.kept:
            return [None] * count
        return [self.kept.get(i) for i in self.commits[r][first : first + count]]


def _seconds(a, b) -> float:
    """Seconds from mark a to mark b: perf_counter readings on a CPU, recorded CUDA events on a GPU."""
    return b - a if isinstance(b, float) else a.elapsed_time(b) / 1e3
