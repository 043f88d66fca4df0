"""Continuous batching: which sequences run this step, admitting and preempting between steps."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .adapter_manager import AdapterManager
from .block_manager import BlockManager
from .prefix_cache import chain_hashes
from .sequence import Sequence, SeqStatus
from .stats import PrefixCacheStats

if TYPE_CHECKING:  # (flight.py -> speculation -> gate.py imports this module)
    from .flight import Flight


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_preempted: int = 0
    lookahead: int = 0  # drafting positions reserved past each sequence's tokens
    closed: bool = False  # nothing was left waiting: no request can join this batch
    budget: int = 0  # batched tokens left for prompts that join it (Scheduler.admit)
    # The room a queued step's most would take is not free: read that step first, then schedule again (its
    # sequences then need room only for what they have), rather than preempt a sequence for room it may not use
    wait: bool = False

    @property
    def empty(self) -> bool:
        return not self.seqs


class Scheduler:
    """FCFS with preemption by recompute. Each step: make room for every running sequence (preempting
    the newest when blocks run out), then admit waiting requests while blocks, sequence slots, the
    token budget and adapter slots allow. A request is admitted once its adapter's copy into a device
    slot has landed; at most one copy is issued per step, and none while another is in flight.

    With prefix caching (`prefix_cache`, its counters; None: off), a request admitted with an empty table first takes
    the longest cached chain of its adapter version (keyed by its `cache_root`), and `cache_final` files each
    running sequence's full blocks of final KV when the step that completed them is read."""

    def __init__(self, blocks: BlockManager, adapters: AdapterManager, max_num_seqs: int,
                 max_num_batched_tokens: int, prefix_cache: PrefixCacheStats | None = None):
        self.blocks = blocks
        self.prefix_cache = prefix_cache
        self.adapters = adapters
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}  # request id -> sequence
        self.finished: list[Sequence] = []  # finished since the engine last collected them
        self.num_preemptions = 0
        self._cold: set[str] = set()  # waiting request ids that had to wait for their adapter's copy

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def busy_adapters(self) -> set[str]:
        return {s.adapter for s in self.running.values() if s.adapter is not None}

    def preempt(self, seq: Sequence) -> None:
        """Recompute later: drop its KV, keep its tokens (prompt + generated) as the new prefill."""
        del self.running[seq.request_id]
        self.blocks.free(seq.block_table)
        seq.num_computed = seq.num_cached_blocks = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        if self.running.pop(seq.request_id, None) is None and seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)  # aborted before it ran: rare, O(waiting)
        self.blocks.free(seq.block_table)
        seq.status = SeqStatus.FINISHED
        self.finished.append(seq)

    # ------------------------------------------------------------ progress: the one writer of num_computed, flight
    def on_queued(self, flight: Flight) -> None:
        """A step was queued (`StepExecutor.launch`): the prompt positions it computes count as computed from now on
        (stream order writes their KV before any later forward reads it), and each row that commits tokens is held
        by it, scheduled from where it leaves the row, until it is read."""
        for r, n in flight.computed.items():
            flight.seqs[r].num_computed = n
        for r, seq in enumerate(flight.seqs):
            if flight.lo[r]:
                seq.flight, seq.flight_row, seq.pending = flight, r, flight.pending(r)

    def update_from_output(self, flight: Flight, counts: list[int]) -> None:
        """A queued step was read and its tokens appended (counts[r]: what row r committed, early first tokens
        included): each row is released from it; a running sequence that committed has its KV final up to its last
        token (filed in the prefix cache), then is finished if it ended, or else gives back the drafting room past
        its tokens when no later queued step writes there."""
        for r, seq in enumerate(flight.seqs):
            if seq.flight is flight:
                seq.flight, seq.flight_row, seq.pending = None, -1, (0, 0)
            if seq.finished or not counts[r]:
                continue
            if seq.status is SeqStatus.RUNNING:  # (not preempted while the step ran: its blocks hold this KV)
                seq.num_computed = seq.num_tokens - 1
                self.cache_final(seq)  # before a finish frees them: a next turn resends this text
            if seq.ended:
                self.finish(seq)
            elif seq.status is SeqStatus.RUNNING and seq.flight is None:
                self.blocks.truncate(seq.block_table, seq.num_tokens)

    def drop_queued(self, seqs) -> None:
        """Forget the steps queued for `seqs` without reading them (a step failed: nothing of them is trusted)."""
        for seq in seqs:
            seq.flight, seq.flight_row, seq.pending = None, -1, (0, 0)

    def ensure_room(self, seq: Sequence, num_tokens: int) -> bool:
        """Reserve blocks for `num_tokens` positions of a running sequence, preempting the newest
        running sequences if needed. False if `seq` itself had to be preempted."""
        while not self.blocks.can_allocate(seq.block_table, num_tokens):
            victim = max(self.running.values(), key=lambda s: s.arrival)
            self.preempt(victim)
            if victim is seq:
                return False
        self.blocks.allocate(seq.block_table, num_tokens)
        return True

    def _share_prompt(self, seq: Sequence) -> bool:
        """Take over the full blocks of the prompt KV that `seq.prompt_source` (same prompt, same adapter) has
        computed, so only the rest of the prompt is computed for `seq`. False while the source's prompt is not
        computed yet (the caller admits `seq` after it); True once shared, or when there is nothing to share
        (the source finished), then `seq` computes its prompt itself. The last prompt token is always computed
        (its logits start the output), and shared blocks are full, so no holder writes into them again."""
        source = seq.prompt_source
        if source.finished:
            seq.prompt_source = None
            return True
        if source.status is not SeqStatus.RUNNING or source.num_computed == 0:
            return False
        shared = min(source.num_computed, len(seq.prompt_token_ids) - 1) // self.blocks.block_size
        if shared:
            self.blocks.share(source.block_table, shared, seq.block_table)
            seq.num_computed = shared * self.blocks.block_size
        return True

    def use_prefix_cache(self, counters: PrefixCacheStats | None) -> None:
        """Prefix caching on, counting lookups into `counters`, or off (None): no lookups, nothing filed."""
        self.prefix_cache = counters

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks a sequence with an empty table can take: the longest cached chain of its adapter version
        over its full blocks but the one with its last token (computed again: its logits start the output)."""
        n = (seq.num_tokens - 1) // self.blocks.block_size
        if len(seq.block_hashes) < n:  # (a request waiting for room is looked up again each step)
            chain_hashes(seq.block_hashes, seq.cache_root, seq.token_ids, self.blocks.block_size, n)
        return self.blocks.lookup(seq.block_hashes[:n])

    def _take_prefix(self, seq: Sequence, hits: list[int]) -> None:
        """Hold the cached blocks `hits` as the start of `seq`'s table, and count the lookup."""
        self.blocks.take(hits, seq.block_table)
        seq.num_computed = len(hits) * self.blocks.block_size
        seq.num_cached_blocks = len(hits)
        self.prefix_cache.observe(seq.adapter, seq.num_tokens, seq.num_computed)

    def cache_final(self, seq: Sequence) -> None:
        """File a running sequence's full blocks below `num_computed` in the prefix cache. Called when the step that
        committed its tokens is read, not before: only then is their KV final (prefix_cache.py)."""
        size = self.blocks.block_size
        n = min(seq.num_computed // size, len(seq.block_table))
        if seq.cache_root is None or n <= seq.num_cached_blocks or self.prefix_cache is None:
            return
        chain_hashes(seq.block_hashes, seq.cache_root, seq.token_ids, size, n)
        for i in range(seq.num_cached_blocks, n):
            self.blocks.register(seq.block_table[i], seq.block_hashes[i], seq.cache_root)
        seq.num_cached_blocks = n

    def schedule(self, lookahead: int = 0, max_model_len: int = 1 << 30) -> ScheduledBatch:
        """`lookahead`: extra positions to reserve per running sequence (speculative drafts). A sequence a step still
        queued on the device holds (Sequence.flight) is scheduled from where that step leaves it, with room for the
        most it can commit; one that has ended on a token read since, or that the queued step takes to its end,
        waits for that step to be read."""
        batch = ScheduledBatch(lookahead=lookahead)
        preempted_before = self.num_preemptions
        stepping = sorted((s for s in self.running.values() if self._steps(s, max_model_len)),
                          key=lambda s: s.arrival)
        size = self.blocks.block_size
        grow, short = [], 0  # the sequences whose blocks do not hold what this step may write, and the blocks missing
        for seq in stepping:
            need = seq.num_tokens + seq.pending[1] + lookahead
            extra = -(-need // size) - len(seq.block_table)
            if extra > 0:
                grow.append((seq, need))
                short += extra
        if short > self.blocks.num_free and any(s.pending[1] for s in stepping):
            batch.wait = True
            return batch
        for seq, need in grow:
            if seq.status is SeqStatus.RUNNING:  # (not preempted for an older one's room)
                self.ensure_room(seq, need)
        # Grouped by adapter (arrival order within one, the sort being stable): the LoRA kernels multiply a run of
        # tokens sharing an adapter as one tile, so a grouped batch reads each adapter's weights once per run rather
        # than once per token (5-9% of a 128-sequence step at the 1B shape, bench/RESULTS.md section 1).
        batch.seqs = sorted((s for s in stepping if s.status is SeqStatus.RUNNING), key=lambda s: s.adapter or "")
        batch.num_preempted = self.num_preemptions - preempted_before
        if batch.num_preempted:
            return batch  # memory is tight: let the running ones progress before admitting more

        batch.budget = self.max_num_batched_tokens - len(batch.seqs) * (1 + lookahead)
        self.admit(batch)
        return batch

    @staticmethod
    def _steps(seq: Sequence, max_model_len: int) -> bool:
        """Whether a running sequence takes part in the next step."""
        return not seq.ended and seq.tokens_left(max_model_len) > 0

    def _adapter_ready(self, seq: Sequence, issued: bool) -> tuple[bool, bool]:
        """Whether a waiting request's adapter is in a device slot, issuing its copy if none is in flight and this
        scheduling issued none yet (`issued`); -> (ready, issued). Ready counts a hit if the request never waited."""
        slots = self.adapters.slots
        resident = slots.slot_of(seq.adapter) is not None
        hit = resident and seq.request_id not in self._cold
        # One copy at a time: on a GPU it runs beside the steps on a side stream, sharing the host link only with
        # the steps' own small uploads and holding one slot unevictable; on a CPU it stalls the step, so one per step
        # bounds that stall.
        if not resident and not issued and not slots.loading:
            issued = self.adapters.try_activate(seq.adapter, self.busy_adapters())
        if not self.adapters.ready(seq.adapter):
            self._cold.add(seq.request_id)
            return False, issued
        self._cold.discard(seq.request_id)
        self.adapters.stats.adapter(seq.adapter).hits += hit
        return True, issued

    def admit(self, batch: ScheduledBatch) -> list[Sequence]:
        """Admit waiting requests into `batch` (appended to batch.seqs as prefills) while blocks, sequence
        slots, its token budget and adapter slots allow; FCFS. Called at scheduling, and again by a speculative
        cycle for requests that arrived while it drafted (their prompts run in its next pass). -> the admitted."""
        lookahead, budget = batch.lookahead, batch.budget
        admitted: list[Sequence] = []
        issued = False
        skipped: list[Sequence] = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.flight is not None:  # preempted while a queued step held it: its tokens are not read yet
                skipped.append(self.waiting.popleft())
                continue
            if seq.prompt_source is not None and not seq.block_table and not self._share_prompt(seq):
                skipped.append(self.waiting.popleft())  # its source's prompt KV is not written yet
                continue
            lookup = seq.cache_root is not None and not seq.block_table and self.prefix_cache is not None
            hits = self._cached_prefix(seq) if lookup else []
            need = seq.num_tokens - max(seq.num_computed, len(hits) * self.blocks.block_size)
            if need > budget and batch.seqs:
                break
            if not self.blocks.can_allocate(seq.block_table, seq.num_tokens + lookahead, hits):
                break  # keep FCFS for memory; a later, smaller request must not starve this one
            if seq.adapter is not None:
                ready, issued = self._adapter_ready(seq, issued)
                if not ready:
                    skipped.append(self.waiting.popleft())  # adapter not ready: let requests behind it go first
                    continue
            self.waiting.popleft()
            if lookup:
                self._take_prefix(seq, hits)
            self.blocks.allocate(seq.block_table, seq.num_tokens + lookahead)
            seq.status = SeqStatus.RUNNING
            self.running[seq.request_id] = seq
            batch.seqs.append(seq)
            admitted.append(seq)
            budget -= need
        self.waiting.extendleft(reversed(skipped))
        if len(self._cold) > len(self.waiting):  # forget requests that left while waiting (aborted)
            self._cold &= {s.request_id for s in self.waiting}
        batch.closed, batch.budget = not self.waiting, budget
        return admitted
