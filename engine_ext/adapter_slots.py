"""Adapter slots on the device: an explicit slot table plus the stacked A/B/scale tensors the batched
LoRA ops read. The last slot is all zeros and serves base-only tokens. Eviction is a separate policy.

Storage is one row per slot (`slab`, slot-major), holding every layer's A and B grouped as LORA_GROUPS
so a fused group (q/k/v, gate/up) is read as one matrix, plus a float32 `scale_slab`:

    row = [qkv A [L, in, 3R] | qkv B [L, R, q+2kv] | o A | o B | gate_up A | gate_up B | down A | down B]

An adapter is packed once on the host into the same layout at its own rank (`pack_adapter`), so a load
is one host-to-device copy of its bytes. On a GPU that copy runs on a side stream: `activate` only takes
the slot and marks where the compute stream stands; the copy is issued by `flush`, which the model runner
calls right after it has queued a forward (and the engine at the end of every step), so the host time of
issuing it passes while the device runs that forward rather than delaying it. `ready(name)` says when the
copy has landed; a slot whose copy is pending or in flight is never evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from .constants import LORA_GROUPS
from .lora_adapter import LoRAWeights
from .model_config import ModelSpec

SCALE_COLUMNS = tuple(m for modules in LORA_GROUPS.values() for m in modules)  # last dim of scale_slab
_ALIGN = 64  # elements: every block of a row starts 128-byte aligned (vector loads in the kernels)
# Copies go out in chunks so the step's own small uploads (batch metadata) wait behind one chunk on the
# copy engine, not behind a whole adapter; at 4 MiB a chunk still runs at full PCIe speed. Each chunk costs
# the issuing (step) thread an API call. Measured on the H200 (`git show 211e305:bench/RESULTS.md`, fourth
# pass): one copy per adapter loaded no faster (1.32x the copy time against 1.26x at 4 MiB chunks, rank 16).
_COPY_CHUNK_BYTES = 4 << 20


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class GroupBlock:
    """One LORA_GROUPS group in a row: A [L, in, nseg*rank] at a_offset, B [L, rank, out_total] at b_offset."""

    modules: tuple[str, ...]
    in_features: int
    segments: tuple[int, ...]  # start column of each module's output within out_total (0 first)
    out_total: int
    a_offset: int
    b_offset: int


@dataclass
class SlotLayout:
    """Where every module's A and B sit in one flat row at `rank`, for the groups listed (in order)."""

    num_layers: int
    rank: int
    blocks: dict[str, GroupBlock]
    numel: int

    @classmethod
    def build(cls, spec: ModelSpec, rank: int, groups: tuple[str, ...] = tuple(LORA_GROUPS)) -> SlotLayout:
        shapes, layers = spec.module_shapes(), spec.num_layers
        blocks, offset = {}, 0
        for g in groups:
            modules = LORA_GROUPS[g]
            fan_in = shapes[modules[0]][0]
            assert all(shapes[m][0] == fan_in for m in modules), f"group {g} mixes input widths"
            outs = [shapes[m][1] for m in modules]
            a_offset = offset
            b_offset = _aligned(a_offset + layers * fan_in * len(modules) * rank)
            offset = _aligned(b_offset + layers * rank * sum(outs))
            blocks[g] = GroupBlock(modules, fan_in, tuple(sum(outs[:i]) for i in range(len(outs))), sum(outs),
                                   a_offset, b_offset)
        return cls(layers, rank, blocks, offset)

    def a(self, rows: torch.Tensor, group: str) -> torch.Tensor:
        """rows [..., numel] -> the group's A, [..., L, in, nseg*rank] (a view)."""
        blk = self.blocks[group]
        shape = (self.num_layers, blk.in_features, len(blk.modules) * self.rank)
        return rows[..., blk.a_offset : blk.a_offset + shape[0] * shape[1] * shape[2]].unflatten(-1, shape)

    def b(self, rows: torch.Tensor, group: str) -> torch.Tensor:
        """rows [..., numel] -> the group's B, [..., L, rank, out_total] (a view)."""
        blk = self.blocks[group]
        shape = (self.num_layers, self.rank, blk.out_total)
        return rows[..., blk.b_offset : blk.b_offset + shape[0] * shape[1] * shape[2]].unflatten(-1, shape)


@dataclass
class PackedAdapter:
    """An adapter in host memory as one flat buffer in row layout at its own rank, over the groups it
    targets (pinned on a CUDA engine): loading it into a slot is one copy of its bytes."""

    name: str
    layout: SlotLayout
    data: torch.Tensor  # [layout.numel] model dtype
    scales: torch.Tensor  # [L, len(SCALE_COLUMNS)] float32; 0 for modules the adapter leaves alone

    @property
    def rank(self) -> int:
        return self.layout.rank

    def group_ranks(self) -> list[int]:
        """Its rank in each LORA_GROUPS group it targets, 0 in the others (AdapterSlots.rank_table's row)."""
        return [self.layout.rank if g in self.layout.blocks else 0 for g in LORA_GROUPS]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scales.numel() * self.scales.element_size()


def pack_adapter(weights: LoRAWeights, spec: ModelSpec, dtype: torch.dtype, pin: bool) -> PackedAdapter:
    """Lay a parsed adapter out as a slot row at its largest rank (smaller ranks zero-padded)."""
    targeted = {m for _, m in weights.a}
    groups = tuple(g for g, modules in LORA_GROUPS.items() if targeted & set(modules))
    layout = SlotLayout.build(spec, weights.rank, groups)
    data = torch.zeros(layout.numel, dtype=dtype, pin_memory=pin)
    scales = torch.zeros(spec.num_layers, len(SCALE_COLUMNS), dtype=torch.float32, pin_memory=pin)
    where = {m: (g, seg) for g in groups for seg, m in enumerate(LORA_GROUPS[g])}
    for (layer, module), a in weights.a.items():
        g, seg = where[module]
        b, start, r = weights.b[(layer, module)], layout.blocks[g].segments[seg], a.shape[1]
        layout.a(data, g)[layer, :, seg * layout.rank : seg * layout.rank + r].copy_(a)
        layout.b(data, g)[layer, :r, start : start + b.shape[1]].copy_(b)
        scales[layer, SCALE_COLUMNS.index(module)] = weights.scale[(layer, module)]
    return PackedAdapter(weights.name, layout, data, scales)


class LRUPolicy:
    """Least recently used first; `victim` picks among the candidates it is offered."""

    def __init__(self) -> None:
        self._order: OrderedDict[str, None] = OrderedDict()

    def touch(self, name: str) -> None:
        self._order.pop(name, None)
        self._order[name] = None

    def forget(self, name: str) -> None:
        self._order.pop(name, None)

    def victim(self, candidates: set[str]) -> str | None:
        return next((n for n in self._order if n in candidates), None)


@dataclass
class _Load:
    """A copy into one slot, from `activate` until it has landed: pending (`done` None) until `flush` issues it."""

    adapter: PackedAdapter
    after: torch.cuda.Event  # the compute stream when the slot was taken: forwards before it may read the victim
    done: torch.cuda.Event | None = None
    keep: tuple = ()  # what the copy reads (host buffers, device staging): alive until it has landed


class AdapterSlots:
    """The views the LoRA ops read (S = max_loras + 1 slots, R = the slots' width `rank`, at most max_rank; all
    strided views into `slab` and `scale_slab`, with unit stride along the last dim of A, B and the group scales):

    group_a[g] [L, S, in, nseg*R] (module seg's A in columns seg*R ..), group_b[g] [L, S, R, out_total]
    (modules' B side by side from group_segments[g]), group_scale[g] [L, S, nseg] float32;
    per module a[m] [L, S, in, R], b[m] [L, S, R, out], scale[m] [L, S] (ranks below R zero-padded);
    group_rank[g] [S] int32: each slot's adapter's rank in group g (0: the zero slot, a free slot, a group the
    adapter leaves alone): past it a slot's A columns and B rows are zero padding, which the Triton kernels skip
    with KernelSettings.rank_masks.

    Every slot is read at the slots' width whatever its adapter's rank, so the width is the LoRA work's cost: it
    starts at `rank` and grows (`grow`) only when an adapter wider than it arrives."""

    def __init__(self, spec: ModelSpec, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device,
                 policy: LRUPolicy | None = None, rank: int | None = None):
        """max_rank: the highest rank an adapter may have here. rank: the slots' width to start at (None: max_rank);
        an adapter of a higher rank widens them when it is first activated (`grow`)."""
        self.spec, self.max_loras, self.max_rank = spec, max_loras, max_rank
        self.zero_slot = max_loras
        self.device = torch.device(device)
        num_slots = max_loras + 1
        self.layout = SlotLayout.build(spec, max_rank if rank is None else min(rank, max_rank))
        self.slab = torch.zeros(num_slots, self.layout.numel, dtype=dtype, device=self.device)  # [S, row]
        self.scale_slab = torch.zeros(num_slots, spec.num_layers, len(SCALE_COLUMNS), dtype=torch.float32,
                                      device=self.device)  # [S, L, 7]
        self.rank_table = torch.zeros(num_slots, len(LORA_GROUPS), dtype=torch.int32, device=self.device)  # [S, G]
        self.group_rank = {g: self.rank_table[:, i] for i, g in enumerate(LORA_GROUPS)}
        # Bumps whenever the stacks move to new memory (`grow`): whatever captured views of them (the CUDA graphs)
        # captures again
        self.generation = 0
        self._views()
        self.table: list[str | None] = [None] * max_loras  # slot -> adapter name
        self.policy = policy or LRUPolicy()
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._loads: dict[int, _Load] = {}  # slot -> its copy in flight

    def _views(self) -> None:
        """The group and module views of `slab` and `scale_slab` at the layout's rank."""
        rank = self.layout.rank
        self.group_a = {g: self.layout.a(self.slab, g).transpose(0, 1) for g in LORA_GROUPS}
        self.group_b = {g: self.layout.b(self.slab, g).transpose(0, 1) for g in LORA_GROUPS}
        self.group_scale, self.group_segments = {}, {}
        self.a, self.b, self.scale = {}, {}, {}
        for g, modules in LORA_GROUPS.items():
            first, blk = SCALE_COLUMNS.index(modules[0]), self.layout.blocks[g]
            self.group_scale[g] = self.scale_slab[:, :, first : first + len(modules)].transpose(0, 1)
            self.group_segments[g] = blk.segments
            ends = blk.segments[1:] + (blk.out_total,)
            for seg, m in enumerate(modules):
                self.a[m] = self.group_a[g][..., seg * rank : (seg + 1) * rank]
                self.b[m] = self.group_b[g][..., blk.segments[seg] : ends[seg]]
                self.scale[m] = self.group_scale[g][..., seg]

    @property
    def rank(self) -> int:
        """The slots' width now: every adapter in them is zero-padded to it."""
        return self.layout.rank

    def width_for(self, rank: int) -> int:
        """The width the slots take for an adapter of `rank`: theirs when it fits, else the next power of two (at
        most max_rank), so a few growths reach any rank."""
        if rank <= self.layout.rank:
            return self.layout.rank
        return min(self.max_rank, 1 << (rank - 1).bit_length())

    def grow(self, rank: int) -> None:
        """Widen every slot to `rank` (at most max_rank). The adapters in them are copied into the wider stacks on
        the device, zero-padded, after any copy still in flight has landed; forwards already queued keep reading the
        old stacks, which the caching allocator frees after them. `generation` bumps: the CUDA graphs, which hold
        the old stacks' addresses (and keep them allocated), capture again before their next replay."""
        if rank <= self.layout.rank:
            return
        if rank > self.max_rank:
            raise ValueError(f"rank {rank} is above these slots' max_rank {self.max_rank}")
        self.synchronize()
        old_layout, old = self.layout, self.slab
        self.layout = SlotLayout.build(self.spec, rank)
        # A growth may come inside a step's inference mode (a request admitted between a cycle's passes): the new
        # stacks are made as ordinary tensors all the same, so that copies outside it may write them later.
        with torch.inference_mode(False):
            self.slab = torch.zeros(old.shape[0], self.layout.numel, dtype=old.dtype, device=self.device)
            for slot, name in enumerate(self.table):
                if name is not None:
                    self._unpack(self.slab[slot], old[slot], old_layout)
            self._views()
        self.generation += 1

    def slot_of(self, name: str) -> int | None:
        try:
            return self.table.index(name)
        except ValueError:
            return None

    def lora_slot(self, name: str | None) -> int:
        """The slot a forward reads for a sequence on adapter `name` (None: the base model's zero slot)."""
        if name is None:
            return self.zero_slot
        slot = self.slot_of(name)
        assert slot is not None, f"adapter {name!r} is not in a device slot"
        return slot

    @property
    def resident(self) -> list[str]:
        return [n for n in self.table if n is not None]

    # ------------------------------------------------------------ copies in flight
    def ready(self, name: str) -> bool:
        """In a slot, and its copy has landed: a forward may read it."""
        slot = self.slot_of(name)
        return slot is not None and self._landed(slot)

    @property
    def loading(self) -> bool:
        """Some copy is still in flight."""
        for slot in list(self._loads):
            self._landed(slot)
        return bool(self._loads)

    def synchronize(self) -> None:
        """Block the host until every copy, pending or in flight, has landed (tests, benchmarks)."""
        self.flush()
        for slot, load in list(self._loads.items()):
            load.done.synchronize()
            self._landed(slot)

    def flush(self) -> None:
        """Issue the copies `activate` left pending. The model runner calls this right after queuing a forward,
        so that the host time of issuing them overlaps the device's work (and the engine once per step)."""
        for slot, load in self._loads.items():
            if load.done is None:
                self._issue(slot, load)

    def _landed(self, slot: int) -> bool:
        load = self._loads.get(slot)
        if load is None:
            return True
        if load.done is None or not load.done.query():
            return False
        # The copy has completed; making the compute stream wait on it as well orders every later
        # forward after it by CUDA's rules, not only by this poll.
        torch.cuda.current_stream(self.device).wait_event(load.done)
        del self._loads[slot]
        return True

    # ------------------------------------------------------------ the table
    def _free_or_victim(self, busy: set[str]) -> int | None:
        if None in self.table:
            return self.table.index(None)
        loading = {self.table[slot] for slot in self._loads} if self.loading else set()
        victim = self.policy.victim({n for n in self.table if n not in busy and n not in loading})
        return None if victim is None else self.table.index(victim)

    def can_activate(self, name: str, busy: set[str]) -> bool:
        """`busy`: adapters that must stay (in use by running sequences, or pinned)."""
        return self.slot_of(name) is not None or self._free_or_victim(busy) is not None

    def activate(self, adapter: PackedAdapter, busy: set[str]) -> int:
        """Take a slot for an adapter (evicting the policy's victim if all are taken) and start its copy; returns
        the slot. On a GPU the copy is left pending for `flush`, then runs on `copy_stream`: see `ready`."""
        slot = self.slot_of(adapter.name)
        if slot is None:
            if adapter.rank > self.max_rank or adapter.layout.num_layers != self.layout.num_layers:
                raise ValueError(f"adapter {adapter.name!r} (rank {adapter.rank}) does not fit these slots")
            slot = self._free_or_victim(busy)
            if slot is None:
                raise RuntimeError("no adapter slot is free or evictable")
            self.grow(self.width_for(adapter.rank))  # the table stays as it is: the slot is still this one's
            self._forget(slot)  # no clearing: the copy writes the whole row
            self._copy_in(slot, adapter)
            self.table[slot] = adapter.name
        self.policy.touch(adapter.name)
        return slot

    def deactivate(self, name: str) -> bool:
        """Free an adapter's slot, zeroed so a free slot never holds stale weights. False (and nothing
        done) while its copy is still in flight."""
        slot = self.slot_of(name)
        if slot is None:
            return True
        if not self._landed(slot):
            return False
        self._forget(slot)
        self.slab[slot].zero_()
        self.scale_slab[slot].zero_()
        self.rank_table[slot].zero_()
        return True

    def _forget(self, slot: int) -> None:
        name = self.table[slot]
        if name is not None:
            self.table[slot] = None
            self.policy.forget(name)

    # ------------------------------------------------------------ the copy
    def _copy_in(self, slot: int, adapter: PackedAdapter) -> None:
        if self.copy_stream is None:
            row = self.slab[slot]
            direct = adapter.layout == self.layout  # same rank and groups: the packed buffer is the row
            row.copy_(adapter.data) if direct else self._unpack(row, adapter.data, adapter.layout)
            self.scale_slab[slot].copy_(adapter.scales)
            self.rank_table[slot] = torch.tensor(adapter.group_ranks(), dtype=torch.int32)
            return
        # Forwards already queued may still read the victim's row: the copy starts after them. Issued by `flush`.
        after = torch.cuda.Event()
        after.record(torch.cuda.current_stream(self.device))
        self._loads[slot] = _Load(adapter, after)

    def _issue(self, slot: int, load: _Load) -> None:
        adapter, row, scales = load.adapter, self.slab[slot], self.scale_slab[slot]
        direct = adapter.layout == self.layout  # same rank and groups: the packed buffer is the row
        self.copy_stream.wait_event(load.after)
        with torch.cuda.stream(self.copy_stream):
            dst = row if direct else torch.empty(adapter.data.shape, dtype=row.dtype, device=self.device)
            chunk = _COPY_CHUNK_BYTES // adapter.data.element_size()
            for start in range(0, dst.numel(), chunk):
                dst[start : start + chunk].copy_(adapter.data[start : start + chunk], non_blocking=True)
            if not direct:
                self._unpack(row, dst, adapter.layout)  # device-side, at memory speed
            scales.copy_(adapter.scales, non_blocking=True)
            ranks = torch.tensor(adapter.group_ranks(), dtype=torch.int32, pin_memory=self.device.type == "cuda")
            self.rank_table[slot].copy_(ranks, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        load.done, load.keep = done, (adapter.data, adapter.scales, dst, ranks)

    def _unpack(self, row: torch.Tensor, src: torch.Tensor, layout: SlotLayout) -> None:
        """Write a row packed at a lower rank (or over fewer groups) into a slot row; the rest is zero."""
        row.zero_()
        r, big = layout.rank, self.layout.rank
        for g, blk in layout.blocks.items():
            nseg = len(blk.modules)
            self.layout.a(row, g).unflatten(-1, (nseg, big))[..., :r].copy_(layout.a(src, g).unflatten(-1, (nseg, r)))
            self.layout.b(row, g)[:, :r].copy_(layout.b(src, g))
