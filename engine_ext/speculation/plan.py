"""A step as data: which rows run in which forward, adapters on or off, where each input token comes from, and
which drawn tokens each row commits. Pure: no tensors, no sequences; rows are indices into the step's batch.

A step is P drafting passes (P = 0: a plain step) and one adapter-on verify pass. Every forward's logits rows are
sampled on the device into one token buffer: drafting pass j's entry i at j * width + i, the verify pass's rows
after the last drafting pass. An input token comes from the host (-1: the row's last known token, or its prompt) or
from that buffer (>= 0), so every forward can be queued before the host has read any of them.

Rows (`Row.kind`):
- DRAFT: drafts m tokens in passes 0..m-1 with adapters off, each from the one before; the verify pass runs
  [last, d1..dm] with its adapter on and commits the target's tokens up to the first that differs from its draft.
- RIDE: decodes in every drafting pass with its adapter on (a base-only row's adapter is none), a final token per
  pass, then one more in the verify pass.
- PLAIN: only the verify pass, one token (a plain step's rows; rows whose params rule drafting out).
- PROMPT: computes its prompt in the first pass with room for it (adapter on), which draws its first token; then
  drafts (`drafts`) or else rides in the passes left like the rows above. A prompt no pass has room for waits for
  the next step; a `late` one runs in the verify pass only.

Prompts are paced so that no forward passes `pass_tokens` (the largest CUDA graph: a forward past it runs eager,
several times slower for its size): each takes the first pass with room, in arrival order. Two exceptions: a
step's first prompt always runs in its first pass, so a long prompt is never put off for good; and when the prompts
waiting are more than the passes left (and the next step's first) can take, they all run at once, as a plain step
would run them (a burst: spreading them would hold most back for several steps)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Kind(enum.IntEnum):
    DRAFT = 0
    RIDE = 1
    PLAIN = 2
    PROMPT = 3


@dataclass(frozen=True, slots=True)
class Row:
    kind: Kind
    drafts: int = 0  # DRAFT: m >= 1; PROMPT: drafts after its first token (0: it rides, or with ride=False waits)
    left: int = 1 << 30  # tokens it may still generate
    need: int = 1  # PROMPT: tokens of its prompt still to compute
    late: bool = False  # PROMPT: runs in the verify pass only (its tokens need the host's history to be drawn)


@dataclass(slots=True)
class Entry:
    """One row's part of a forward: tokens at positions base + offset, base + offset + 1, ... (base: the position
    of the row's last known token; a prompt's entry is its prompt, offset 0)."""

    row: int
    offset: int
    srcs: list[int]  # per token: -1 (from the host) or an index into the token buffer
    lora: bool  # its adapter on
    prompt: bool = False
    logits: int = 1  # next-token logits of its last `logits` tokens, drawn into the buffer in order

    @property
    def tokens(self) -> int:
        return len(self.srcs)


@dataclass
class Forward:
    entries: list[Entry]
    out: int  # buffer index of its first logits row

    @property
    def tokens(self) -> int:
        return sum(e.tokens for e in self.entries)


@dataclass
class StepPlan:
    width: int  # buffer entries per drafting pass
    passes: int  # drafting passes planned (P)
    rows: list[Row] = field(default_factory=list)
    forwards: list[Forward] = field(default_factory=list)  # the drafting passes, then the verify pass
    fixed: list[list[int]] = field(default_factory=list)  # per row: buffer indices of tokens final as drawn
    verified: list[list[int]] = field(default_factory=list)  # per row: the verify pass's outputs for it
    drafts: list[list[int]] = field(default_factory=list)  # per row: its drafts (compared with verified[:m])
    firsts: list[list[int]] = field(default_factory=list)  # per drafting pass: rows whose first token it draws
    paced: set[int] = field(default_factory=set)  # prompts that waited for a later forward (or step)
    deferred: list[int] = field(default_factory=list)  # prompts no forward of this step had room for

    @property
    def verify(self) -> Forward | None:
        return self.forwards[self.passes] if len(self.forwards) > self.passes else None


@dataclass(slots=True)
class _Track:
    """A row's state while passes are planned: where its next input comes from and what it does next."""

    kind: Kind  # what it does in the next pass: DRAFT, RIDE, PLAIN (verify only) or PROMPT
    offset: int = 0  # offset of its next input token
    src: int = -1  # where its next input token comes from
    anchor: int = -1  # a drafter's: where the token its drafts start from comes from (its verify pass's first input)
    passes: int = 0  # drafting passes it still runs
    verifies: bool = True  # runs in the verify pass (riders and prompts whose passes used up `left` do not)


class Planner:
    """Builds a StepPlan pass by pass, so that prompts arriving between passes (`add`) join the passes not yet
    planned. `pass_tokens`: the most tokens a forward takes prompts up to (None: no limit)."""

    def __init__(self, passes: int, width: int, pass_tokens: int | None = None):
        self.plan = StepPlan(width=width, passes=passes)
        self.pass_tokens = pass_tokens
        self._tracks: list[_Track] = []
        self._queue: list[int] = []  # prompts waiting for a pass with room, in arrival order

    def add(self, rows: list[Row]) -> None:
        """Rows of the batch (decoding rows and prompts), in batch order; prompts queue in arrival order."""
        plan = self.plan
        for row in rows:
            i = len(plan.rows)
            plan.rows.append(row)
            plan.fixed.append([]), plan.verified.append([]), plan.drafts.append([])
            if row.kind is Kind.PROMPT:
                self._tracks.append(_Track(Kind.PROMPT))
                self._queue.append(i)
            elif row.kind is Kind.DRAFT:
                self._tracks.append(_Track(Kind.DRAFT, passes=min(row.drafts, plan.passes)))
            elif row.kind is Kind.RIDE:
                ride = min(plan.passes, row.left)
                self._tracks.append(_Track(Kind.RIDE, passes=ride, verifies=ride < row.left))
            else:
                self._tracks.append(_Track(Kind.PLAIN))

    def next_pass(self) -> Forward:
        """Plan drafting pass j = the number planned so far (< passes)."""
        plan, j = self.plan, len(self.plan.forwards)
        assert j < plan.passes, "every drafting pass is planned"
        decoding = [i for i, t in enumerate(self._tracks) if t.kind is not Kind.PROMPT and t.passes]
        later = self._room(len(decoding)) * (plan.passes - j)
        taken = self._take(len(decoding), j == 0, later, early=True)
        entries, firsts = [], []
        for i in decoding:
            entries.append(self._decode(i, j * plan.width + len(entries)))
        for i in taken:
            entries.append(Entry(i, 0, [-1] * plan.rows[i].need, lora=True, prompt=True))
            self._after_prompt(i, j * plan.width + len(entries) - 1, plan.passes - j - 1)
            firsts.append(i)
        if len(entries) > plan.width:
            raise ValueError(f"a drafting pass of {len(entries)} rows exceeds the width {plan.width}")
        plan.firsts.append(firsts)
        forward = Forward(entries, j * plan.width)
        plan.forwards.append(forward)
        return forward

    def verify_pass(self) -> Forward:
        """Plan the verify pass (after every drafting pass); prompts still queued run in it if it has room."""
        plan = self.plan
        assert len(plan.forwards) == plan.passes, "the drafting passes come first"
        entries = []
        out = plan.passes * plan.width
        for i, t in enumerate(self._tracks):
            if t.kind is Kind.PROMPT or not t.verifies:
                continue
            if t.kind is Kind.DRAFT:  # [last, d1..dm]: the drafts are the inputs after its last token
                m = len(plan.drafts[i])
                srcs = [t.anchor] + plan.drafts[i]
                offset = t.offset - m
            else:
                srcs, offset, m = [t.src], t.offset, 0
            entries.append(Entry(i, offset, srcs, lora=True, logits=m + 1))
            plan.verified[i] = list(range(out, out + m + 1))
            out += m + 1
        used = sum(e.tokens for e in entries)
        for i in self._take(used, False, self._room(len(entries))):
            entries.append(Entry(i, 0, [-1] * plan.rows[i].need, lora=True, prompt=True))
            plan.verified[i] = [out]
            out += 1
        plan.deferred = list(self._queue)
        forward = Forward(entries, plan.passes * plan.width)
        plan.forwards.append(forward)
        return forward

    # ------------------------------------------------------------ rows
    def _decode(self, i: int, at: int) -> Entry:
        """Row i's one-token entry in this pass, drawing into buffer index `at`."""
        t = self._tracks[i]
        entry = Entry(i, t.offset, [t.src], lora=t.kind is Kind.RIDE)
        (self.plan.drafts if t.kind is Kind.DRAFT else self.plan.fixed)[i].append(at)
        t.src, t.offset, t.passes = at, t.offset + 1, t.passes - 1
        return entry

    def _after_prompt(self, i: int, at: int, passes_left: int) -> None:
        """A prompt computed in a drafting pass drew its first token into `at`: it drafts or rides after it."""
        row, t = self.plan.rows[i], self._tracks[i]
        self.plan.fixed[i].append(at)
        t.src, t.offset = at, 1
        drafts = min(passes_left, row.left - 2, row.drafts)
        if drafts > 0:
            t.kind, t.passes, t.anchor = Kind.DRAFT, drafts, at
        else:
            ride = min(passes_left, row.left - 1)
            t.kind, t.passes, t.verifies = Kind.RIDE, ride, ride < row.left - 1

    # ------------------------------------------------------------ pacing
    def _room(self, rows: int) -> int:
        """Prompt tokens a forward of `rows` one-token rows has room for within pass_tokens."""
        return max(0, self.pass_tokens - rows) if self.pass_tokens is not None else 0

    def _take(self, used: int, first: bool, later: int, early: bool = False) -> list[int]:
        """From the front of the queue, the prompts that fit this forward (holding `used` tokens) within
        pass_tokens; with `first`, its first prompt whatever its size; the whole queue when it outgrows this
        forward's room and `later` (what the forwards after it, to the next step's first, can take). `early`: a
        drafting pass, which late prompts skip. The prompts left are paced."""
        queue = [i for i in self._queue if not (early and self.plan.rows[i].late)]
        needs = [self.plan.rows[i].need for i in queue]
        count = len(needs)
        if self.pass_tokens is not None and sum(needs) <= self.pass_tokens - used + later:
            for n, need in enumerate(needs):
                if used + need > self.pass_tokens and not (first and n == 0):
                    count = n
                    break
                used += need
        taken = set(queue[:count])
        self._queue = [i for i in self._queue if i not in taken]
        self.plan.paced.update(queue[count:])
        return queue[:count]
