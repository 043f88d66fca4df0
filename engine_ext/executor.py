"""Runs a step's plan (speculation/plan.py): every forward queued with its inputs from the host or from the device,
every logits row drawn on the device into the step's token buffer, drafts verified on the device, and what each
row commits copied to the host once the last forward is queued. The host does not wait for any of it: the result
is a Flight (flight.py), which the engine reads one step later. A plain step is the plan with no drafting pass (its
one forward is the adapter-on pass a cycle verifies in), run by the same code.

The executor changes no Sequence: the Flight says what it queued (each row's commits, the prompt positions whose KV
it wrote) and the scheduler applies it (`Scheduler.on_queued`). The one exception to reading one step late is a
prompt's first token drawn in a drafting pass: it is read as soon as that pass has run (the passes queued after it
keep the device busy meanwhile) and handed out before the step ends (`Step.first`)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from .adapter_slots import AdapterSlots
from .batch import SeqWork
from .flight import Flight
from .sampler import SamplingRows, adjust_logits, sample
from .sequence import Sequence
from .speculation.plan import Entry, Forward, Planner, Row, StepPlan
from .stats import SpecStats


@dataclass
class Step:
    """What the engine asks the executor to run: its batch as planner rows, and the step's collaborators."""

    seqs: list[Sequence]
    rows: list[Row]
    passes: int  # drafting passes (0: a plain step)
    # Takes arrivals in between drafting passes: the sequences admitted into the batch and their rows
    join: Callable[[], tuple[list[Sequence], list[Row]]] | None = None
    # Commits and hands out the first tokens of prompts drawn in a drafting pass, read before the step ends
    # (with their logits rows, where kept)
    first: Callable[[list[Sequence], list[int], list[torch.Tensor | None]], None] | None = None


class StepExecutor:
    def __init__(self, runner, slots: AdapterSlots, width: int, max_drafts: int, pass_tokens: int | None,
                 counters: SpecStats | None = None, lead: int = 1):
        """width: the most rows a forward holds (max_num_seqs); max_drafts: the longest draft (the lookahead);
        pass_tokens: the most tokens a drafting step's forward takes prompts up to (the largest CUDA graph); lead:
        SpecConfig.draft_lead."""
        self.runner, self.slots, self.width, self.max_drafts = runner, slots, width, max_drafts
        self.lead = lead
        self.pass_tokens = pass_tokens
        self.counters = counters
        self.commit = runner.commit  # verify.commit_rows, or its one-launch kernel (the runner's backend)
        self.device = slots.device
        self.cuda = self.device.type == "cuda"
        self._side = torch.cuda.Stream(self.device) if self.cuda else None

    @torch.inference_mode()
    def launch(self, step: Step, carry: Flight | None) -> Flight:
        """Queue the step; `carry`: the step before it, queued and not read, whose rows' last tokens and shifts the
        rows it shares with this one start from. A plain step's prompts are not paced: they all run in its one
        forward, as the scheduler's token budget admitted them."""
        planner = Planner(step.passes, self.width, self.pass_tokens if step.passes else None)
        planner.add(step.rows)
        c = len(carry.seqs) if carry is not None else 0
        buf = torch.empty(c + (step.passes + self.max_drafts + 2) * self.width, dtype=torch.long, device=self.device)
        if carry is not None:
            buf[:c] = carry.last
        run = _Run(list(step.seqs), carry, buf, c, stream=torch.cuda.current_stream(self.device) if self.cuda else None)
        for j in range(step.passes):
            if j and step.join is not None:
                self._between(step, planner, run, j)
            prev = planner.plan.forwards[-1] if j else None
            self._forward(planner.next_pass(), run, "base", prev)
        if step.passes and step.join is not None:
            self._between(step, planner, run, step.passes)
        self._forward(planner.verify_pass(), run, "lora" if step.passes else "plain")
        if step.passes and step.first is not None:  # the drafting passes' first tokens not handed out yet
            for j in range(self._published_through(step.passes) + 1, step.passes):
                self._first_tokens(step, planner.plan, run, j)
        self._count(planner.plan)
        return self._flight(planner.plan, run)

    def _count(self, plan: StepPlan) -> None:
        c = self.counters
        if c is None or not plan.passes:
            return
        c.draft_passes += plan.passes
        c.cycle_passes[plan.passes] += 1
        c.ridden_prompts += sum(len(f) for f in plan.firsts)
        c.paced_prompts += len(plan.paced)

    # ------------------------------------------------------------ forwards
    def _forward(self, fwd: Forward, run: _Run, kind: str, prev: Forward | None = None) -> None:
        """Queue one forward and draw its logits rows into the buffer at fwd.out, between two marks (its span). A
        plain step's span starts once its forward is packed (`ModelRunner.launch`'s `started`): plain steps overlap
        one another, so the packing the device waits for after a cycle is not what a run of them costs; a cycle's
        packed passes keep it, since every cycle waits for its verify before the next is packed.
        `kind`: "base", "lora" or "plain"; "prompted" when it also computes prompts. `prev`: the forward queued
        just before it in this step; when fwd is prev one position on (`_continues`), the runner queues prev again
        from what it already has on the device rather than from fwd's work packed anew."""
        if prev is not None and self._continues(prev, fwd):
            expect = self._works(fwd, run)[0] if self.runner.limits is not None else None  # debug: checked
            run.marks.append([self._mark(run), None])
            logits, positions = self.runner.relaunch(self.slots, run.buf, run.c + prev.out, owned=False,
                                                     expect=expect)
            tokens_in = len(fwd.entries)
        else:
            work, src = self._works(fwd, run)
            on = any(e.lora and run.seqs[e.row].adapter is not None for e in fwd.entries)
            from_buf = any(s >= 0 for s in src)  # (else no token of it is read from the device)
            run.marks.append([self._mark(run), None])
            logits, positions = self.runner.launch(
                work, self.slots, use_lora=on, tokens=run.buf if from_buf else None,
                token_src=src if from_buf else None, owned=False,
                shifts=run.carry.shift if run.carry is not None else None,
                started=self._restart(run) if kind == "plain" else None)
            tokens_in = sum(len(w.token_ids) for w in work)
        self._keep(fwd, run, logits)  # raw rows: logprobs and returned logits are the model's, before adjustments
        tokens = self._sample(fwd, run, logits, positions)
        run.buf[run.c + fwd.out : run.c + fwd.out + len(tokens)] = tokens
        run.marks[-1][1] = self._mark(run)
        kind = "prompted" if any(e.prompt for e in fwd.entries) else kind
        read = {run.seqs[e.row].adapter for e in fwd.entries if e.lora} - {None}
        run.passes.append((kind, tokens_in, len(read)))

    def _works(self, fwd: Forward, run: _Run) -> tuple[list[SeqWork], list[int]]:
        """The forward's SeqWork per entry and each token's source (-1 or a buffer index)."""
        work, src = [], []
        for e in fwd.entries:
            work.append(self._entry_work(e, run.seqs[e.row], run, src))
        return work, src

    def _continues(self, prev: Forward, fwd: Forward) -> bool:
        """fwd is prev one position on: the same rows in the same order, one token each, each from what prev drew
        for it, adapters on or off as they were (a drafting pass after one that no prompt ran in or joined)."""
        if not self.runner.relaunches or len(prev.entries) != len(fwd.entries):
            return False
        return all(a.row == b.row and not (a.prompt or b.prompt) and a.tokens == b.tokens == b.logits == 1
                   and a.lora == b.lora and b.offset == a.offset + 1 and b.srcs[0] == prev.out + k
                   for k, (a, b) in enumerate(zip(prev.entries, fwd.entries)))

    def _sample(self, fwd: Forward, run: _Run, logits: torch.Tensor, positions: torch.Tensor):
        """The forward's logits rows drawn on the device: an argmax when every row is greedy with nothing to adjust,
        else each row with its request's params and noise key."""
        if run.plain:  # (every row of the step: no per-row list to build)
            return logits.argmax(dim=-1)
        rows = [run.seqs[e.row] for e in fwd.entries for _ in range(e.logits)]
        if all(s.plain_row for s in rows):
            return logits.argmax(dim=-1)
        params = [s.params for s in rows]
        packed = SamplingRows.pack(params, [s.seed for s in rows], self.device)
        adjusted = adjust_logits(logits, params, rows) if any(s.adjusts_logits for s in rows) else logits
        return sample(adjusted, packed, None if packed is None else positions + 1)

    def _entry_work(self, e: Entry, seq: Sequence, run: _Run, src: list[int]) -> SeqWork:
        """Entry e's SeqWork, appending each token's source (-1 or an index into the buffer) to `src`; a prompt's
        entry notes the positions whose KV it writes (`_Run.computed`)."""
        slot = self.slots.lora_slot(seq.adapter) if e.lora else self.slots.zero_slot
        if e.prompt:
            w = seq.work(slot)
            src.extend([-1] * len(w.token_ids))
            run.computed[e.row] = w.start + len(w.token_ids)
            return w
        carried = run.carry is not None and seq.flight is run.carry
        row = seq.flight_row if carried else -1
        lo, hi = run.carry.pending(row) if carried else (0, 0)
        # offsets count from its last token when the step was planned: a first token committed early (`first`) is
        # at offset 1
        base = seq.num_tokens - 1 + lo - (e.row in run.published)
        ids = []
        for s in e.srcs:
            ids.append(0 if s >= 0 or carried else seq.last_token)
            src.append(run.c + s if s >= 0 else row)
        shifted = carried and run.carry.shift is not None
        return SeqWork(ids, base + e.offset, seq.block_table, slot, e.logits,
                       shift=row if shifted else -1, shift_max=hi - lo)

    def _keep(self, fwd: Forward, run: _Run, logits: torch.Tensor) -> None:
        """Logits rows of the entries whose requests return them (logprobs, return_logits), by buffer index."""
        if not run.keeps:
            return
        n = 0
        for e in fwd.entries:
            if run.seqs[e.row].params.needs_rows:
                for i in range(e.logits):
                    run.kept[fwd.out + n + i] = logits[n + i].float().clone()
            n += e.logits

    # ------------------------------------------------------------ between passes
    def _between(self, step: Step, planner: Planner, run: _Run, j: int) -> None:
        """Before drafting pass j (or the verify pass, j = passes): let the device get `lead` passes ahead (wait for
        pass j - 1 - lead to end), hand out the first tokens that pass drew, and take arrivals in: their prompts join
        the passes left."""
        if j - self.lead >= 0:
            self._wait(run, j - self.lead)
        if j - 1 - self.lead >= 0 and step.first is not None:
            self._first_tokens(step, planner.plan, run, j - 1 - self.lead)
        seqs, rows = step.join()
        if seqs:
            run.join(seqs)
            planner.add(rows)
            if self.counters is not None:
                self.counters.joined += len(seqs)

    def _published_through(self, passes: int) -> int:
        """The last drafting pass whose first tokens `_between` handed out (-1: none) in a cycle of `passes`."""
        return max(-1, passes - 1 - self.lead)

    def _first_tokens(self, step: Step, plan: StepPlan, run: _Run, j: int) -> None:
        rows = [r for r in plan.firsts[j] if r not in run.published]
        if not rows:
            return
        idx = [run.c + plan.fixed[r][0] for r in rows]
        tokens = self._read_after(run, j + 1, idx)
        run.published.update(rows)
        step.first([run.seqs[r] for r in rows], tokens, [run.kept.get(plan.fixed[r][0]) for r in rows])

    def _restart(self, run: _Run):
        """A callback that moves the opening mark of the forward being queued to the moment it is called."""
        def restart() -> None:
            run.marks[-1][0] = self._mark(run)
        return restart

    def _mark(self, run: _Run):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(run.stream)  # (without it, each record looks the current stream up: tens of us of host time)
        return event

    @staticmethod
    def _passed(run: _Run, i: int):
        """The mark the device passes once it has run i forwards of the step (0: when it starts the first)."""
        return run.marks[i - 1][1] if i else run.marks[0][0]

    def _wait(self, run: _Run, i: int) -> None:
        if self.cuda:
            began = time.perf_counter()
            self._passed(run, i).synchronize()
            run.wait_s += time.perf_counter() - began

    def _read_after(self, run: _Run, i: int, idx: list[int]) -> list[int]:
        """buf[idx] on the host once the device has run i forwards, without waiting for what was queued after."""
        if not self.cuda:
            return run.buf[idx].tolist()
        began = time.perf_counter()
        with torch.cuda.stream(self._side):
            self._side.wait_event(self._passed(run, i))
            picked = run.buf[torch.tensor(idx, device=self.device)].cpu()
        run.wait_s += time.perf_counter() - began
        return picked.tolist()

    # ------------------------------------------------------------ what each row commits
    def _flight(self, plan: StepPlan, run: _Run) -> Flight:
        """The one builder of a Flight: each row's tokens in commit order (fixed, then the verify pass's up to its
        first rejected draft) gathered on the device, then copied to the host. Rows that commit exactly the one
        token they drew (a plain step) need no verification: their tokens are the flight's `last` as they are."""
        commits = [f + v for f, v in zip(plan.fixed, plan.verified)]
        counted = any(plan.drafts) or any(len(o) != 1 for o in commits)
        if counted:  # each row's tokens, then its count
            result, last, shift = self._verified(plan, run)
        else:
            last = self._gather(run.buf, [run.c + o[0] for o in commits])
            result, shift = last[:, None], None
        host, ready = self._to_host(result, run)
        lo = [len(f) + (len(v) > 0) for f, v in zip(plan.fixed, plan.verified)]
        return Flight(run.seqs, plan, lo, [len(o) for o in commits], last, shift, host, ready, run.marks,
                      run.passes, run.kept, [int(r in run.published) for r in range(len(run.seqs))],
                      drafts=[len(d) for d in plan.drafts], commits=commits, counted=counted,
                      adjusts=any(s.adjusts_logits for s in run.seqs), computed=dict(run.computed),
                      wait_s=run.wait_s, after=run.carry.marks[-1][1] if run.carry is not None and run.carry.marks
                      else None)

    def _verified(self, plan: StepPlan, run: _Run):
        """(tokens and count [R, L + 1], last [R], shift [R] or None) on the device: each row's fixed tokens, then
        the verify pass's up to and including the first that differs from its draft, then how many (verify.py's
        commit_rows, or its one-launch kernel)."""
        layout = _Layout.of(plan, run.c)
        return self.commit(run.buf, self._upload(layout.table), layout.drafts > 0)

    def _gather(self, buf: torch.Tensor, idx: list[int]) -> torch.Tensor:
        """buf[idx] on the device: a view when idx is a run of consecutive indices (a plain step's rows, mostly)."""
        if idx == list(range(idx[0], idx[0] + len(idx))):
            return buf[idx[0] : idx[0] + len(idx)]
        return buf[self._upload(np.array(idx, dtype=np.int64))]

    def _upload(self, table: np.ndarray) -> torch.Tensor:
        """A host index table on the device, copied without the host waiting (pinned, on a GPU)."""
        lanes = torch.from_numpy(table)
        return lanes.pin_memory().to(self.device, non_blocking=True) if self.cuda else lanes

    def _to_host(self, result: torch.Tensor, run: _Run) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """A host copy of `result` (pinned, queued after everything before it) and the event that says it landed."""
        if not self.cuda:
            return result, None
        host = torch.empty(result.shape, dtype=torch.long, pin_memory=True)
        host.copy_(result, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(run.stream)
        return host, ready


@dataclass
class _Run:
    """A launch in progress: its rows, the step it carries from, the token buffer (the carried rows' last tokens in
    [0, c), then the plan's indices from c), each forward's (start, end) marks, the passes for the gate, kept logits
    rows, the rows whose first token went out early, the prompt positions whose KV it queued (row -> positions),
    and the host's seconds blocked on the device between passes."""

    seqs: list[Sequence]
    carry: Flight | None
    buf: torch.Tensor
    c: int
    marks: list = field(default_factory=list)
    passes: list = field(default_factory=list)
    kept: dict = field(default_factory=dict)
    published: set = field(default_factory=set)
    computed: dict = field(default_factory=dict)
    wait_s: float = 0.0
    stream: torch.cuda.Stream | None = None  # the stream its forwards are queued on (on a GPU), where its marks go
    # Per-row needs of every row, read by each forward: all greedy with nothing to adjust (an argmax draws them all);
    # any that returns logits rows (logprobs, return_logits)
    plain: bool = field(init=False)
    keeps: bool = field(init=False)

    def __post_init__(self) -> None:
        self.plain = all(s.plain_row for s in self.seqs)
        self.keeps = any(s.params.needs_rows for s in self.seqs)

    def join(self, seqs: list[Sequence]) -> None:
        """Sequences admitted between passes: rows of the passes still to come."""
        self.seqs += seqs
        self.plain = self.plain and all(s.plain_row for s in seqs)
        self.keeps = self.keeps or any(s.params.needs_rows for s in seqs)


@dataclass
class _Layout:
    """The plan's commit order as index lanes into the token buffer, one host table: order [R, L] (fixed then
    verified), draft and target [R, K] (each draft and the verify output it is compared with), and the fixed and
    verified counts (in column 0 of their lanes); -1 pads."""

    table: np.ndarray  # [5, R, max(L, K, 1)]
    drafts: int  # K: the most drafts of a row (0: nothing to verify, every row commits what it is assumed to)

    @classmethod
    def of(cls, plan: StepPlan, offset: int) -> _Layout:
        rows = len(plan.rows)
        commits = [f + v for f, v in zip(plan.fixed, plan.verified)]
        k = max((len(d) for d in plan.drafts), default=0)
        width = max([1, k] + [len(c) for c in commits])
        table = np.full((5, rows, width), -1, dtype=np.int64)
        _scatter(table[0], commits, offset)
        _scatter(table[1], plan.drafts, offset)
        _scatter(table[2], [v[: len(d)] for v, d in zip(plan.verified, plan.drafts)], offset)
        table[3, :, 0] = [len(f) for f in plan.fixed]
        table[4, :, 0] = [len(v) for v in plan.verified]
        return cls(table, k)


def _scatter(lane: np.ndarray, lists: list[list[int]], offset: int) -> None:
    """lane[r, :len(lists[r])] = lists[r] + offset, for every r, in a few array operations."""
    lens = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
    total = int(lens.sum())
    if not total:
        return
    flat = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=total)
    row = np.repeat(np.arange(len(lists)), lens)
    lane[row, np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)] = flat + offset
