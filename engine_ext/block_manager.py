"""KV-cache block allocation: a free list of fixed-size blocks, one block table per sequence, and (prefix caching)
an index of full blocks whose KV is final, kept after their last holder lets them go until the room is needed.

A sequence's table is a `BlockTable` (a list of block ids), mirrored in a row of the block manager's `TableMirror`
(one int64 array), so that a forward's tables are one gather of rows (batch.pack_forward) rather than a copy of
every table's Python ints: a row is written only where its table grew since the last forward that read it. The
block manager makes every change to a table, so it keeps the mirror's record of what is still synced."""

from __future__ import annotations

from collections import OrderedDict, deque

import numpy as np


class BlockTable(list):
    """A sequence's block ids, in order. `mirror`: the TableMirror it is bound to (by the block manager's first
    change to it); `row`: its row there (-1: none); `synced`: its leading ids that row holds."""

    __slots__ = ("mirror", "row", "synced")

    def __init__(self, *args):
        super().__init__(*args)
        self.mirror, self.row, self.synced = None, -1, 0

    def __reduce__(self):  # pickled (to tensor-parallel workers) as the plain list of its ids: no mirror travels
        return list, (list(self),)


class TableMirror:
    """Block tables as rows of one int64 array ([rows, width], both grown on demand); see the module docstring."""

    def __init__(self, width: int = 64, rows: int = 256):
        self.array = np.zeros((rows, width), np.int64)
        self._free_rows = list(range(rows - 1, -1, -1))

    @property
    def width(self) -> int:
        return self.array.shape[1]

    def row_of(self, table: BlockTable) -> int:
        """`table`'s row, holding all its ids (written where it grew since). LookupError: not this mirror's."""
        if table.mirror is not self:
            raise LookupError("a block table of another block manager")
        row, n = table.row, len(table)
        if row < 0:
            if not self._free_rows:
                self._grow(rows=2 * self.array.shape[0])
            row = table.row = self._free_rows.pop()
        if table.synced < n:
            if n > self.width:
                self._grow(width=max(n, 2 * self.width))
            self.array[row, table.synced : n] = table[table.synced : n]
            table.synced = n
        return row

    def cut(self, table: BlockTable) -> None:
        """After `table` lost ids from its end: its row holds only what is left (an empty table gives its row back)."""
        table.synced = min(table.synced, len(table))
        if not table and table.row >= 0:
            self._free_rows.append(table.row)
            table.row = -1

    def _grow(self, rows: int | None = None, width: int | None = None) -> None:
        old = self.array
        rows, width = rows or old.shape[0], width or old.shape[1]
        self.array = np.zeros((rows, width), np.int64)
        self.array[: old.shape[0], : old.shape[1]] = old
        self._free_rows.extend(range(rows - 1, old.shape[0] - 1, -1))


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    """Predicate/action pairs: `can_allocate`/`allocate` reserve room for a sequence's tokens,
    `free` returns every block, `truncate` returns the blocks past a length (speculative rollback), `share`
    gives another sequence the leading blocks of a table (a prompt's KV, read and never written again): a
    shared block goes back to the pool when its last holder lets it go.

    Prefix caching (prefix_cache.py says which blocks qualify and how they are keyed): `register` files a held
    full block under its chain hash; `lookup`/`take` find and hold the longest cached chain of a new sequence.
    A registered block its last holder lets go is not free but *cached*: counted as free (any allocation may take
    it, least recently released first, which drops it from the index), so the cache never refuses room to a
    sequence nor makes the scheduler preempt one. `drop` forgets every block of one root (an adapter version)."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))  # blocks holding nothing anyone can find
        self._extra_refs: dict[int, int] = {}  # block -> holders beyond the first (shared blocks only)
        self._cached: OrderedDict[int, None] = OrderedDict()  # registered blocks no table holds, LRU first
        self._index: dict[bytes, int] = {}  # chain hash -> the block holding that KV
        self._hash: dict[int, tuple[bytes, bytes]] = {}  # registered block -> (its chain hash, its root)
        self._roots: dict[bytes, set[int]] = {}  # root -> its registered blocks
        self._retired: set[bytes] = set()  # dropped roots: never registered again (their adapter version is gone)
        self.evictions = 0  # cached blocks reused for other KV
        self.peak_used = 0  # high-water mark, for memory tests and stats
        self.mirror = TableMirror()  # the BlockTables it changes, as array rows (batch.pack_forward reads them)

    def _bind(self, block_table: list[int]) -> None:
        if type(block_table) is BlockTable and block_table.mirror is None:
            block_table.mirror = self.mirror

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: free ones and cached ones no sequence holds."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Registered blocks, held or not."""
        return len(self._index)

    def blocks_needed(self, block_table: list[int], num_tokens: int) -> int:
        return max(0, blocks_for(num_tokens, self.block_size) - len(block_table))

    def can_allocate(self, block_table: list[int], num_tokens: int, hits: list[int] = ()) -> bool:
        """Room to hold `num_tokens` positions in a sequence that already owns `block_table` (plus the cached
        blocks `hits` it is about to take, which then stop counting as free)."""
        held = sum(b in self._cached for b in hits)
        return self.blocks_needed(block_table, num_tokens) - len(hits) <= self.num_free - held

    def allocate(self, block_table: list[int], num_tokens: int) -> None:
        need = self.blocks_needed(block_table, num_tokens)
        if need > self.num_free:
            raise RuntimeError(f"out of KV blocks: need {need}, {self.num_free} free")
        self._bind(block_table)
        for _ in range(need):
            block_table.append(self._free.popleft() if self._free else self._evict())
        self.peak_used = max(self.peak_used, self.num_blocks - self.num_free)

    def share(self, source: list[int], num_blocks: int, block_table: list[int]) -> None:
        """Append the first `num_blocks` blocks of `source` to an empty `block_table`, held by both."""
        if block_table or num_blocks > len(source):
            raise ValueError("share fills an empty table from blocks the source holds")
        self._bind(block_table)
        for block in source[:num_blocks]:
            self._extra_refs[block] = self._extra_refs.get(block, 0) + 1
            block_table.append(block)

    def truncate(self, block_table: list[int], num_tokens: int) -> None:
        """Let go of the blocks past `num_tokens` positions, the last first: a cached chain released whole is then
        evicted from its end, so its head (what more requests share) stays longest."""
        keep = blocks_for(num_tokens, self.block_size)
        if len(block_table) <= keep:
            return
        while len(block_table) > keep:
            block = block_table.pop()
            refs = self._extra_refs.pop(block, 0)
            if refs > 1:
                self._extra_refs[block] = refs - 1
            elif refs == 0:
                if block in self._hash:
                    self._cached[block] = None
                else:
                    self._free.appendleft(block)
        if type(block_table) is BlockTable and block_table.mirror is not None:
            block_table.mirror.cut(block_table)

    def free(self, block_table: list[int]) -> None:
        self.truncate(block_table, 0)

    # ------------------------------------------------------------ prefix caching
    def register(self, block: int, chain_hash: bytes, root: bytes) -> None:
        """File a block some table holds, whose KV is final, under `chain_hash`. A hash already filed (the same
        KV computed twice, or this block again) keeps its block, and a retired root files nothing."""
        if chain_hash in self._index or block in self._hash or root in self._retired:
            return
        self._index[chain_hash] = block
        self._hash[block] = (chain_hash, root)
        self._roots.setdefault(root, set()).add(block)

    def lookup(self, chain_hashes: list[bytes]) -> list[int]:
        """The blocks of the longest cached chain: the leading `chain_hashes` that are all filed (no side effect)."""
        hits = []
        for h in chain_hashes:
            block = self._index.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def take(self, hits: list[int], block_table: list[int]) -> None:
        """Hold the cached blocks `hits` (from `lookup`, this step) as the start of an empty `block_table`."""
        if block_table:
            raise ValueError("take fills an empty table")
        self._bind(block_table)
        for block in hits:
            if block in self._cached:
                del self._cached[block]  # its first holder again
            else:
                self._extra_refs[block] = self._extra_refs.get(block, 0) + 1
            block_table.append(block)
        self.peak_used = max(self.peak_used, self.num_blocks - self.num_free)

    def drop(self, root: bytes, retire: bool = True) -> int:
        """Forget every cached block of `root`: cached ones become free, held ones plain blocks of their holders.
        `retire`: file none of it again (its weights are gone for good). -> blocks forgotten."""
        if retire:
            self._retired.add(root)
        blocks = list(self._roots.get(root, ()))
        for block in blocks:
            self._unregister(block)
            if block in self._cached:
                del self._cached[block]
                self._free.append(block)
        return len(blocks)

    def clear(self) -> None:
        """Forget every cached block (roots stay usable)."""
        for root in list(self._roots):
            self.drop(root, retire=False)

    def _evict(self) -> int:
        block, _ = self._cached.popitem(last=False)
        self._unregister(block)
        self.evictions += 1
        return block

    def _unregister(self, block: int) -> None:
        chain_hash, root = self._hash.pop(block)
        del self._index[chain_hash]
        held = self._roots[root]
        held.discard(block)
        if not held:
            del self._roots[root]
