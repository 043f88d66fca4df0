"""One speculative cycle: LoRA-off drafting passes, one adapter-on verify pass, settling.

The base model (every adapter switched off) drafts up to m tokens for each adapter sequence in up to
M = max m batched passes, writing its KV into the sequence's own paged cache; then one adapter-on pass over
[last, d1..dm] verifies them, overwriting the drafted positions' KV with the adapter-conditioned values
before anything reads them. The scheduler releases rejected positions by truncating the block table. A
rider needs no verification: each drafting pass is an exact decoding step for it. Riders are the base-only
sequences and the adapter sequences the gate lets ride (`Gate.rides`), whose rows in the drafting passes run
with their adapter on (a pass with such rows is a mixed one: adapters off for the drafters, on for them).

Prompts do not wait for the verify pass either. A prompt in the batch (a new request, or a preempted one
computing its tokens again) runs in the first drafting pass with its adapter on, exactly the plain step it would
otherwise wait a cycle for, and its first token is published (`publish`) as soon as the device has run that
pass, not when the cycle ends: a new request's first token waits about one pass. In the passes after it, it
drafts like any adapter sequence (from its first token, verified in the verify pass), or rides when it is
base-only or its adapter rides (`Gate.prompt_drafts`).

Prompts are paced so that every pass fits the largest CUDA graph (`pass_tokens`): a forward past the graphs
runs eager, several times slower for its size (bench/RESULTS.md section 1), and every sequence of the batch
waits for it. A prompt that would push a pass past the graphs waits for the next pass with room, in arrival
order, and one that no pass of the cycle has room for (the verify pass included) is computed in the next step.
Two exceptions: the first prompt of a cycle always runs in its first pass, whatever its size, so a long prompt is
never put off for good; and when the prompts waiting are more than the passes left (and the next step's first)
can take, they all run at once, as a plain step would run them: an eager pass over many prompt tokens costs
less per token than the graphs, and spreading them would hold most of them back for several steps (a burst).

Two schedules, because sampled drafts are drawn on the host between passes (each request's own generator)
while greedy drafts are an argmax the next pass can read on the device: a cycle whose drafters, riders and
prompts are all greedy queues every pass back to back with one host sync at the end (`_greedy`); otherwise each
pass syncs (`_sampled`). Both settle through the same verify routine (`_settle`).

Requests that arrive while a cycle drafts do not wait for it to end: given a `join` (a serving loop takes
arrivals in), the cycle asks it before each drafting pass after the first and before the verify pass, and the
prompts it admits ride from the next pass on (or run in the verify pass, when they arrive after the last
drafting pass). In the one-sync schedule a sampled arrival's first token cannot be drawn on the device, so
drafting stops there and its prompt runs in the verify pass. The one-sync schedule keeps at most two passes
queued ahead of the device (it waits for pass j - 2 before queuing pass j), so the check sees arrivals while
the device is still busy, and a first token computed in pass j - 2 is read then."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..adapter_slots import AdapterSlots
from ..batch import SeqWork
from ..sampler import draw, probabilities, sample
from ..sequence import Sequence
from ..stats import SpecStats
from .cost import PassClock
from .gate import Plan, StepResult
from .verify import accept_greedy, verify_drafts

# commit(seq, token, logits row or None, finish) -> True when the sequence finished on that token; with
# finish=False a sequence that ends is not yet handed back to the scheduler (its blocks stay its own while
# passes queued after the token still write into them): the cycle finishes it after its sync.
Commit = Callable[..., bool]


@dataclass
class _Member:
    """A sequence's part in the one-sync schedule's drafting passes: it runs passes start .. start + count - 1.
    A drafter's rows run with adapters off, a rider's with its own adapter. A prompt computes its prompt in pass
    `start` (adapter on), then drafts from its first token (`drafts`) or rides. `base`: the position of its last
    token at entry."""

    seq: Sequence
    kind: str  # "draft", "ride" or "prompt"
    start: int
    count: int
    base: int
    left: int = 0  # tokens it may still generate (riders and prompts)
    drafts: bool = False  # a prompt that drafts (adapters off) in the passes after its own
    published: bool = False  # a prompt's first token went out before the cycle's end

    def runs(self, j: int) -> bool:
        return self.start <= j < self.start + self.count

    @property
    def adapter_on(self) -> bool:
        """Its rows after its first pass run with its adapter on (a rider's, a riding prompt's)."""
        return self.kind == "ride" or (self.kind == "prompt" and not self.drafts)


class DraftCycle:
    def __init__(self, runner, slots: AdapterSlots, commit: Commit, generator: torch.Generator,
                 max_model_len: int, counters: SpecStats, max_rows: int = 1024,
                 publish: Callable[[list[Sequence]], None] | None = None,
                 finish: Callable[[Sequence], None] | None = None, pass_tokens: int | None = None):
        """max_rows: the most sequences one pass can hold (the scheduler's max_num_seqs). publish: hands a
        prompt's first token out before the cycle ends; finish: returns an ended sequence to the scheduler.
        pass_tokens: the most tokens a pass takes prompts up to (the largest CUDA graph; None: no limit)."""
        self.runner, self.slots, self.commit, self.generator = runner, slots, commit, generator
        self.pass_tokens = pass_tokens
        self.max_model_len = max_model_len
        self.counters = counters
        self.max_rows = max_rows
        self.publish = publish or (lambda seqs: None)
        self.finish = finish or (lambda seq: None)
        self.clock = PassClock(generator.device)

    def run(self, plan: Plan, join: Callable[[], list[Sequence]] | None = None) -> StepResult:
        """`join`: admits requests that arrived meanwhile into the batch (plan.seqs) and returns them."""
        drafters = [s for s in plan.seqs if plan.lengths.get(id(s), 0) > 0]
        prompts = [s for s in plan.seqs if s.is_prefill]
        if join is not None:
            join = self._counting(join)
        if drafters and all(s.params.greedy for s in drafters + plan.riders + prompts):
            self.counters.greedy_cycles += 1
            result = self._greedy(plan, drafters, prompts, join)
        else:
            result = self._sampled(plan, drafters, prompts, join)
        self.counters.cycle_passes[len(result.passes) - 1] += 1
        return result

    def _counting(self, join: Callable[[], list[Sequence]]) -> Callable[[], list[Sequence]]:
        def counted() -> list[Sequence]:
            joined = join()
            self.counters.joined += len(joined)
            return joined

        return counted

    def _fitting(self, queue: list[Sequence], used: int, first: bool = False, paced: set[int] | None = None,
                 later: int = 0) -> list[Sequence]:
        """Take from the front of `queue` (arrival order) the prompts that fit a pass already holding `used`
        tokens within pass_tokens; with `first` (a cycle's first pass) its first prompt whatever its size. `later`:
        prompt tokens the passes after this one can still take (to the next step's first pass); a queue that
        outgrows this pass's room and theirs is taken whole. The ones left go into `paced` (ids)."""
        needs = [s.num_tokens - s.num_computed for s in queue]
        count = len(queue)
        if self.pass_tokens is not None and sum(needs) <= self.pass_tokens - used + later:
            for i, need in enumerate(needs):
                if used + need > self.pass_tokens and not (first and i == 0):
                    count = i
                    break
                used += need
        taken, queue[:] = queue[:count], queue[count:]
        if paced is not None:
            paced.update(id(s) for s in queue)
        return taken

    def _room(self, rows: int) -> int:
        """Prompt tokens a pass of `rows` decoding rows has room for within pass_tokens."""
        return max(0, self.pass_tokens - rows) if self.pass_tokens is not None else 0

    def _work(self, s: Sequence, extra: list[int] = (), num_logits: int = 1) -> SeqWork:
        return s.work(self.slots.lora_slot(s.adapter), extra, num_logits)

    def _row_work(self, s: Sequence, position: int, token: int, adapter_on: bool) -> SeqWork:
        """One decoding row: `token` at `position`; adapters off for a drafter, its own adapter for a rider (none
        for a base-only one)."""
        slot = self.slots.lora_slot(s.adapter) if adapter_on else self.slots.zero_slot
        return SeqWork([token], position, s.block_table, slot)

    # ------------------------------------------------------------ pass by pass
    def _sampled(self, plan: Plan, drafters: list[Sequence], prompts: list[Sequence], join) -> StepResult:
        result = StepResult()
        lengths = dict(plan.lengths)
        planned = max(lengths.values(), default=0)
        begin = {id(s): 0 for s in drafters}  # each drafter's first drafting pass
        drafters = list(drafters)
        drafts: dict[int, list[int]] = {id(s): [] for s in drafters}
        qs: dict[int, list[torch.Tensor]] = {id(s): [] for s in drafters}
        riders, queue = list(plan.riders), list(prompts)  # queue: prompts waiting for a pass with room
        paced: set[int] = set()
        for j in range(planned):
            if j and join is not None:
                queue += join()  # arrivals: their prompts run in this pass, if it has room
            active = [s for s in drafters if begin[id(s)] <= j < begin[id(s)] + lengths[id(s)]]
            riders = [s for s in riders if not s.finished]
            used = len(active) + len(riders)
            starting = self._fitting(queue, used, j == 0, paced, self._room(used) * (planned - j))
            riders += starting
            work = [self._row_work(s, s.num_tokens - 1 + j - begin[id(s)],
                                   s.token_ids[-1] if j == begin[id(s)] else drafts[id(s)][-1], False) for s in active]
            work += [self._work(s) for s in riders]
            riding = _distinct(riders)
            start = time.perf_counter()
            logits = self.runner.run(work, self.slots, use_lora=riding > 0)
            self._propose(active, logits[: len(active)], drafts, qs)
            self._ride(riders, logits[len(active):])
            kind = "prompted" if starting else "base"
            result.passes.append((kind, sum(len(w.token_ids) for w in work), riding, time.perf_counter() - start))
            self.counters.draft_passes += 1
            self.counters.ridden_prompts += len(starting)
            self.publish([s for s in starting if not s.finished])
            for s in starting:  # from its first token on, a prompt drafts in the passes left, unless it rides
                m = min(planned - j - 1, s.tokens_left(self.max_model_len) - 1, plan.prompt_drafts(s))
                if not s.finished and m > 0:
                    riders.remove(s)
                    drafters.append(s)
                    begin[id(s)], lengths[id(s)], drafts[id(s)], qs[id(s)] = j + 1, m, [], []
        if join is not None:
            queue += join()  # arrivals after the last drafting pass: their prompts run in the verify pass

        waiting = {id(s) for s in queue}
        live = [s for s in plan.seqs if not s.finished and id(s) not in waiting]
        work = [self._work(s, drafts.get(id(s), []), len(drafts.get(id(s), [])) + 1) for s in live]
        fitting = self._fitting(queue, sum(len(w.token_ids) for w in work), False, paced,
                                self._room(len(live)))  # the rest: next step
        self.counters.paced_prompts += len(paced)
        live += fitting
        work += [self._work(s) for s in fitting]
        kind = _verify_kind(live)
        start = time.perf_counter()
        logits = self.runner.run(work, self.slots)
        self._settle(live, work, logits, drafts, qs, logits.argmax(dim=-1).tolist(), result)
        result.passes.append((kind, sum(len(w.token_ids) for w in work), _distinct(live), time.perf_counter() - start))
        return result

    def _propose(self, seqs: list[Sequence], logits: torch.Tensor, drafts: dict, qs: dict) -> None:
        if not seqs:
            return
        params = [s.params for s in seqs]
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            q = probabilities(logits[sampled], [params[i] for i in sampled])
            tokens[sampled] = draw(q, [seqs[i].generator for i in sampled], self.generator)
            for i, row in zip(sampled, q):
                qs[id(seqs[i])].append(row)
        for s, t in zip(seqs, tokens.tolist()):
            drafts[id(s)].append(t)

    def _ride(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Riders: a drafting pass is their own model (the base, or their adapter on), so its token is final."""
        if not seqs:
            return
        tokens = sample(logits, [s.params for s in seqs], [s.generator for s in seqs], self.generator, seqs)
        for s, t, row in zip(seqs, tokens.tolist(), logits):
            s.num_computed = s.num_tokens
            self.commit(s, t, row)

    # ------------------------------------------------------------ one host sync
    @torch.inference_mode()
    def _greedy(self, plan: Plan, drafters: list[Sequence], prompts: list[Sequence], join) -> StepResult:
        """Positions and KV slots of every pass are known when it is queued; only token ids are not, so each
        pass's argmax goes into `tokens` (pass j's rows from j * max_rows) on the device and the next pass (and
        the verify pass) gather their input ids from it. The host reads drafts and verify argmaxes once, at the
        end, and a prompt's first token once the pass that computed it is done."""
        lengths, slots, width = plan.lengths, self.slots, self.max_rows
        planned = max(lengths[id(s)] for s in drafters)
        members = [_Member(s, "draft", 0, lengths[id(s)], s.num_tokens - 1) for s in drafters]
        # Riders and prompts: every pass unless a length limit comes first. Stops (EOS, stop strings) show only
        # when the host reads the tokens: a rider that stopped keeps computing to the end of the cycle, into
        # positions its lookahead blocks hold, and those tokens are dropped.
        for s in plan.riders:
            left = s.tokens_left(self.max_model_len)
            members.append(_Member(s, "ride", 0, min(planned, left), s.num_tokens - 1, left))
        queue = list(prompts)  # prompts waiting for a pass with room (pass_tokens), in arrival order
        paced: set[int] = set()  # the ones that waited
        late: list[Sequence] = []  # sampled arrivals: they can only run in the verify pass
        ended: list[Sequence] = []  # prompts that ended on a first token read during the cycle
        rows: list[dict[int, int]] = []  # per pass: id(seq) -> its row

        def at(s: Sequence, j: int) -> int:  # where pass j's argmax for s lands in `tokens`
            return j * width + rows[j][id(s)]

        tokens = torch.empty(planned * width, dtype=torch.long, device=self.generator.device)
        kept = []  # per pass, its logits (kept only for riders returning logits): the graph's buffer is reused
        info = []  # per pass: (kind, tokens, adapters it reads)
        passes = planned
        self.clock.mark()
        for j in range(planned):
            if j and join is not None:
                self.clock.wait(j - 1)  # pass j - 2 done: pass j - 1 keeps the device busy meanwhile
                if j >= 2:
                    self._first_tokens(members, j - 2, tokens, at, rows, kept, ended)
                for s in join():
                    (queue if s.params.greedy else late).append(s)
                if late:  # a sampled arrival: drafting stops here, its prompt runs in the verify pass
                    passes = j
                    self.counters.cut_cycles += 1
                    break
            used = sum(m.runs(j) for m in members)
            taken = self._fitting(queue, used, j == 0, paced, self._room(used) * (planned - j))
            members += [self._prompt_member(plan, s, j, planned) for s in taken]
            active = [m for m in members if m.runs(j)]
            if len(active) > width:
                raise RuntimeError(f"a drafting pass of {len(active)} rows exceeds max_rows {width}")
            rows.append({id(m.seq): i for i, m in enumerate(active)})
            work, src, adapters_on, prompted = [], [], set(), 0
            for m in active:
                s = m.seq
                prefill = m.kind == "prompt" and j == m.start
                if prefill:
                    work.append(self._work(s))  # the prompt, adapter on: one logits row, its first token
                    src += [-1] * len(work[-1].token_ids)
                    prompted += 1
                else:
                    first = j == m.start  # a drafter's or rider's first pass reads its last committed token
                    work.append(self._row_work(s, m.base + j - m.start, s.token_ids[-1] if first else 0,
                                               m.adapter_on))
                    src.append(-1 if first else at(s, j - 1))
                if (prefill or m.adapter_on) and s.adapter is not None:
                    adapters_on.add(s.adapter)
            logits = self.runner.run(work, slots, use_lora=bool(adapters_on), tokens=tokens, owned=False,
                                     token_src=src if j else None)
            torch.argmax(logits, dim=-1, out=tokens[j * width : j * width + len(active)])
            keep = any(m.kind != "draft" and m.seq.params.return_logits for m in active)  # riders, prompts
            kept.append(logits.clone() if keep else None)
            self.clock.mark()
            self.counters.draft_passes += 1
            self.counters.ridden_prompts += prompted
            info.append(("prompted" if prompted else "base", sum(len(w.token_ids) for w in work), len(adapters_on)))
        else:
            if join is not None:
                self.clock.wait(max(0, planned - 1))
                if planned >= 2:
                    self._first_tokens(members, planned - 2, tokens, at, rows, kept, ended)
                queue += join()  # their prompts run in the verify pass, if it has room
        for m in members:  # cut short: each keeps what the passes run so far computed for it
            m.count = max(0, min(m.count, passes - m.start))
        ending = {id(s) for s in ended}
        done = {id(m.seq) for m in members if m.kind != "draft" and (m.count == m.left or id(m.seq) in ending)}
        # plan.seqs holds the arrivals too (Scheduler.admit); prompts not run yet join the verify pass if it has
        # room (sampled arrivals first: the drafting passes stopped for them), the rest are computed next step
        pending = late + queue
        waiting = {id(s) for s in pending}
        live = [s for s in plan.seqs if id(s) not in done and id(s) not in waiting]
        at_verify = {id(m.seq): m for m in members if m.count}
        verify, src = [], []

        def verified(s: Sequence) -> None:  # s's rows of the verify pass, and where their input ids come from
            m = at_verify.get(id(s))
            if m is not None and m.drafts and m.count > 1:  # a prompt's [first token, d1..dm] after its prompt
                d = m.count - 1
                verify.append(SeqWork([0] * (d + 1), m.base + 1, s.block_table, slots.lora_slot(s.adapter), d + 1))
                src.extend(at(s, m.start + i) for i in range(d + 1))
            elif m is not None and m.kind != "draft":  # one more plain step, after the token of its last pass
                verify.append(self._row_work(s, m.base + m.count, 0, True))
                src.append(at(s, m.start + m.count - 1))
            else:  # a drafter: [last, d1..dm]; prompts and the rest: their plain step
                d = m.count if m is not None else 0
                verify.append(self._work(s, [0] * d, d + 1))
                src.extend([-1] * (len(verify[-1].token_ids) - d) + [at(s, j) for j in range(d)])

        for s in live:
            verified(s)
        fitting = self._fitting(pending, len(src), False, paced, self._room(len(live)))  # the rest: next step
        for s in fitting:
            verified(s)
        live += fitting
        self.counters.paced_prompts += len(paced)
        kind = _verify_kind(live)
        logits = self.runner.run(verify, slots, tokens=tokens, token_src=src, owned=False)
        targets = torch.argmax(logits, dim=-1)
        self.clock.mark()
        if passes:  # first tokens of the last drafting pass, before the verify pass ends
            self._first_tokens(members, passes - 1, tokens, at, rows, kept, ended)
        host = torch.cat([tokens[: passes * width], targets]).tolist()  # the cycle's one host sync
        spans = self.clock.spans()

        ending = {id(s) for s in ended}
        for m in members:  # riders and prompts: a token from each of their passes (a drafting prompt: its first)
            if m.kind == "draft":
                continue
            s = m.seq
            for j in range(m.start + m.published, m.start + (1 if m.drafts else m.count)):
                if s.finished or id(s) in ending:
                    break
                s.num_computed = s.num_tokens
                self.commit(s, host[at(s, j)], kept[j][rows[j][id(s)]] if s.params.return_logits else None)
        for s in ended:
            self.finish(s)
        drafts = {id(m.seq): [host[at(m.seq, j)] for j in range(m.count)] for m in members if m.kind == "draft"}
        drafts |= {id(m.seq): [host[at(m.seq, m.start + i)] for i in range(1, m.count)]
                   for m in members if m.drafts and m.count > 1 and id(m.seq) not in ending}
        result = StepResult(passes=[(k, n, d, span) for (k, n, d), span in zip(info[:passes], spans)])
        self._settle(live, verify, logits, drafts, {}, host[passes * width :], result)
        result.passes.append((kind, sum(len(w.token_ids) for w in verify), _distinct(live), spans[-1]))
        return result

    def _prompt_member(self, plan: Plan, s: Sequence, j: int, planned: int) -> _Member:
        """A prompt joining the one-sync schedule at pass j: its prompt runs there; it then drafts in the passes
        left (at most its tokens to go less its first and the verify pass's token), or rides them."""
        left = s.tokens_left(self.max_model_len)
        drafts = min(planned - j - 1, left - 2, plan.prompt_drafts(s))
        if drafts > 0:
            return _Member(s, "prompt", j, 1 + drafts, s.num_tokens - 1, left, drafts=True)
        return _Member(s, "prompt", j, min(planned - j, left), s.num_tokens - 1, left)

    def _first_tokens(self, members: list[_Member], j: int, tokens: torch.Tensor, at, rows: list[dict[int, int]],
                      kept: list, ended: list[Sequence]) -> None:
        """Commit and publish the first token of each prompt computed in pass j, which the device has run (passes
        queued after it may still be running: the read waits for pass j alone)."""
        firsts = [m for m in members if m.kind == "prompt" and m.start == j and m.count and not m.published]
        if not firsts:
            return
        values = self.clock.read_after(j + 1, tokens, [at(m.seq, j) for m in firsts])
        out = []
        for m, token in zip(firsts, values):
            s, m.published = m.seq, True
            s.num_computed = s.num_tokens
            row = kept[j][rows[j][id(s)]] if s.params.return_logits else None
            if self.commit(s, token, row, False):
                ended.append(s)  # finished on its first token: back to the scheduler after the sync
            else:
                out.append(s)
        self.publish(out)

    # ------------------------------------------------------------ verify
    def _settle(self, live: list[Sequence], work: list[SeqWork], logits: torch.Tensor, drafts: dict, qs: dict,
                targets: list[int], result: StepResult) -> None:
        """Commit each sequence's tokens from the verify pass. `targets`: the argmax of every verify row, on the
        host. Sequences without drafts (prefills, riders, adapters that drafted nothing) take a plain step's
        token; greedy drafts are accepted while they equal the target's argmax, sampled ones by rejection
        sampling against their draft distributions (`verify_drafts`). Sequences already finished (a rider that
        stopped during the drafting passes) take nothing."""
        ends = list(itertools.accumulate(w.num_logits for w in work))
        starts = [end - w.num_logits for end, w in zip(ends, work)]
        plain = [i for i, s in enumerate(live) if not drafts.get(id(s)) and not s.finished]
        if plain:
            rows = [ends[i] - 1 for i in plain]
            if all(live[i].params.greedy for i in plain):
                tokens = [targets[r] for r in rows]
            else:
                tokens = sample(logits[rows], [live[i].params for i in plain], [live[i].generator for i in plain],
                                self.generator, [live[i] for i in plain]).tolist()
            for i, r, token in zip(plain, rows, tokens):
                live[i].num_computed = live[i].num_tokens
                self.commit(live[i], token, logits[r] if live[i].params.needs_rows else None)
        sampled = [i for i, s in enumerate(live) if drafts.get(id(s)) and not s.params.greedy]
        probs = {}
        if sampled:  # target distributions p for every verified position, in one call
            rows = [r for i in sampled for r in range(starts[i], ends[i])]
            params = [live[i].params for i in sampled for _ in range(work[i].num_logits)]
            p_all = probabilities(logits[rows], params)
            for i, offset in zip(sampled, itertools.accumulate((work[i].num_logits for i in sampled), initial=0)):
                probs[i] = p_all[offset : offset + work[i].num_logits]
        for i, s in enumerate(live):
            d = drafts.get(id(s))
            if not d:
                continue
            if i in probs:
                tokens = verify_drafts(probs[i], torch.stack(qs[id(s)]), d, s.generator, self.generator)
            else:
                tokens = accept_greedy(d, targets[starts[i] : ends[i]])
            rows = logits[starts[i] : ends[i]] if s.params.return_logits else None
            self._commit_run(s, tokens, len(d), rows)
            result.verifies.append((s.adapter, len(d), len(tokens) - 1))

    def _commit_run(self, s: Sequence, tokens: list[int], drafted: int, rows: torch.Tensor | None) -> None:
        """Commit the accepted drafts and the target's token, stopping where the sequence ends. rows: the verify
        logits, for a request that returns them."""
        accepted = len(tokens) - 1
        s.num_computed = s.num_tokens  # the verify pass wrote final KV for `last`...
        for i, t in enumerate(tokens):
            if self.commit(s, t, None if rows is None else rows[i]):
                return
            if i < accepted:  # ...and for each accepted draft; the target's own token is not in the cache yet
                s.num_computed += 1


def _distinct(seqs: list[Sequence]) -> int:
    return len({s.adapter for s in seqs if s.adapter is not None})


def _verify_kind(live: list[Sequence]) -> str:
    """How the verify pass is reported: "lora", or "prompted" when prompts ran in it too, which the gate does not
    price draft lengths by: a prompt token costs more than a verify token, and the step pays for its prompts
    whatever it drafts (as a plain step with prompts in it prices no plain decoding)."""
    return "prompted" if any(s.is_prefill for s in live) else "lora"
