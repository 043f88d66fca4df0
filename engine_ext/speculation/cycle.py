"""One speculative cycle: LoRA-off drafting passes, one adapter-on verify pass, settling.

The base model (every adapter switched off) drafts up to m tokens for each adapter sequence in up to
M = max m batched passes, writing its KV into the sequence's own paged cache; then one adapter-on pass over
[last, d1..dm] verifies them, overwriting the drafted positions' KV with the adapter-conditioned values
before anything reads them. The scheduler releases rejected positions by truncating the block table. A
rider needs no verification: each drafting pass is an exact decoding step for it. Riders are the base-only
sequences and the adapter sequences the gate lets ride (`Gate.rides`), whose rows in the drafting passes run
with their adapter on (a pass with such rows is a mixed one: adapters off for the drafters, on for them).

Two schedules, because sampled drafts are drawn on the host between passes (each request's own generator)
while greedy drafts are an argmax the next pass can read on the device: a cycle whose drafters and riders
are all greedy queues every pass back to back with one host sync at the end (`_greedy`); otherwise each
pass syncs (`_sampled`). Both settle through the same verify routine (`_settle`).

Requests that arrive while a cycle drafts do not wait for it to end: given a `join` (a serving loop takes
arrivals in), the cycle asks it before each drafting pass after the first and before the verify pass; when it
admits any, drafting stops there and their prompts join the verify pass, so a first token waits about one pass
rather than a cycle. The greedy schedule then keeps at most two passes queued ahead of the device (it waits for
pass j - 2 before queuing pass j), so the check sees arrivals while the device is still busy."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import torch

from ..adapter_slots import AdapterSlots
from ..batch import SeqWork
from ..sampler import draw, probabilities, sample
from ..sequence import Sequence
from ..stats import SpecStats
from .cost import PassClock
from .gate import Plan, StepResult
from .verify import accept_greedy, verify_drafts

# commit(seq, token, logits row or None) -> True when the sequence finished on that token
Commit = Callable[[Sequence, int, torch.Tensor | None], bool]


class DraftCycle:
    def __init__(self, runner, slots: AdapterSlots, commit: Commit, generator: torch.Generator,
                 max_model_len: int, counters: SpecStats):
        self.runner, self.slots, self.commit, self.generator = runner, slots, commit, generator
        self.max_model_len = max_model_len
        self.counters = counters
        self.clock = PassClock(generator.device)

    def run(self, plan: Plan, join: Callable[[], list[Sequence]] | None = None) -> StepResult:
        """`join`: admits requests that arrived meanwhile into the batch (plan.seqs) and returns them."""
        drafters = [s for s in plan.seqs if plan.lengths.get(id(s), 0) > 0]
        if join is not None:
            join = self._counting(join)
        if drafters and all(s.params.greedy for s in drafters + plan.riders):
            self.counters.greedy_cycles += 1
            result = self._greedy(plan, drafters, join)
        else:
            result = self._sampled(plan, drafters, join)
        self.counters.cycle_passes[sum(p[0] == "base" for p in result.passes)] += 1
        return result

    def _counting(self, join: Callable[[], list[Sequence]]) -> Callable[[], list[Sequence]]:
        def counted() -> list[Sequence]:
            joined = join()
            self.counters.joined += len(joined)
            return joined

        return counted

    def _work(self, s: Sequence, extra: list[int] = (), num_logits: int = 1) -> SeqWork:
        return s.work(self.slots.lora_slot(s.adapter), extra, num_logits)

    def _draft_work(self, s: Sequence, j: int, token: int, rider: bool = False) -> SeqWork:
        """Drafting pass j's input for s: `token` (the last committed one at j = 0) at position num_tokens - 1 + j;
        a drafter's row runs with adapters off, a rider's with its own adapter (none for a base-only one)."""
        slot = self.slots.lora_slot(s.adapter) if rider else self.slots.zero_slot
        return SeqWork([token], s.num_tokens - 1 + j, s.block_table, slot)

    # ------------------------------------------------------------ pass by pass
    def _sampled(self, plan: Plan, drafters: list[Sequence], join) -> StepResult:
        result = StepResult()
        lengths = plan.lengths
        drafts: dict[int, list[int]] = {id(s): [] for s in drafters}
        qs: dict[int, list[torch.Tensor]] = {id(s): [] for s in drafters}
        for j in range(max(lengths.values(), default=0)):
            if j and join is not None and join():
                self.counters.cut_cycles += 1
                break  # arrivals: their prompts join the verify pass now
            active = [s for s in drafters if lengths[id(s)] > j]
            riders = [s for s in plan.riders if not s.finished]
            work = [self._draft_work(s, j, s.token_ids[-1] if j == 0 else drafts[id(s)][-1]) for s in active]
            work += [self._work(s) for s in riders]
            riding = _distinct(riders)
            start = time.perf_counter()
            logits = self.runner.run(work, self.slots, use_lora=riding > 0)
            self._propose(active, logits[: len(active)], drafts, qs)
            self._ride(riders, logits[len(active):])
            result.passes.append(("base", len(work), riding, time.perf_counter() - start))
            self.counters.draft_passes += 1
        if join is not None:
            join()

        live = [s for s in plan.seqs if not s.finished]
        work = [self._work(s, drafts.get(id(s), []), len(drafts.get(id(s), [])) + 1) for s in live]
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
    def _greedy(self, plan: Plan, drafters: list[Sequence], join) -> StepResult:
        """Positions and KV slots of every pass are known up front; only token ids are not, so each pass's argmax
        goes into `tokens` on the device and the next pass (and the verify pass) gather their input ids from
        it. The host reads drafts and verify argmaxes once, at the end."""
        lengths, riders, slots = plan.lengths, plan.riders, self.slots
        planned = max(lengths[id(s)] for s in drafters)
        # Drafting passes per sequence: its draft length; for a rider, every pass unless a length limit comes
        # first. Stops (EOS, stop strings) show only after the sync: a rider that stopped keeps computing to the
        # end of the cycle, into positions its lookahead blocks hold, and those tokens are dropped.
        left = {id(s): s.tokens_left(self.max_model_len) for s in riders}
        count = {id(s): lengths[id(s)] for s in drafters} | {id(s): min(planned, left[id(s)]) for s in riders}
        members = sorted(drafters + riders, key=lambda s: -count[id(s)])  # pass j runs members[:sizes[j]]
        sizes = [sum(count[id(s)] > j for s in members) for j in range(planned)]
        offsets = list(itertools.accumulate(sizes, initial=0))
        row = {id(s): i for i, s in enumerate(members)}
        riding = {id(s) for s in riders}
        adapters_in = [len({s.adapter for s in members[:n] if id(s) in riding and s.adapter is not None})
                       for n in sizes]  # distinct riding adapters each pass reads

        def at(s: Sequence, j: int) -> int:  # where pass j's argmax for s lands in `tokens`
            return offsets[j] + row[id(s)]

        tokens = torch.empty(offsets[-1], dtype=torch.long, device=self.generator.device)
        want_rows = any(s.params.return_logits for s in riders)
        kept = []  # per pass, its logits (only for riders returning logits): the graph's buffer is reused
        passes = planned
        self.clock.mark()
        for j in range(planned):
            if j and join is not None:
                self.clock.wait(j - 1)  # pass j - 2 done: pass j - 1 keeps the device busy meanwhile
                if join():
                    passes = j  # arrivals: drafting stops here, their prompts join the verify pass
                    self.counters.cut_cycles += 1
                    break
            active = members[: sizes[j]]
            work = [self._draft_work(s, j, s.token_ids[-1] if j == 0 else 0, id(s) in riding) for s in active]
            logits = self.runner.run(work, slots, use_lora=adapters_in[j] > 0, tokens=tokens, owned=False,
                                     token_src=[at(s, j - 1) for s in active] if j else None)
            torch.argmax(logits, dim=-1, out=tokens[offsets[j] : offsets[j + 1]])
            kept.append(logits.clone() if want_rows else None)
            self.clock.mark()
            self.counters.draft_passes += 1
        else:
            if join is not None:
                self.clock.wait(max(0, planned - 1))
                join()
        if passes < planned:  # cut short: each sequence keeps what the passes run so far drafted for it
            count = {key: min(c, passes) for key, c in count.items()}
        done = {id(s) for s in riders if count[id(s)] == left[id(s)]}  # finished by length in the passes
        live = [s for s in plan.seqs if id(s) not in done]  # the verify pass: m + 1 logits for a drafter, else 1
        verify, src = [], []
        for s in live:
            if id(s) in riding:  # one more plain step, after the token of its last pass
                verify.append(self._draft_work(s, passes, 0, rider=True))
                src.append(at(s, passes - 1))
                continue
            m = count.get(id(s), 0)  # a drafter: [last, d1..dm]; prompts and undrafted adapters: their plain step
            verify.append(self._work(s, [0] * m, m + 1))
            src += [-1] * (len(verify[-1].token_ids) - m) + [at(s, j) for j in range(m)]
        kind = _verify_kind(live)
        logits = self.runner.run(verify, slots, tokens=tokens, token_src=src, owned=False)
        targets = torch.argmax(logits, dim=-1)
        self.clock.mark()
        host = torch.cat([tokens[: offsets[passes]], targets]).tolist()  # the cycle's one host sync
        spans = self.clock.spans()

        for s in riders:  # a token from each of its passes
            for j in range(count[id(s)]):
                if s.finished:
                    break
                s.num_computed = s.num_tokens
                self.commit(s, host[at(s, j)], kept[j][row[id(s)]] if s.params.return_logits else None)
        drafts = {id(s): [host[at(s, j)] for j in range(count[id(s)])] for s in drafters}
        result = StepResult(passes=[("base", n, d, span) for n, d, span in zip(sizes[:passes], adapters_in, spans)])
        self._settle(live, verify, logits, drafts, {}, host[offsets[passes] :], result)
        result.passes.append((kind, sum(len(w.token_ids) for w in verify), _distinct(live), spans[-1]))
        return result

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
