"""KV-cache block allocation: a free list of fixed-size blocks and one block table per sequence."""

from __future__ import annotations

from collections import deque


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    """Predicate/action pairs: `can_allocate`/`allocate` reserve room for a sequence's tokens,
    `free` returns every block, `truncate` returns the blocks past a length (speculative rollback), `share`
    gives another sequence the leading blocks of a table (a prompt's KV, read and never written again): a
    shared block goes back to the free list when its last holder lets it go."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._extra_refs: dict[int, int] = {}  # block -> holders beyond the first (shared blocks only)
        self.peak_used = 0  # high-water mark, for memory tests and stats

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_needed(self, block_table: list[int], num_tokens: int) -> int:
        return max(0, blocks_for(num_tokens, self.block_size) - len(block_table))

    def can_allocate(self, block_table: list[int], num_tokens: int) -> bool:
        """Room to hold `num_tokens` positions in a sequence that already owns `block_table`."""
        return self.blocks_needed(block_table, num_tokens) <= len(self._free)

    def allocate(self, block_table: list[int], num_tokens: int) -> None:
        need = self.blocks_needed(block_table, num_tokens)
        if need > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {need}, {len(self._free)} free")
        block_table.extend(self._free.popleft() for _ in range(need))
        self.peak_used = max(self.peak_used, self.num_blocks - len(self._free))

    def share(self, source: list[int], num_blocks: int, block_table: list[int]) -> None:
        """Append the first `num_blocks` blocks of `source` to an empty `block_table`, held by both."""
        if block_table or num_blocks > len(source):
            raise ValueError("share fills an empty table from blocks the source holds")
        for block in source[:num_blocks]:
            self._extra_refs[block] = self._extra_refs.get(block, 0) + 1
            block_table.append(block)

    def truncate(self, block_table: list[int], num_tokens: int) -> None:
        keep = blocks_for(num_tokens, self.block_size)
        while len(block_table) > keep:
            block = block_table.pop()
            refs = self._extra_refs.pop(block, 0)
            if refs > 1:
                self._extra_refs[block] = refs - 1
            elif refs == 0:
                self._free.appendleft(block)

    def free(self, block_table: list[int]) -> None:
        self.truncate(block_table, 0)
