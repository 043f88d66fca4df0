"""Speculative LoRA-off drafting.

One cycle: the base model (every adapter switched off) drafts up to k tokens for every adapter
sequence in up to k batched passes, writing its KV into each sequence's own paged cache; then one
adapter-on pass over [last, d1..dm] verifies all of them, overwriting the drafted positions' KV
with the adapter-conditioned values before anything else reads them. Rejected positions are
released by truncating the block table. Base-only sequences need no verification: each drafting
pass is an exact decoding step for them, so they commit a token from every pass.

When every drafting sequence and every base-only rider is greedy, the cycle makes one host sync
instead of k + 1: each pass's argmax is written to a device buffer that the next pass (and the
verify pass) read their input ids from, so all passes are queued back to back (`_greedy_cycle`).
Sampled requests in the batch keep the pass-by-pass cycle (`_cycle`), where drafts are drawn on
the host side of each pass.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter

import torch

from .batch import SeqWork
from .config import SpecConfig
from .sampler import draw, probabilities, sample
from .sequence import Sequence
from .spec_gate import Gate, PassClock


def acceptance_probability(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Accept a drafted token d with probability min(1, p(d) / q(d))."""
    return torch.clamp(p / q, max=1.0)


def verify_drafts(p: torch.Tensor, q: torch.Tensor | None, drafts: list[int],
                  generator: torch.Generator | None, default: torch.Generator) -> list[int]:
    """Tokens to commit: the accepted prefix of `drafts` plus one token from the target.

    p: [m+1, V] target distributions after last, d1..dm (greedy: target logits); q: [m, V] draft
    distributions (None: greedy). Greedy accepts while d_i == argmax p_i. Sampling accepts d_i with
    probability min(1, p_i(d_i) / q_i(d_i)); on the first rejection it draws from
    normalize(max(0, p_i - q_i)), so every committed token is distributed exactly as under p."""
    if q is None:
        return accept_greedy(drafts, p.argmax(dim=-1).tolist())
    gen = generator or default
    u = torch.rand(len(drafts), generator=gen, device=p.device)
    for i, d in enumerate(drafts):
        if u[i] >= acceptance_probability(p[i, d], q[i, d]):
            residual = torch.clamp(p[i] - q[i], min=0.0)
            residual = residual if residual.sum() > 0 else p[i]
            token = draw((residual / residual.sum())[None], [generator], default)
            return drafts[:i] + [int(token)]
    return drafts + [int(draw(p[len(drafts)][None], [generator], default))]


def accept_greedy(drafts: list[int], target: list[int]) -> list[int]:
    """target[i] = argmax of the target after last, d1..di: keep drafts while they agree, then the target's own."""
    n = 0
    while n < len(drafts) and drafts[n] == target[n]:
        n += 1
    return drafts[:n] + [target[n]]


class Speculator:
    def __init__(self, engine, cfg: SpecConfig):
        self.engine = engine
        self.cfg = cfg
        self.lookahead = cfg.num_draft_tokens
        self.gate = Gate(cfg)
        self.clock = PassClock(engine.device)
        self.cycles = self.plain_steps = self.draft_passes = 0
        self.greedy_cycles = 0  # cycles that took the one-sync path
        self.cycle_passes: Counter[int] = Counter()  # cycles by their number of drafting passes
        self._capture_pending = False  # this step may capture the runner's CUDA graphs (see _record)
        self._reserve = True  # reserve drafting room at the next schedule (see step)
        self._hold, self._hold_names = 0, []  # plain steps left without re-pricing, and for which batch (see step)
        # What this step records for the gate once the engine reports the whole step's wall time (step_done):
        # (kind, tokens, adapters, seconds of it already recorded as passes)
        self._pending: tuple[str, int, int, float] | None = None

    # ------------------------------------------------------------ one engine step
    def step(self) -> list[Sequence]:
        e = self.engine
        # Drafting room (lookahead blocks) is reserved unless the previous step found every adapter gated off:
        # then this step is plain whatever happens, and only a step that could draft reserves again.
        lookahead = self.lookahead if self._reserve else 0
        batch = e.scheduler.schedule(lookahead=lookahead)
        if batch.empty:
            return []
        self._capture_pending = self._capturing()
        decoding = [s for s in batch.seqs if not s.is_prefill]
        lora_seqs = [s for s in decoding if s.adapter is not None]
        base_seqs = [s for s in decoding if s.adapter is None]
        names = [s.adapter for s in lora_seqs]
        speculate = False
        if self.gate.gated_off(names):  # the fast path of a batch whose adapters all draft nothing
            self.gate.count("plain_low_acceptance", "every adapter's acceptance is below the drafting threshold")
            self._reserve = False
        elif lora_seqs and self._hold and names == self._hold_names and not self.gate.probe_due():
            # the cost model chose plain by a wide margin for this very batch: plain again without re-pricing
            self._hold -= 1
            self.gate.count("plain_hold", "a recent cost decision chose plain for this batch by a wide margin")
            self._reserve = not self._hold
        elif lora_seqs and not lookahead:
            self.gate.count("plain_unreserved", "no drafting room reserved this step (all were gated off)")
            self._reserve = True
        elif lora_seqs:
            caps = [self._cap(s) for s in lora_seqs]
            # Nothing waiting: the batch is closed, and the gate prices the time to finish it (Gate.draft_lengths)
            left = None if e.scheduler.waiting else [self._left(s) for s in lora_seqs]
            lengths = self.gate.draft_lengths(names, caps, len(decoding), left)
            speculate = self.gate.decide(names, lengths, len(base_seqs), caps, left)
            # Plain by a wide margin: the next steps of this batch are plain without the cost model or drafting
            # room (those took 0.25 ms of host time a step at batch 32 on the 2-core development machine).
            self._hold, self._hold_names = (0 if speculate else self.gate.hold_steps()), names
            self._reserve = not self._hold
        if speculate:
            self.cycles += 1
            self.gate.note_step(names, lengths)
            self._cycle(batch.seqs, dict(zip(map(id, lora_seqs), lengths)), base_seqs)
        else:
            self.plain_steps += 1
            self.gate.note_step(names, None)
            e.run_plain(batch.seqs)
            # A plain step prices plain decoding: one with prompts in it is not recorded (priced at its token count,
            # a prefill step served as the nearest "plain" measurement and made plain decoding look 5-10x slower
            # than it is, so a cold gate never measured it and speculated where plain was faster).
            if len(decoding) == len(batch.seqs):
                self._pending = ("plain", len(decoding), len(set(names)), 0.0)
        if lookahead:
            for s in batch.seqs:  # give back the lookahead blocks nothing was written to
                if not s.finished:
                    e.blocks.truncate(s.block_table, s.num_tokens)
        return batch.seqs

    def step_done(self, seconds: float) -> None:
        """The engine's whole step took `seconds` (scheduling and output processing included, which a plain step
        pays per token and a cycle once per cycle): a plain step is recorded at that time, a cycle's overhead
        as what its recorded passes leave of it."""
        if self._pending is None:
            return
        kind, tokens, adapters, passes = self._pending
        self._pending = None
        self._record(kind, tokens, adapters, max(0.0, seconds - passes))

    def _capturing(self) -> bool:
        """True until the runner's CUDA graphs are captured (on its first forward)."""
        graphs = self.engine.runner.graphs
        return graphs is not None and graphs.capture_seconds is None

    def _record(self, kind: str, tokens: int, adapters: int, seconds: float) -> None:
        """A pass time for the gate, unless this step captured the CUDA graphs (seconds: no measurement)."""
        if not (self._capture_pending and not self._capturing()):
            self.gate.times.record(kind, tokens, adapters, seconds)

    def _cap(self, s: Sequence) -> int:
        """Longest useful draft: every accepted token plus the target's own must fit max_tokens. Requests whose
        params rule drafting out (SamplingParams.can_draft) draft nothing: the verify pass is their plain step."""
        if not s.params.can_draft:
            return 0
        return max(0, min(self.cfg.num_draft_tokens, self._left(s) - 1))

    def _left(self, s: Sequence) -> int:
        """Tokens the sequence may still generate before max_tokens or max_model_len ends it."""
        return min(s.params.max_tokens - len(s.output_token_ids), self.engine.max_model_len - s.num_tokens)

    # ------------------------------------------------------------ the cycle
    def _cycle(self, seqs: list[Sequence], lengths: dict[int, int], base_seqs: list[Sequence]):
        e = self.engine
        slots = e.adapters.slots
        drafters = [s for s in seqs if lengths.get(id(s), 0) > 0]
        self.cycle_passes[max(lengths.values(), default=0)] += 1
        if drafters and all(s.params.greedy for s in drafters + base_seqs):
            self.greedy_cycles += 1
            return self._greedy_cycle(seqs, lengths, drafters, base_seqs)
        drafts: dict[int, list[int]] = {id(s): [] for s in drafters}
        qs: dict[int, list[torch.Tensor]] = {id(s): [] for s in drafters}
        passes_wall = 0.0
        for j in range(max(lengths.values(), default=0)):
            active = [s for s in drafters if lengths[id(s)] > j]
            riders = [s for s in base_seqs if not s.finished]
            # Drafted positions: the last committed token (j = 0) or the previous draft, at num_tokens - 1 + j.
            work = [SeqWork([s.token_ids[-1] if j == 0 else drafts[id(s)][-1]], s.num_tokens - 1 + j, s.block_table,
                            slots.zero_slot) for s in active]
            work += [e.work_item(s) for s in riders]
            start = time.perf_counter()
            logits = e.runner.run(work, slots, use_lora=False)
            self._propose(active, logits[: len(active)], drafts, qs)
            self._ride(riders, logits[len(active):])
            self._record("base", len(work), 0, time.perf_counter() - start)
            passes_wall += time.perf_counter() - start
            self.draft_passes += 1

        live = [s for s in seqs if not s.finished]
        work = [e.work_item(s, drafts.get(id(s), []), len(drafts.get(id(s), [])) + 1) for s in live]
        start = time.perf_counter()
        logits = e.runner.run(work, slots)
        self._settle_all(live, work, logits, drafts, qs)
        # Time per pass size (prefill tokens included): the cost model compares passes by their token count.
        distinct = len({s.adapter for s in live if s.adapter is not None})
        self._record("lora", sum(len(w.token_ids) for w in work), distinct, time.perf_counter() - start)
        self._pending = ("overhead", len(seqs), 0, passes_wall + time.perf_counter() - start)

    @torch.inference_mode()
    def _greedy_cycle(self, seqs: list[Sequence], lengths: dict[int, int], drafters: list[Sequence],
                      riders: list[Sequence]):
        """`_cycle` for greedy drafters and riders, with one host sync. Positions and KV slots of every pass are
        known up front; only token ids are not, so each pass's argmax goes into `tokens` on the device and the
        next pass (and the verify pass) gather their input ids from it. The host reads drafts and verify
        argmaxes once, at the end, and settles exactly as `_cycle` does."""
        e, slots = self.engine, self.engine.adapters.slots
        passes = max(lengths[id(s)] for s in drafters)
        # Drafting passes per sequence: its draft length; for a rider, every pass unless a length limit comes
        # first. Stops (EOS, stop strings) show only after the sync: a rider that stopped keeps computing to the
        # end of the cycle, into positions its lookahead blocks hold, and those tokens are dropped.
        count = {id(s): lengths[id(s)] for s in drafters} | {id(s): min(passes, self._left(s)) for s in riders}
        members = sorted(drafters + riders, key=lambda s: -count[id(s)])  # pass j runs members[:sizes[j]]
        sizes = [sum(count[id(s)] > j for s in members) for j in range(passes)]
        offsets = list(itertools.accumulate(sizes, initial=0))
        row = {id(s): i for i, s in enumerate(members)}

        def at(s: Sequence, j: int) -> int:  # where pass j's argmax for s lands in `tokens`
            return offsets[j] + row[id(s)]

        done = {id(s) for s in riders if count[id(s)] == self._left(s)}  # finished by length in the passes
        live = [s for s in seqs if id(s) not in done]  # the verify pass: m + 1 logits for a drafter, else 1
        tokens = torch.empty(offsets[-1] + sum(lengths.get(id(s), 0) + 1 for s in live), dtype=torch.long,
                             device=e.device)

        want_rows = any(s.params.return_logits for s in riders)
        kept = []  # per pass, its logits (only for riders returning logits): the graph's buffer is reused
        self.clock.mark()
        for j in range(passes):
            active = members[: sizes[j]]
            work = [SeqWork([s.token_ids[-1] if j == 0 else 0], s.num_tokens - 1 + j, s.block_table, slots.zero_slot)
                    for s in active]
            logits = e.runner.run(work, slots, use_lora=False, tokens=tokens,
                                  token_src=[at(s, j - 1) for s in active] if j else None, owned=False)
            torch.argmax(logits, dim=-1, out=tokens[offsets[j] : offsets[j + 1]])
            kept.append(logits.clone() if want_rows else None)
            self.clock.mark()
            self.draft_passes += 1
        verify, src = [], []  # built while the drafting passes run
        riding = {id(s) for s in riders}
        for s in live:
            if id(s) in riding:  # one more plain step, after the token of its last pass
                verify.append(SeqWork([0], s.num_tokens - 1 + passes, s.block_table, slots.zero_slot))
                src.append(at(s, passes - 1))
                continue
            m = lengths.get(id(s), 0)  # a drafter: [last, d1..dm]; prefills and undrafted adapters: as in `_cycle`
            verify.append(e.work_item(s, [0] * m, m + 1))
            src += [-1] * (len(verify[-1].token_ids) - m) + [at(s, j) for j in range(m)]
        logits = e.runner.run(verify, slots, tokens=tokens, token_src=src, owned=False)
        torch.argmax(logits, dim=-1, out=tokens[offsets[-1] :])
        self.clock.mark()
        host = tokens.tolist()  # the cycle's one host sync
        spans = self.clock.spans()

        for s in riders:  # a token from each of its passes, as `_ride` commits them
            for j in range(count[id(s)]):
                if s.finished:
                    break
                s.num_computed = s.num_tokens
                e.commit(s, host[at(s, j)], kept[j][row[id(s)]] if s.params.return_logits else None)
        drafts = {id(s): [host[at(s, j)] for j in range(lengths[id(s)])] for s in drafters}
        self._settle_all(live, verify, logits, drafts, {}, targets=host[offsets[-1] :])

        # For the gate: each pass's device time, and the rest of the step's wall time once (spec_gate's docstring),
        # recorded when the engine reports it (step_done).
        for n, span in zip(sizes, spans):
            self._record("base", n, 0, span)
        distinct = len({s.adapter for s in live if s.adapter is not None})
        self._record("lora", sum(len(w.token_ids) for w in verify), distinct, spans[-1])
        self._pending = ("overhead", len(seqs), 0, sum(spans))

    def _settle_all(self, live: list[Sequence], work: list[SeqWork], logits: torch.Tensor, drafts: dict, qs: dict,
                    targets: list[int] | None = None):
        """Commit each sequence's tokens from the verify pass (batched where the math allows). `targets`: the
        argmax of every verify row, already on the host (greedy cycle). Sequences already finished (a rider
        that stopped during the drafting passes) take nothing."""
        e = self.engine
        ends = list(itertools.accumulate(w.num_logits for w in work))
        starts = [end - w.num_logits for end, w in zip(ends, work)]
        plain = [i for i, s in enumerate(live) if not drafts.get(id(s)) and not s.finished]
        if plain:  # prefills, base-only riders and gated-off adapters: a plain step each
            rows = [ends[i] - 1 for i in plain]
            if targets is not None and all(live[i].params.greedy for i in plain):
                tokens = [targets[r] for r in rows]
            else:
                tokens = sample(logits[rows], [live[i].params for i in plain], [live[i].generator for i in plain],
                                e.generator, [live[i] for i in plain]).tolist()
            for i, row, token in zip(plain, rows, tokens):
                live[i].num_computed = live[i].num_tokens
                e.commit(live[i], token, logits[row] if live[i].params.needs_rows else None)
        sampled = [i for i, s in enumerate(live) if drafts.get(id(s)) and not s.params.greedy]
        probs = {}
        if sampled:  # target distributions p for every verified position, in one call
            rows = [r for i in sampled for r in range(starts[i], ends[i])]
            params = [live[i].params for i in sampled for _ in range(work[i].num_logits)]
            p_all = probabilities(logits[rows], params)
            offset = 0
            for i in sampled:
                probs[i] = p_all[offset : offset + work[i].num_logits]
                offset += work[i].num_logits
        for i, s in enumerate(live):
            d = drafts.get(id(s))
            if not d:
                continue
            rows = logits[starts[i] : ends[i]]
            if i in probs:
                tokens = verify_drafts(probs[i], torch.stack(qs[id(s)]), d, s.generator, e.generator)
            elif targets is not None:
                tokens = accept_greedy(d, targets[starts[i] : ends[i]])
            else:
                tokens = verify_drafts(rows, None, d, s.generator, e.generator)
            self._settle(s, tokens, len(d), rows if s.params.return_logits else None)

    def _propose(self, seqs: list[Sequence], logits: torch.Tensor, drafts: dict, qs: dict) -> None:
        if not seqs:
            return
        params = [s.params for s in seqs]
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            q = probabilities(logits[sampled], [params[i] for i in sampled])
            tokens[sampled] = draw(q, [seqs[i].generator for i in sampled], self.engine.generator)
            for i, row in zip(sampled, q):
                qs[id(seqs[i])].append(row)
        for s, t in zip(seqs, tokens.tolist()):
            drafts[id(s)].append(t)

    def _ride(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Base-only sequences: a drafting pass is their own model, so its token is final."""
        if not seqs:
            return
        tokens = sample(logits, [s.params for s in seqs], [s.generator for s in seqs], self.engine.generator, seqs)
        for s, t, row in zip(seqs, tokens.tolist(), logits):
            s.num_computed = s.num_tokens
            self.engine.commit(s, t, row)

    def _settle(self, s: Sequence, tokens: list[int], drafted: int, rows: torch.Tensor | None):
        """Commit the accepted drafts and the target's token (tokens), stopping where the sequence ends.
        rows: the verify logits, for a request that returns them (indexing costs host time per token)."""
        e = self.engine
        accepted = len(tokens) - 1
        self.gate.adapter(s.adapter).observe(drafted, accepted, self.cfg.acceptance_ema)
        s.num_computed = s.num_tokens  # the verify pass wrote final KV for `last`...
        for i, t in enumerate(tokens):
            if e.commit(s, t, None if rows is None else rows[i]):
                return
            if i < accepted:  # ...and for each accepted draft; the target's own token is not in the cache yet
                s.num_computed += 1

    # ------------------------------------------------------------ stats
    def adapter_stats(self, name: str) -> dict:
        acc = self.gate.acceptance.get(name)
        if acc is None:
            return {"drafted_tokens": 0, "accepted_tokens": 0, "acceptance_rate": None, "mean_accepted_length": None}
        return {
            "drafted_tokens": acc.drafted,
            "accepted_tokens": acc.accepted,
            "acceptance_rate": acc.rate,  # per judged draft (see AdapterAcceptance)
            "draft_efficiency": acc.accepted / acc.drafted if acc.drafted else None,
            "acceptance_ema": acc.ema,
            "mean_accepted_length": acc.accepted / acc.verifies if acc.verifies else None,
            "verifies": acc.verifies,
        }

    def global_stats(self) -> dict:
        return {"cycles": self.cycles, "greedy_cycles": self.greedy_cycles, "plain_steps": self.plain_steps,
                "draft_passes": self.draft_passes, "cycle_passes": dict(sorted(self.cycle_passes.items())),
                "gate_decisions": dict(self.gate.decisions), "num_draft_tokens": self.cfg.num_draft_tokens}
