"""CUDA graphs for decode-shaped forwards (plain decode, base-only drafting, speculative verify).

One graph per (token bucket, adapters on/off). A forward of T tokens replays the graph of the
smallest bucket >= T; the T..bucket padding tokens are token id 0 at position 0 of a scratch KV
block the block manager never hands out, on the zero adapter slot, so they touch no real state.
Everything that varies between steps lives in static device buffers that are graph inputs:
token ids, positions, KV slots, block tables, each token's adapter slot. The adapter weights are
the slot stacks themselves (static tensors the slot table copies into), so a new adapter mix or a
newly loaded adapter needs no re-capture. The attention and LoRA kernels read per-token lengths
and slots on the device, which is what makes one graph valid for every mix.

All per-step metadata is packed on the host into one pinned buffer and sent with two copies.
`run_async` queues forwards back to back with no host sync (speculative drafting): some input ids
then come from a device tensor an earlier forward filled, and each forward in flight packs into its
own set of pinned buffers (a small ring that grows to the number in flight).
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from .attention import AttnMetadata
from .batch import ForwardInputError, ForwardLimits, SeqWork, check_work

logger = logging.getLogger(__name__)

# Rows of the packed metadata buffer.
_IDS, _POS, _KV_SLOT, _SEQ, _QIDX, _LORA, _LOGITS = range(7)
# Two more, read before the replay (not by the graph): token DST[i] takes its id from the caller's device tensor
# at SRC[i] (`run_async`'s token_src).
_DST, _SRC = 7, 8
_NUM_ROWS = 9
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


def pack_decode_batch(work: list[SeqWork], block_size: int, zero_slot: int, scratch_block: int, bucket: int,
                      rows: np.ndarray, tables: np.ndarray) -> tuple[int, int]:
    """Fill rows [7, >=bucket] and tables [>=bucket+1, W] for one padded forward; returns (T, N logits).

    Same token order and logits order as batch.build_forward_batch; tokens T..bucket are padding. The
    buffers are reused from forward to forward, so every entry the graph reads (columns < bucket of every
    row, table rows <= the number of sequences) is written here: nothing is left over from an earlier batch.
    In particular the logits row gathers all `bucket` rows of the final hidden states, and an index left
    over from a larger batch would read past the end of this bucket's buffer."""
    lens = np.fromiter((len(w.token_ids) for w in work), dtype=np.int64, count=len(work))
    nlog = np.fromiter((w.num_logits for w in work), dtype=np.int64, count=len(work))
    num_seqs, num_tokens, num_logits = len(work), int(lens.sum()), int(nlog.sum())
    if num_tokens > bucket:
        raise ValueError(f"{num_tokens} tokens do not fit the {bucket}-token graph")
    tables[: num_seqs + 1] = scratch_block
    for i, w in enumerate(work):
        tables[i, : len(w.block_table)] = w.block_table
    ends = np.cumsum(lens)
    seq = np.repeat(np.arange(num_seqs), lens)
    qidx = np.arange(num_tokens) - np.repeat(ends - lens, lens)
    pos = np.repeat(np.fromiter((w.start for w in work), dtype=np.int64, count=num_seqs), lens) + qidx
    rows[:, num_tokens:bucket] = 0
    rows[_IDS, :num_tokens] = np.fromiter((t for w in work for t in w.token_ids), dtype=np.int64, count=num_tokens)
    rows[_POS, :num_tokens] = pos
    rows[_KV_SLOT, :num_tokens] = tables[seq, pos // block_size] * block_size + pos % block_size
    rows[_KV_SLOT, num_tokens:bucket] = scratch_block * block_size
    rows[_SEQ, :num_tokens] = seq
    rows[_SEQ, num_tokens:bucket] = num_seqs
    rows[_QIDX, :num_tokens] = qidx
    rows[_LORA, :num_tokens] = np.repeat(np.fromiter((w.lora_slot for w in work), dtype=np.int64,
                                                     count=num_seqs), lens)
    rows[_LORA, num_tokens:bucket] = zero_slot
    log_ends = np.cumsum(nlog)
    rows[_LOGITS, :num_logits] = np.repeat(ends - nlog, nlog) + np.arange(num_logits) - np.repeat(log_ends - nlog, nlog)
    rows[_LOGITS, num_logits:bucket] = 0  # rows nobody reads, gathered from token 0 of this forward
    return num_tokens, num_logits


def check_packed(rows: np.ndarray, tables: np.ndarray, num_seqs: int, num_tokens: int, num_logits: int, bucket: int,
                 limits: ForwardLimits, scratch_block: int) -> None:
    """Raise ForwardInputError unless every index a `bucket`-token graph reads from the packed buffers stays in
    its captured buffers: the debug-mode check of what pack_decode_batch wrote, before the replay."""
    def within(name: str, values: np.ndarray, high: int) -> None:
        if values.size and (values.min() < 0 or values.max() >= high):
            raise ForwardInputError(f"{name} outside [0, {high}) in a {bucket}-token graph: "
                                    f"{values.min()}..{values.max()}")

    cols = slice(0, bucket)
    within("token ids", rows[_IDS, cols], limits.vocab_size)
    within("positions", rows[_POS, cols], limits.max_positions)
    within("KV slots", rows[_KV_SLOT, cols], (scratch_block + 1) * limits.block_size)
    within("sequence indices", rows[_SEQ, cols], num_seqs + 1)
    within("query indices", rows[_QIDX, cols], bucket)
    within("adapter slots", rows[_LORA, cols], limits.num_slots)
    within("logits rows", rows[_LOGITS, :num_logits], num_tokens)
    within("logits rows", rows[_LOGITS, cols], bucket)
    within("block tables", tables[: num_seqs + 1], scratch_block + 1)


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
        self.rows = torch.zeros(_NUM_ROWS, tmax, dtype=torch.long, device=device)
        self.tables = torch.full((tmax + 1, width), scratch_block, dtype=torch.long, device=device)
        self._host: list[_HostBuffers] = []  # ring of pinned packing buffers, one per forward in flight
        self._next_host = 0
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds: float | None = None
        self._slots = None

    def _forward(self, bucket: int, use_lora: bool) -> torch.Tensor:
        from .model import LoRABatch

        r = self.rows
        meta = AttnMetadata(positions=r[_POS, :bucket], slot_mapping=r[_KV_SLOT, :bucket],
                            block_tables=self.tables[: bucket + 1], token_seq=r[_SEQ, :bucket],
                            token_qidx=r[_QIDX, :bucket], max_query_len=bucket, kernel=self.attn_op)
        s = self._slots
        lora = LoRABatch.from_slots(self.lora_op, r[_LORA, :bucket], s, self.group_lora_op) if use_lora else None
        return self.model(r[_IDS, :bucket], meta, self.kv_caches, r[_LOGITS, :bucket], lora)

    @torch.inference_mode()
    def capture(self, slots) -> float:
        """Capture every (bucket, adapters on/off) graph against these slot stacks; returns seconds taken."""
        start = time.perf_counter()
        self._slots = slots
        self.rows.zero_()
        self.rows[_KV_SLOT] = self.scratch_block * self.block_size
        self.rows[_LORA] = slots.zero_slot
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

    def run(self, work: list[SeqWork], slots, use_lora: bool) -> torch.Tensor:
        """Next-token logits [N, vocab] float32 (a copy), as ModelRunner.run computes them eagerly."""
        return self.run_async(work, slots, use_lora).to(torch.float32, copy=True)

    def run_async(self, work: list[SeqWork], slots, use_lora: bool, tokens: torch.Tensor | None = None,
                  token_src: list[int] | None = None) -> torch.Tensor:
        """Queue one forward on the current stream, no host sync; returns its logits [N, vocab] in the model's
        dtype as a view of the graph's output. Consume it (or clone it) before queuing the next forward: the next replay
        of this graph overwrites it, and so may another graph's (the graphs share one memory pool, and a
        graph captured later may have put its output where an earlier one keeps intermediates).
        token_src: see ModelRunner.run_async.

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
        num_tokens, num_logits = pack_decode_batch(work, self.block_size, slots.zero_slot, self.scratch_block,
                                                   bucket, host.np_rows, host.np_tables)
        if self.limits is not None:
            check_packed(host.np_rows, host.np_tables, len(work), num_tokens, num_logits, bucket, self.limits,
                         self.scratch_block)
        moved = _pack_token_src(token_src, host.np_rows)
        self.rows.copy_(host.rows, non_blocking=True)
        self.tables[: len(work) + 1].copy_(host.tables[: len(work) + 1], non_blocking=True)
        host.copied.record()
        if moved:
            r = self.rows
            r[_IDS].index_copy_(0, r[_DST, :moved], tokens.index_select(0, r[_SRC, :moved]))
        graph, out = self.graphs[(bucket, use_lora)]
        graph.replay()
        return out[:num_logits]

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
                torch.zeros(_NUM_ROWS, tmax, dtype=torch.long, pin_memory=True),
                torch.full((tmax + 1, self.width), self.scratch_block, dtype=torch.long, pin_memory=True),
                torch.cuda.Event()))
        self._next_host = i + 1
        return ring[i]


@dataclass
class _HostBuffers:
    """Pinned host buffers one forward's metadata is packed into, and the event recorded after their copies."""

    rows: torch.Tensor  # [_NUM_ROWS, max tokens]
    tables: torch.Tensor  # [max tokens + 1, max blocks per sequence]
    copied: torch.cuda.Event

    def __post_init__(self) -> None:
        self.np_rows, self.np_tables = self.rows.numpy(), self.tables.numpy()


def _pack_token_src(token_src: list[int] | None, rows: np.ndarray) -> int:
    """rows[_DST, :n] = tokens whose id comes from the device, rows[_SRC, :n] = where from; returns n."""
    if token_src is None:
        return 0
    src = np.asarray(token_src, dtype=np.int64)
    dst = np.flatnonzero(src >= 0)
    rows[_DST, : len(dst)] = dst
    rows[_SRC, : len(dst)] = src[dst]
    return len(dst)

