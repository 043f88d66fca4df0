"""CUDA graphs for decode-shaped forwards (plain decode, base-only drafting, speculative verify).

One graph per (token bucket, adapters on/off). A forward of T tokens replays the graph of the
smallest bucket >= T; the T..bucket padding tokens are token id 0 at position 0 of a scratch KV
block the block manager never hands out, on the zero adapter slot, so they touch no real state.
Everything that varies between steps lives in static device buffers that are graph inputs:
token ids, positions, KV slots, block tables, each token's adapter slot. The adapter weights are
the slot stacks themselves (static tensors the slot table copies into), so a new adapter mix or a
newly loaded adapter needs no re-capture. The attention and LoRA kernels read per-token lengths
and slots on the device, which is what makes one graph valid for every mix.

All per-step metadata is packed on the host (batch.pack_forward, padded to the bucket) into one
pinned buffer and sent with two copies. `run(..., owned=False)` queues forwards back to back with no
host sync (speculative drafting): some input ids then come from a device tensor an earlier forward
filled, and each forward in flight packs into its own set of pinned buffers (a small ring that grows
to the number in flight).
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass

import torch

from .attention import AttnMetadata
from .batch import (IDS, KV_SLOT, LOGITS, LORA, NUM_ROWS, POS, QIDX, SEQ, ForwardLimits, SeqWork, check_packed,
                    check_work, pack_forward, token_moves)

logger = logging.getLogger(__name__)

# The packed metadata buffer holds batch.pack_forward's rows and two more, read before the replay (not by the
# graph): token DST[i] takes its id from the caller's device tensor at SRC[i] (`run`'s token_src).
_DST, _SRC = NUM_ROWS, NUM_ROWS + 1
_BUFFER_ROWS = NUM_ROWS + 2
_MAX_IN_FLIGHT = 20  # pinned buffer sets; a speculative cycle queues at most 16 drafting passes + 1 verify


def graph_buckets(max_tokens: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 to 128, of 32 to 256, of 64 beyond: padding waste stays under ~25%."""
    out, n = [], 1
    while n < min(16, max_tokens):
        out.append(n)
        n *= 2
    n = 16
    while n < max_tokens:
        out.append(n)
        n += 16 if n < 128 else 32 if n < 256 else 64
    out.append(max_tokens)
    return sorted(set(out))


class DecodeGraphs:
    """Captured forwards of `model` at bucketed token counts, replayed for decode-shaped batches."""

    def __init__(self, model, kv_caches, lora_op, attn_op, block_size: int, max_blocks_per_seq: int,
                 scratch_block: int, max_tokens: int, device: torch.device, group_lora_op=None,
                 limits: ForwardLimits | None = None):
        self.model, self.kv_caches, self.lora_op, self.attn_op = model, kv_caches, lora_op, attn_op
        self.limits = limits  # debug mode: every replay's inputs are bounds-checked on the host first
        self.group_lora_op = group_lora_op
        self.block_size, self.scratch_block, self.device = block_size, scratch_block, device
        self.buckets = graph_buckets(max_tokens)
        tmax, width = self.buckets[-1], max_blocks_per_seq
        self.width = width
        self.rows = torch.zeros(_BUFFER_ROWS, tmax, dtype=torch.long, device=device)
        self.tables = torch.full((tmax + 1, width), scratch_block, dtype=torch.long, device=device)
        self._host: list[_HostBuffers] = []  # ring of pinned packing buffers, one per forward in flight
        self._next_host = 0
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds: float | None = None
        self._slots = None

    def _forward(self, bucket: int, use_lora: bool) -> torch.Tensor:
        from .model import LoRABatch

        r = self.rows
        meta = AttnMetadata(positions=r[POS, :bucket], slot_mapping=r[KV_SLOT, :bucket],
                            block_tables=self.tables[: bucket + 1], token_seq=r[SEQ, :bucket],
                            token_qidx=r[QIDX, :bucket], max_query_len=bucket, kernel=self.attn_op)
        s = self._slots
        lora = LoRABatch.from_slots(self.lora_op, r[LORA, :bucket], s, self.group_lora_op) if use_lora else None
        return self.model(r[IDS, :bucket], meta, self.kv_caches, r[LOGITS, :bucket], lora)

    @torch.inference_mode()
    def capture(self, slots) -> float:
        """Capture every (bucket, adapters on/off) graph against these slot stacks; returns seconds taken."""
        start = time.perf_counter()
        self._slots = slots
        self.rows.zero_()
        self.rows[KV_SLOT] = self.scratch_block * self.block_size
        self.rows[LORA] = slots.zero_slot
        self.tables.fill_(self.scratch_block)
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # compile the kernels outside any capture
            for use_lora in (False, True):
                # Every bucket once: a kernel specialised on a size (split counts, tiles) compiles here, never
                # inside a capture, where loading a module is not permitted.
                for bucket in self.buckets:
                    self._forward(bucket, use_lora)
        torch.cuda.current_stream(self.device).wait_stream(side)
        # No garbage collection inside a capture: a finalizer that touches CUDA there (an earlier engine's
        # pinned buffers or events, freed by a collection the forward's allocations happen to trigger)
        # invalidates the capture ("operation failed due to a previous error during capture").
        gc.collect()
        collecting = gc.isenabled()
        gc.disable()
        try:
            for bucket in reversed(self.buckets):  # largest first, so smaller graphs reuse its pool memory
                for use_lora in (False, True):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        out = self._forward(bucket, use_lora)
                    self.graphs[(bucket, use_lora)] = (graph, out)
        finally:
            if collecting:
                gc.enable()
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured %d CUDA graphs (buckets %s) in %.1f s", len(self.graphs), self.buckets,
                    self.capture_seconds)
        return self.capture_seconds

    def fits(self, work: list[SeqWork]) -> bool:
        return (sum(len(w.token_ids) for w in work) <= self.buckets[-1]
                and max(len(w.block_table) for w in work) <= self.width)

    def run(self, work: list[SeqWork], slots, use_lora: bool = True, *, tokens: torch.Tensor | None = None,
            token_src: list[int] | None = None, owned: bool = True) -> torch.Tensor:
        """Replay the graph of the smallest bucket that holds `work`, queued on the current stream; returns its
        next-token logits [N, vocab]. tokens/token_src: see ModelRunner.run.

        owned=True: float32, a copy the caller keeps. owned=False: no host sync; the logits are in the model's
        dtype, a view of the graph's output: consume (or clone) them before queuing the next forward. The next
        replay of this graph overwrites them, and so may another graph's (the graphs share one memory pool, and
        a graph captured later may have put its output where an earlier one keeps intermediates).

        Stream order makes the queue safe: this forward's copies into the static `rows`/`tables` run after
        the previous replay has read them, and the id fix-up runs after the forward that wrote `tokens`."""
        if self._slots is None:
            self.capture(slots)
        elif slots is not self._slots:
            raise ValueError("the graphs were captured against another AdapterSlots")
        total = sum(len(w.token_ids) for w in work)
        bucket = next(b for b in self.buckets if b >= total)
        use_lora = use_lora and any(w.lora_slot != slots.zero_slot for w in work)
        if self.limits is not None:
            check_work(work, self.limits, None if tokens is None else tokens.numel(), token_src)
        host = self._free_host_buffers()
        num_tokens, num_logits = pack_forward(work, self.block_size, slots.zero_slot, host.np_rows, host.np_tables,
                                              pad_to=bucket, pad_block=self.scratch_block)
        if self.limits is not None:
            check_packed(host.np_rows, host.np_tables, len(work), num_tokens, num_logits, self.limits,
                         pad_to=bucket, pad_block=self.scratch_block)
        moved = 0
        if token_src is not None:
            dst, src = token_moves(token_src)
            moved = len(dst)
            host.np_rows[_DST, :moved], host.np_rows[_SRC, :moved] = dst, src
        self.rows.copy_(host.rows, non_blocking=True)
        self.tables[: len(work) + 1].copy_(host.tables[: len(work) + 1], non_blocking=True)
        host.copied.record()
        if moved:
            r = self.rows
            r[IDS].index_copy_(0, r[_DST, :moved], tokens.index_select(0, r[_SRC, :moved]))
        graph, out = self.graphs[(bucket, use_lora)]
        graph.replay()
        logits = out[:num_logits]
        return logits.to(torch.float32, copy=True) if owned else logits

    def _free_host_buffers(self) -> _HostBuffers:
        """The next pinned buffer set whose copies have run (packing into it must not race its DMA). Synchronous
        callers always find one; forwards queued back to back grow the ring to the number whose copies are
        still pending, once, up to _MAX_IN_FLIGHT (beyond that, wait for the oldest)."""
        ring = self._host
        i = self._next_host % len(ring) if ring else 0
        if ring and (ring[i].copied.query() or len(ring) >= _MAX_IN_FLIGHT):
            ring[i].copied.synchronize()
        else:
            tmax = self.buckets[-1]
            ring.insert(i, _HostBuffers(
                torch.zeros(_BUFFER_ROWS, tmax, dtype=torch.long, pin_memory=True),
                torch.full((tmax + 1, self.width), self.scratch_block, dtype=torch.long, pin_memory=True),
                torch.cuda.Event()))
        self._next_host = i + 1
        return ring[i]


@dataclass
class _HostBuffers:
    """Pinned host buffers one forward's metadata is packed into, and the event recorded after their copies."""

    rows: torch.Tensor  # [_BUFFER_ROWS, max tokens]
    tables: torch.Tensor  # [max tokens + 1, max blocks per sequence]
    copied: torch.cuda.Event

    def __post_init__(self) -> None:
        self.np_rows, self.np_tables = self.rows.numpy(), self.tables.numpy()
