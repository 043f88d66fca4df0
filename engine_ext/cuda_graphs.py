"""CUDA graphs for decode-shaped forwards (plain decode, base-only drafting, speculative verify).

One graph per (token bucket, adapters on/off), and with adapters on one for forwards of one token per
sequence (decode steps) and one for forwards with several (verify passes, prompts: the layer ops fold their LoRA
math a group of tokens on one adapter at a time there, and attention tiles several query tokens). A forward of T
tokens replays the graph of the smallest bucket >= T; the T..bucket padding tokens are token id 0 at position 0 of a scratch KV
block the block manager never hands out, on the zero adapter slot, so they touch no real state.
Everything that varies between steps lives in static device buffers that are graph inputs:
token ids, positions, KV slots, block tables, each token's adapter slot. The adapter weights are
the slot stacks themselves (static tensors the slot table copies into), so a new adapter mix or a
newly loaded adapter needs no re-capture; only an adapter wider than the slots, which moves them to wider
stacks (AdapterSlots.grow), has every graph captured again before the next replay. The attention and LoRA
kernels read per-token lengths and slots on the device, which is what makes one graph valid for every mix.

All per-step metadata is packed on the host (batch.pack_forward, padded to the bucket) into one
pinned buffer and sent with two non-blocking copies (staging.Staging: each forward in flight packs into its
own set of pinned buffers), so forwards queue back to back with no host sync: some input ids and positions
then come from device tensors an earlier forward filled (batch.apply_sources, run by the `metadata` ops the
backend chose: one Triton launch with layer_ops "triton").
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable

import torch

from .attention import AttnMetadata
from .batch import (BUFFER_ROWS, IDS, KV_SLOT, LOGITS, LORA, POS, QIDX, SEQ, TORCH_METADATA, ForwardLimits,
                    MetadataOps, SeqWork, check_packed, check_work, pack_forward)
from .staging import Staging

logger = logging.getLogger(__name__)


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
                 limits: ForwardLimits | None = None, metadata: MetadataOps = TORCH_METADATA):
        self.model, self.kv_caches, self.lora_op, self.attn_op = model, kv_caches, lora_op, attn_op
        self.metadata = metadata  # apply_sources and advance_forward on the static rows, before a replay
        self.limits = limits  # debug mode: every replay's inputs are bounds-checked on the host first
        self.group_lora_op = group_lora_op
        self.block_size, self.scratch_block, self.device = block_size, scratch_block, device
        self.buckets = graph_buckets(max_tokens)
        tmax, width = self.buckets[-1], max_blocks_per_seq
        self.width = width
        self.rows = torch.zeros(BUFFER_ROWS, tmax, dtype=torch.long, device=device)
        self.tables = torch.full((tmax + 1, width), scratch_block, dtype=torch.long, device=device)
        self.staging = Staging(tmax, tmax + 1, width, device, fill=scratch_block)
        # (bucket, adapters on, several tokens per sequence) -> (graph, its logits buffer)
        self.graphs: dict[tuple[int, bool, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds: float | None = None
        self.captures = 0  # how many times every graph was captured (more than once: the adapter slots grew)
        self._slots, self._generation, self._stacks = None, -1, None
        # The last replay, for `relaunch`: (graph key, tokens, logits rows) when it ran one token per sequence
        self._last: tuple[tuple[int, bool, bool], int, int] | None = None

    def kinds(self) -> list[tuple[int, bool, bool]]:
        """Every graph's key: each bucket adapters off, and on for one token per sequence and (buckets > 1) for
        several."""
        return [(b, on, multi) for b in self.buckets for on, multi in ((False, False), (True, False), (True, True))
                if b > 1 or not multi]

    def _forward(self, bucket: int, use_lora: bool, multi: bool) -> torch.Tensor:
        from .model import LoRABatch

        r = self.rows
        meta = AttnMetadata(positions=r[POS, :bucket], slot_mapping=r[KV_SLOT, :bucket],
                            block_tables=self.tables[: bucket + 1], token_seq=r[SEQ, :bucket],
                            token_qidx=r[QIDX, :bucket], max_query_len=bucket, kernel=self.attn_op, multi=multi)
        s = self._slots
        lora = LoRABatch.from_slots(self.lora_op, r[LORA, :bucket], s, self.group_lora_op) if use_lora else None
        return self.model(r[IDS, :bucket], meta, self.kv_caches, r[LOGITS, :bucket], lora)

    @torch.inference_mode()
    def capture(self, slots) -> float:
        """Capture every graph (`kinds`) against these slot stacks; returns seconds taken."""
        start = time.perf_counter()
        self._slots, self._generation = slots, slots.generation
        # The stacks the graphs read stay allocated while the graphs exist: after a growth, a relaunch of the last
        # replay (a step continuing the one before it, whose batch the growth did not change) still reads them
        self._stacks = slots.slab
        self._last = None
        self.rows.zero_()
        self.rows[KV_SLOT] = self.scratch_block * self.block_size
        self.rows[LORA] = slots.zero_slot
        self.tables.fill_(self.scratch_block)
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # compile the kernels outside any capture
            # Every kind once: a kernel specialised on a size (split counts, tiles) compiles here, never inside a
            # capture, where loading a module is not permitted.
            for kind in self.kinds():
                self._forward(*kind)
        torch.cuda.current_stream(self.device).wait_stream(side)
        # No garbage collection inside a capture: a finalizer that touches CUDA there (an earlier engine's
        # pinned buffers or events, freed by a collection the forward's allocations happen to trigger)
        # invalidates the capture ("operation failed due to a previous error during capture").
        gc.collect()
        collecting = gc.isenabled()
        gc.disable()
        try:
            for kind in reversed(self.kinds()):  # largest first, so smaller graphs reuse its pool memory
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._forward(*kind)
                self.graphs[kind] = (graph, out)
        finally:
            if collecting:
                gc.enable()
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        self.captures += 1
        logger.info("captured %d CUDA graphs (buckets %s) in %.1f s", len(self.graphs), self.buckets,
                    self.capture_seconds)
        return self.capture_seconds

    def _release(self) -> None:
        """Drop the graphs, once the device has run every replay queued (their memory pools are freed with them)."""
        if self.graphs:
            torch.cuda.synchronize(self.device)
            self.graphs.clear()
            self._last = None
        self._stacks = None

    def fits(self, work: list[SeqWork]) -> bool:
        return (sum(len(w.token_ids) for w in work) <= self.buckets[-1]
                and max(len(w.block_table) for w in work) <= self.width)

    def run(self, work: list[SeqWork], slots, use_lora: bool = True, *, tokens: torch.Tensor | None = None,
            token_src: list[int] | None = None, shifts: torch.Tensor | None = None, owned: bool = True,
            started: Callable[[], None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the graph of the smallest bucket that holds `work`, queued on the current stream; returns its
        next-token logits [N, vocab] and the positions of the N tokens they follow ([N] long, device).
        tokens/token_src/shifts/started: see ModelRunner.launch.

        owned=True: float32, a copy the caller keeps. owned=False: the logits are in the model's dtype, a view of
        the graph's output: consume (or clone) them before queuing the next forward. The next replay of this graph
        overwrites them, and so may another graph's (the graphs share one memory pool, and a graph captured later
        may have put its output where an earlier one keeps intermediates).

        Stream order makes the queue safe: this forward's copies into the static `rows`/`tables` run after
        the previous replay has read them, and the source fix-up runs after the forwards that wrote `tokens`."""
        if self._slots is not None and slots is not self._slots:
            raise ValueError("the graphs were captured against another AdapterSlots")
        if self._slots is None or self._generation != slots.generation:
            self._release()  # the slots grew (AdapterSlots.grow): the graphs read stacks that are gone
            self.capture(slots)
        total = sum(len(w.token_ids) for w in work)
        bucket = next(b for b in self.buckets if b >= total)
        use_lora = use_lora and any(w.lora_slot != slots.zero_slot for w in work)
        multi = use_lora and any(len(w.token_ids) > 1 for w in work)
        if self.limits is not None:
            check_work(work, self.limits, None if tokens is None else tokens.numel(), token_src)
        host = self.staging.take()
        num_tokens, num_logits = pack_forward(work, self.block_size, slots.zero_slot, host.np_rows, host.np_tables,
                                              pad_to=bucket, pad_block=self.scratch_block, token_src=token_src)
        if self.limits is not None:
            check_packed(host.np_rows, host.np_tables, len(work), num_tokens, num_logits, self.limits,
                         pad_to=bucket, pad_block=self.scratch_block)
        if started is not None:
            started()
        self.rows.copy_(host.rows, non_blocking=True)
        self.tables[: len(work) + 1].copy_(host.tables[: len(work) + 1], non_blocking=True)
        host.copied.record()
        if tokens is not None or shifts is not None:
            self.metadata.apply_sources(self.rows[:, :bucket], self.tables, self.block_size, tokens, shifts)
        key = (bucket, use_lora, multi)
        self._last = (key, num_tokens, num_logits) if num_tokens == len(work) else None
        return self._replay(key, num_logits, owned)

    def relaunch(self, tokens: torch.Tensor, start: int, owned: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the last forward one position on, its input ids from tokens[start:] (batch.advance_forward):
        no packing, no copy from the host. The last forward must have been one token per sequence."""
        if self._last is None:
            raise ValueError("relaunch needs a last replay of one token per sequence")
        key, n, num_logits = self._last
        r = self.rows
        self.metadata.advance_forward(r[IDS, :n], r[POS, :n], r[KV_SLOT, :n], r[SEQ, :n], self.tables,
                                      self.block_size, tokens, start)
        return self._replay(key, num_logits, owned)

    def _replay(self, key: tuple[int, bool, bool], num_logits: int, owned: bool):
        graph, out = self.graphs[key]
        graph.replay()
        logits = out[:num_logits]
        positions = self.rows[POS].index_select(0, self.rows[LOGITS, :num_logits])
        return (logits.to(torch.float32, copy=True) if owned else logits), positions
