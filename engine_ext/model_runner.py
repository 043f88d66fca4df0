"""Owns the model weights and the paged KV cache; runs one batched forward."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from .adapter_slots import AdapterSlots
from .backend import Backend
from .batch import (BUFFER_ROWS, IDS, KV_SLOT, POS, SEQ, ForwardInputError, ForwardLimits, SeqWork,
                    build_forward_batch, check_work)
from .block_manager import BlockManager, blocks_for
from .config import EngineConfig
from .staging import Staging
from .model import CausalLM, LoRABatch
from .model_config import ModelSpec
from .parallel.comm import ONE_RANK, Collectives, SingleRank
from .parallel.layout import ShardLayout

logger = logging.getLogger(__name__)


def _kv_blocks(config: EngineConfig, spec: ModelSpec, device: torch.device, max_positions: int) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = 2 * spec.num_layers * config.block_size * spec.kv_size * torch.finfo(config.torch_dtype).bits // 8
    if config.kv_cache_memory_gb is not None:
        budget = config.kv_cache_memory_gb * 2**30
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = 0.85 * free
    else:
        # The CPU default, a fixed 0.5 GiB, is no larger than what max_num_seqs sequences of the longest
        # length can hold at once: only running sequences allocate blocks. A small model would otherwise
        # zero-fill (and keep) hundreds of MiB it never uses, seconds of every replica's start-up.
        usable = config.max_num_seqs * blocks_for(max_positions, config.block_size)
        return max(1, min(int(0.5 * 2**30 // per_block), usable))
    return max(1, int(budget // per_block))


class ModelRunner:
    # `relaunch` is available (a tensor-parallel leader's ranks need every forward's work: it has none)
    relaunches = True

    def __init__(self, config: EngineConfig, spec: ModelSpec, device: torch.device, *, max_model_len: int,
                 lookahead: int, layout: ShardLayout | None = None,
                 comm: Collectives | SingleRank = ONE_RANK):
        """max_model_len: the longest sequence served; lookahead: positions past it a forward may touch (drafts, and
        a step queued before the one before it was read). The engine derives both once and passes them down.
        layout, comm: the part of the model this tensor-parallel rank holds and the ranks' collectives (None and
        ONE_RANK: one rank, the whole model); the KV cache holds this rank's KV heads."""
        self.config, self.spec, self.device = config, spec, device
        local = (layout or ShardLayout(spec, 0, 1)).local
        backend = Backend.from_config(config, device)
        with torch.device(device):
            self.model = CausalLM(spec, config.torch_dtype, backend.layer_ops, layout, comm, backend.weights)
        self.model.load_weights(config.model)
        self.model.eval()
        self.max_positions = max_model_len + lookahead + 1  # a token may sit `lookahead` past the limit
        self.lookahead = lookahead
        self.model.build_rope_table(self.max_positions)
        # every rank's cache has as many blocks: the block manager's ids address all of them
        self.num_blocks = comm.min_int(_kv_blocks(config, local, device, self.max_positions))
        # With CUDA graphs one extra block, never handed out, takes the KV of padding tokens.
        shape = (self.num_blocks + int(config.cuda_graphs), config.block_size, local.num_kv_heads, local.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=config.torch_dtype, device=device),
             torch.zeros(shape, dtype=config.torch_dtype, device=device))
            for _ in range(spec.num_layers)
        ]
        # Debug mode: the bounds every forward's indices are checked against (batch.check_work)
        self.limits = ForwardLimits(spec.vocab_size, self.max_positions, self.num_blocks, config.block_size,
                                    config.max_loras + 1) if config.debug_checks else None
        self.lora_op, self.group_lora_op = backend.lora_op, backend.group_lora_op
        self.attn_kernel = backend.attention
        self.metadata = backend.metadata
        self.commit = backend.commit  # a cycle's commit on the device (StepExecutor)
        self.graphs = self._decode_graphs() if config.cuda_graphs else None
        width = -(-self.max_positions // config.block_size)
        self.staging = Staging(config.max_num_batched_tokens + config.max_num_seqs * (lookahead + 1),
                               config.max_num_seqs, width, device)
        self._last = None  # the last forward, when `relaunch` may continue it: "graph", or (eager batch, its LoRA)
        self._last_work = None  # debug mode: its work
        logger.info("model %s loaded on %s: %d KV blocks of %d tokens", spec.architecture, device,
                    self.num_blocks, config.block_size)

    def capturing(self) -> bool:
        """True until the CUDA graphs are captured (at warm-up, or else on the first forward that fits one)."""
        return self.graphs is not None and self.graphs.capture_seconds is None

    def run(self, work: list[SeqWork], slots: AdapterSlots, use_lora: bool = True, **inputs) -> torch.Tensor:
        """`launch`'s logits alone."""
        return self.launch(work, slots, use_lora, **inputs)[0]

    @torch.inference_mode()
    def launch(self, work: list[SeqWork], slots: AdapterSlots, use_lora: bool = True, *,
               tokens: torch.Tensor | None = None, token_src: list[int] | None = None,
               shifts: torch.Tensor | None = None, owned: bool = True,
               started: Callable[[], None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Queue one forward; returns next-token logits [sum(num_logits), vocab] and the positions of the tokens
        they follow ([N] long), both on the device. `use_lora=False`: the base model. Nothing waits for the device:
        the metadata goes up from pinned buffers (staging.py), and adapter copies left pending are issued once the
        forward is queued (AdapterSlots.flush).

        owned=True: float32 logits the caller owns (a copy where they come from a graph's buffer). owned=False: in
        the model's dtype, and possibly a view of a graph's output buffer, valid until the next forward is queued:
        consume or clone them before that.

        Device-side inputs (batch.apply_sources): token_src, one entry per token of the flat token list (work order),
        where >= 0 takes that token's id from tokens[token_src[t]] ([M] long, on the device) when the forward runs
        (it may be the output of a forward still queued; its id in `work` is then a placeholder); `shifts` ([S]
        long, on the device) moves the positions of each SeqWork with shift >= 0 by shifts[shift].

        `started`: called once the host has packed the forward, right before its first device work is queued (where
        a span of the forward's device time starts: the packing is host work)."""
        self._last = None
        if self.graphs is not None and self.graphs.fits(work):
            logits, positions = self.graphs.run(work, slots, use_lora, tokens=tokens, token_src=token_src,
                                                shifts=shifts, owned=owned, started=started)
            self._last = "graph"
        else:
            logits, positions = self._eager(work, slots, use_lora, tokens, token_src, shifts, started)
            if owned:
                logits = logits.float()
        if self.limits is not None:  # debug mode: what a relaunch must continue (relaunch's `expect`)
            self._last_work = work
        slots.flush()
        return logits, positions

    @torch.inference_mode()
    def relaunch(self, slots: AdapterSlots, tokens: torch.Tensor, start: int, *, owned: bool = True,
                 expect: list[SeqWork] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Queue the last forward again one position on: each of its sequences (one token each, as in a drafting
        pass) at its next position, the token's id from tokens[start + i] (the last forward's drawn tokens), on the
        same adapter slots and KV blocks. Nothing is packed or copied from the host (batch.advance_forward): what a
        drafting pass after one with the same rows costs the host is a few launches. Returns what `launch` does.

        expect (debug mode): the work `launch` would have been given; it is checked to be the last forward's one
        position on, and bounds-checked like any forward."""
        if expect is not None and self.limits is not None:
            self._check_continues(expect, start, tokens)
        if self._last == "graph":
            logits, positions = self.graphs.relaunch(tokens, start, owned)
        elif isinstance(self._last, tuple):
            batch, lora = self._last
            a = batch.attn
            self.metadata.advance_forward(batch.input_ids, a.positions, a.slot_mapping, a.token_seq, a.block_tables,
                                          self.config.block_size, tokens, start)
            logits = self.model(batch.input_ids, a, self.kv_caches, batch.logits_indices, lora)
            positions = a.positions.index_select(0, batch.logits_indices)
            if owned:
                logits = logits.float()
        else:
            raise ValueError("relaunch needs a last forward of one token per sequence")
        slots.flush()
        return logits, positions

    def _check_continues(self, work: list[SeqWork], start: int, tokens: torch.Tensor) -> None:
        last = self._last_work
        check_work(work, self.limits, tokens.numel(), list(range(start, start + len(work))))
        same = len(last) == len(work) and all(
            len(a.token_ids) == len(b.token_ids) == 1 and b.start == a.start + 1 and a.lora_slot == b.lora_slot
            and a.shift == b.shift and a.num_logits == b.num_logits == 1 and list(a.block_table) == list(b.block_table)
            for a, b in zip(last, work))
        if not same:
            raise ForwardInputError("a relaunched forward is not the last one a position on")
        self._last_work = work

    def _eager(self, work: list[SeqWork], slots: AdapterSlots, use_lora: bool, tokens: torch.Tensor | None = None,
               token_src: list[int] | None = None, shifts: torch.Tensor | None = None,
               started: Callable[[], None] | None = None):
        if self.limits is not None:
            check_work(work, self.limits, None if tokens is None else tokens.numel(), token_src)
        batch = build_forward_batch(work, self.config.block_size, slots.zero_slot, self.device, self.limits,
                                    self.staging, token_src, tokens, shifts, self.metadata)
        batch.attn.kernel = self.attn_kernel
        lora = None
        if use_lora and batch.has_lora:
            lora = LoRABatch.from_slots(self.lora_op, batch.lora_slots, slots, self.group_lora_op)
        if len(work) == len(batch.input_ids):  # one token per sequence: `relaunch` may continue it
            self._last = (batch, lora)
        if started is not None:
            started()
        logits = self.model(batch.input_ids, batch.attn, self.kv_caches, batch.logits_indices, lora)
        return logits, batch.attn.positions.index_select(0, batch.logits_indices)

    @torch.inference_mode()
    def warm_up(self, slots: AdapterSlots, blocks: BlockManager, max_num_batched_tokens: int) -> dict[str, float]:
        """Compile every kernel variant and capture every CUDA graph that serving can launch, before the first
        request: the graphs (each bucket, adapters on and off: plain steps, drafting and verify passes), then
        eager forwards of the sizes the graphs do not take (prefills past the largest bucket; every bucket size
        when there are no graphs), at token and sequence counts that cover the size classes Triton
        specialises kernels on (1, multiples of 16, others). Returns the seconds each part took."""
        if self.device.type != "cuda" or not self.config.uses_triton:
            return {}  # the plain-torch kernels have nothing to compile
        out = {}
        if self.graphs is not None:
            out["graph_capture_s"] = self.graphs.capture(slots)
        start = time.perf_counter()
        from .cuda_graphs import graph_buckets

        first = self.graphs.buckets[-1] + 1 if self.graphs is not None else 1
        edge = -(-first // 16) * 16  # the first multiple of 16 the eager path takes
        shapes = [(edge, 1), (edge + 1, 2), (edge + 16, 16)]
        if self.graphs is None:
            shapes = [(b, b) for b in graph_buckets(self.config.max_graph_tokens)] + shapes
        max_len = self.max_positions - 1
        peak = blocks.peak_used  # the warm-up's blocks are no request's: they stay out of the high-water mark
        for tokens, seqs in shapes:
            seqs = max(seqs, -(-tokens // max_len))
            if tokens > max_num_batched_tokens or seqs > tokens:
                continue
            lens = [tokens // seqs + (i < tokens % seqs) for i in range(seqs)]
            tables: list[list[int]] = [[] for _ in lens]
            if blocks.num_free < sum(-(-n // blocks.block_size) for n in lens):
                logger.warning("warm-up: no KV room for a %d-token forward; it compiles on first use", tokens)
                continue
            for table, n in zip(tables, lens):
                blocks.allocate(table, n)
            try:
                for slot in (slots.zero_slot, 0):  # adapters off, then on (slot 0 is empty at start-up)
                    work = [SeqWork([0] * n, 0, t, slot) for n, t in zip(lens, tables)]
                    self._eager(work, slots, use_lora=slot != slots.zero_slot)
            finally:
                for table in tables:
                    blocks.free(table)
        blocks.peak_used = peak
        self._warm_metadata()
        torch.cuda.synchronize(self.device)
        out["eager_warmup_s"] = time.perf_counter() - start
        return out

    def _warm_metadata(self) -> None:
        """Run the metadata fix-ups once (batch.MetadataOps, which warm-up's forwards, with no device sources, do not
        run) and a cycle's commit (`commit`) on scratch rows: the Triton ones compile one variant each, which a
        forward taking its ids or positions from the device, a relaunch or a cycle would otherwise compile
        mid-serving."""
        rows = torch.zeros(BUFFER_ROWS, 1, dtype=torch.long, device=self.device)  # every source entry 0
        tables = torch.zeros(1, 2, dtype=torch.long, device=self.device)  # position 1's block, whatever block_size
        tokens = torch.zeros(1, dtype=torch.long, device=self.device)
        self.metadata.apply_sources(rows, tables, self.config.block_size, tokens, tokens)
        self.metadata.advance_forward(rows[IDS], rows[POS], rows[KV_SLOT], rows[SEQ], tables, self.config.block_size,
                                      tokens, 0)
        # a cycle's commit lanes are 1 to 2k + 1 wide (k fixed tokens, k + 1 verified): the kernel's narrowest and
        # widest variants
        for width in {1, 2 * self.lookahead + 1}:
            self.commit(tokens, torch.zeros(5, 1, width, dtype=torch.long, device=self.device), True)

    def _decode_graphs(self):
        """CUDA graphs for forwards of up to max_graph_tokens tokens (captured on first use)."""
        from .cuda_graphs import DecodeGraphs

        cfg = self.config
        width = -(-self.max_positions // cfg.block_size)
        return DecodeGraphs(self.model, self.kv_caches, self.lora_op, self.attn_kernel, cfg.block_size, width,
                            scratch_block=self.num_blocks, max_tokens=cfg.max_graph_tokens, device=self.device,
                            group_lora_op=self.group_lora_op, limits=self.limits, metadata=self.metadata)
