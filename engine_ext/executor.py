"""Runs a step's plan (speculation/plan.py): every forward queued with its inputs from the host or from the device,
every logits row drawn on the device into the step's token buffer, drafts verified on the device, and what each
row commits copied to the host once the last forward is queued. The host does not wait for any of it: the result
is a Flight (flight.py), which the engine reads one step later.

The one exception is a prompt's first token drawn in a drafting pass: it is read as soon as that pass has run
(the passes queued after it keep the device busy meanwhile) and handed out before the step ends (`Step.first`)."""

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
from .speculation import verify
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
                 counters: SpecStats | None = None):
        """width: the most rows a forward holds (max_num_seqs); max_drafts: the longest draft (the lookahead);
        pass_tokens: the most tokens a drafting step's forward takes prompts up to (the largest CUDA graph)."""
        self.runner, self.slots, self.width, self.max_drafts = runner, slots, width, max_drafts
        self.pass_tokens = pass_tokens
        self.counters = counters
        self.device = slots.device
        self.cuda = self.device.type == "cuda"
        self._side = torch.cuda.Stream(self.device) if self.cuda else None

    @torch.inference_mode()
    def launch(self, step: Step, carry: Flight | None) -> Flight:
        """Queue the step; `carry`: the step before it, queued and not read, whose rows' last tokens and shifts the
        rows it shares with this one start from."""
        if not step.passes:
            return self._plain(step.seqs, carry)
        planner = Planner(step.passes, self.width, self.pass_tokens)
        planner.add(step.rows)
        seqs = list(step.seqs)
        c = len(carry.seqs) if carry is not None else 0
        buf = torch.empty(c + (step.passes + self.max_drafts + 2) * self.width, dtype=torch.long, device=self.device)
        if carry is not None:
            buf[:c] = carry.last
        run = _Run(seqs, carry, buf, c, [self._mark()], [], {})
        for j in range(step.passes):
            if j and step.join is not None:
                self._between(step, planner, run, j)
            self._forward(planner.next_pass(), run, planner.plan)
        if step.join is not None:
            self._between(step, planner, run, step.passes)
        self._forward(planner.verify_pass(), run, planner.plan)
        if step.first is not None:  # the last drafting pass's first tokens, before the verify pass ends
            self._first_tokens(step, planner.plan, run, step.passes - 1)
        self._count(planner.plan)
        return self._flight(planner.plan, run)

    def _count(self, plan: StepPlan) -> None:
        c = self.counters
        if c is None:
            return
        c.draft_passes += plan.passes
        c.cycle_passes[plan.passes] += 1
        c.ridden_prompts += sum(len(f) for f in plan.firsts)
        c.paced_prompts += len(plan.paced)

    # ------------------------------------------------------------ forwards
    def _plain(self, seqs: list[Sequence], carry: Flight | None) -> Flight:
        """A plain step: every row in one adapter-on forward, one token each (its plan is trivial: row r's one entry
        draws buffer index r, from its last token or its prompt), so its work is built straight from the rows."""
        work, src, special = [], [], []
        lora_slot = self.slots.lora_slot
        shifts = carry.shift if carry is not None else None
        for r, seq in enumerate(seqs):
            slot = lora_slot(seq.adapter)
            n = seq.num_tokens
            if n - seq.num_computed > 1:  # a prompt (or a preempted sequence's recompute)
                w = seq.work(slot)
                src += [-1] * len(w.token_ids)
                seq.num_computed = n  # queued: its prompt's KV is written before any later read
            elif seq.flight is carry and carry is not None:
                row, (lo, hi) = seq.flight_row, seq.pending
                src.append(row)
                w = SeqWork([0], n - 1 + lo, seq.block_table, slot, 1, row if shifts is not None else -1, hi - lo)
            else:
                src.append(-1)
                w = SeqWork([seq.last_token], n - 1, seq.block_table, slot)
            work.append(w)
            if not seq.plain_row:
                special.append(r)
        logits, positions = self.runner.launch(
            work, self.slots, use_lora=any(s.adapter is not None for s in seqs), owned=False, shifts=shifts,
            tokens=carry.last if carry is not None else None, token_src=src if carry is not None else None)
        kept, adjusts = {}, False
        if special:  # rows that sample, adjust their logits or return them (else every row is an argmax)
            params = [s.params for s in seqs]
            kept = {r: logits[r].float().clone() for r in special if params[r].needs_rows}
            adjusts = any(seqs[r].adjusts_logits for r in special)
            rows = SamplingRows.pack(params, [s.seed for s in seqs], self.device)
            tokens = sample(adjust_logits(logits, params, seqs) if adjusts else logits, rows,
                            None if rows is None else positions + 1)
        else:
            tokens = logits.argmax(dim=-1)
        host, ready = self._to_host(tokens)
        n = len(seqs)
        ones = [1] * n  # (a plain step is priced by its whole time, not by its forward's span: no marks)
        flight = Flight(list(seqs), None, ones, ones, tokens, None, host[:, None], ready, [], [], kept, [0] * n,
                        commits=[[r] for r in range(n)], counted=False, adjusts=adjusts)
        for r, seq in enumerate(seqs):  # every row commits its one token: the next step starts after it
            seq.flight, seq.flight_row, seq.pending = flight, r, (1, 1)
        return flight

    def _forward(self, fwd: Forward, run: _Run, plan: StepPlan) -> None:
        """Queue one forward and draw its logits rows into the buffer at fwd.out."""
        work, src, params, seeds, history = [], [], [], [], []
        for e in fwd.entries:
            seq = run.seqs[e.row]
            w = self._entry_work(e, seq, run, src)
            work.append(w)
            params += [seq.params] * e.logits
            seeds += [seq.seed] * e.logits
            history += [seq] * e.logits
            if e.prompt:
                seq.num_computed = seq.num_tokens  # queued: the KV of its prompt is written before any later read
        on = any(e.lora and run.seqs[e.row].adapter is not None for e in fwd.entries)
        logits, positions = self.runner.launch(
            work, self.slots, use_lora=on, tokens=run.buf, token_src=src, owned=False,
            shifts=run.carry.shift if run.carry is not None else None)
        self._keep(fwd, run, logits)  # raw rows: logprobs and returned logits are the model's, before adjustments
        rows = SamplingRows.pack(params, seeds, self.device)
        tokens = sample(adjust_logits(logits, params, history), rows, None if rows is None else positions + 1)
        run.buf[run.c + fwd.out : run.c + fwd.out + len(params)] = tokens
        run.marks.append(self._mark())
        kind = "prompted" if any(e.prompt for e in fwd.entries) else ("lora" if fwd is plan.verify else "base")
        read = {run.seqs[e.row].adapter for e in fwd.entries if e.lora} - {None}
        run.passes.append((kind, sum(len(w.token_ids) for w in work), len(read)))

    def _entry_work(self, e: Entry, seq: Sequence, run: _Run, src: list[int]) -> SeqWork:
        """Entry e's SeqWork, appending each token's source (-1 or an index into the buffer) to `src`."""
        slot = self.slots.lora_slot(seq.adapter) if e.lora else self.slots.zero_slot
        if e.prompt:
            w = seq.work(slot)
            src.extend([-1] * len(w.token_ids))
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
        n = 0
        for e in fwd.entries:
            if run.seqs[e.row].params.needs_rows:
                for i in range(e.logits):
                    run.kept[fwd.out + n + i] = logits[n + i].float().clone()
            n += e.logits

    # ------------------------------------------------------------ between passes
    def _between(self, step: Step, planner: Planner, run: _Run, j: int) -> None:
        """Before drafting pass j (or the verify pass, j = passes): let the device get one pass ahead (wait for pass
        j - 2), hand out the first tokens pass j - 2 drew, and take arrivals in: their prompts join the passes left."""
        self._wait(run, j - 1)
        if j >= 2 and step.first is not None:
            self._first_tokens(step, planner.plan, run, j - 2)
        seqs, rows = step.join()
        if seqs:
            run.seqs += seqs
            planner.add(rows)
            if self.counters is not None:
                self.counters.joined += len(seqs)

    def _first_tokens(self, step: Step, plan: StepPlan, run: _Run, j: int) -> None:
        rows = [r for r in plan.firsts[j] if r not in run.published]
        if not rows:
            return
        idx = [run.c + plan.fixed[r][0] for r in rows]
        tokens = self._read_after(run, j + 1, idx)
        run.published.update(rows)
        step.first([run.seqs[r] for r in rows], tokens, [run.kept.get(plan.fixed[r][0]) for r in rows])

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _wait(self, run: _Run, i: int) -> None:
        if self.cuda:
            run.marks[i].synchronize()

    def _read_after(self, run: _Run, i: int, idx: list[int]) -> list[int]:
        """buf[idx] on the host once the device has passed mark i, without waiting for what was queued after it."""
        if not self.cuda:
            return run.buf[idx].tolist()
        with torch.cuda.stream(self._side):
            self._side.wait_event(run.marks[i])
            picked = run.buf[torch.tensor(idx, device=self.device)].cpu()
        return picked.tolist()

    # ------------------------------------------------------------ what each row commits
    def _flight(self, plan: StepPlan, run: _Run) -> Flight:
        """Each row's tokens in commit order (fixed, then the verify pass's up to its first rejected draft), on the
        device, then copied to the host."""
        layout = _Layout.of(plan, run.c)
        lanes = torch.from_numpy(layout.table)
        if self.cuda:
            lanes = lanes.pin_memory().to(self.device, non_blocking=True)
        order, draft, target, fixed, verified = lanes
        tokens = run.buf[order.clamp_min(0)]
        accepted = verify.accepted_lengths(run.buf[draft.clamp_min(0)], run.buf[target.clamp_min(0)], draft >= 0)
        verifies = verified[:, 0] > 0
        counts = fixed[:, 0] + verifies * (accepted + 1)
        last = tokens.gather(1, (counts - 1).clamp_min(0)[:, None])[:, 0]
        shift = verifies * accepted if layout.drafts else None  # committed beyond lo: the accepted drafts
        host, ready = self._to_host(torch.cat([tokens, counts[:, None]], dim=1))
        commits = [f + v for f, v in zip(plan.fixed, plan.verified)]
        lo = [len(f) + (len(v) > 0) for f, v in zip(plan.fixed, plan.verified)]
        return self._rows(Flight(run.seqs, plan, lo, [len(o) for o in commits], last, shift, host, ready, run.marks,
                                 run.passes, run.kept, [int(r in run.published) for r in range(len(run.seqs))],
                                 drafts=[len(d) for d in plan.drafts], commits=commits,
                                 adjusts=any(s.adjusts_logits for s in run.seqs)))

    def _to_host(self, result: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """A host copy of `result` (pinned, queued after everything before it) and the event that says it landed."""
        if not self.cuda:
            return result, None
        host = torch.empty(result.shape, dtype=torch.long, pin_memory=True)
        host.copy_(result, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return host, ready

    @staticmethod
    def _rows(flight: Flight) -> Flight:
        """Mark every row's sequence as held by this flight (the next step starts from where it leaves them)."""
        for r, seq in enumerate(flight.seqs):
            if flight.lo[r]:
                seq.flight, seq.flight_row = flight, r
                seq.pending = flight.pending(r)
        return flight


@dataclass
class _Run:
    """A launch in progress: its rows, the step it carries from, the token buffer (the carried rows' last tokens in
    [0, c), then the plan's indices from c), the timing marks, the passes for the gate, kept logits rows, the rows
    whose first token went out early."""

    seqs: list[Sequence]
    carry: Flight | None
    buf: torch.Tensor
    c: int
    marks: list
    passes: list
    kept: dict
    published: set = field(default_factory=set)


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
