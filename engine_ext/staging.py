"""Host buffers that a forward's metadata is packed into before its copy to the device.

On a GPU they are pinned and copied with non_blocking copies, so queuing a forward never waits for the device: a
copy from pageable memory, or one that is not non_blocking, would make the host wait for everything queued before
it, and the next step could not be packed while this one runs. A set is packed into again only once the copy that
read it has run (its event); forwards queued back to back grow the ring to the number in flight, up to `max_sets`
(beyond that the oldest is waited for). On a CPU every forward is synchronous and one set serves them all."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .batch import BUFFER_ROWS


@dataclass
class HostSet:
    rows: torch.Tensor  # [BUFFER_ROWS, max tokens] int64
    tables: torch.Tensor  # [max seqs + 1, width] int64
    copied: torch.cuda.Event | None  # recorded after the copies that read it (None on a CPU)

    def __post_init__(self) -> None:
        self.np_rows: np.ndarray = self.rows.numpy()
        self.np_tables: np.ndarray = self.tables.numpy()

    def fits(self, tokens: int, seqs: int, width: int) -> bool:
        return tokens <= self.rows.shape[1] and seqs <= self.tables.shape[0] and width <= self.tables.shape[1]


class Staging:
    MAX_SETS = 20  # a speculative step queues at most 16 drafting passes and its verify pass

    def __init__(self, max_tokens: int, max_seqs: int, width: int, device: torch.device, fill: int = 0):
        """Sets of [BUFFER_ROWS, max_tokens] rows and [max_seqs, width] tables (`fill`: the tables' initial value);
        a forward larger than that gets a set of its own size."""
        self.max_tokens, self.max_seqs, self.width, self.fill = max_tokens, max_seqs, width, fill
        self.cuda = device.type == "cuda"
        self._ring: list[HostSet] = []
        self._next = 0

    def take(self, tokens: int = 0, seqs: int = 0, width: int = 0) -> HostSet:
        """A set to pack into (its previous copy has run), large enough for a forward of this size."""
        if not self.cuda:
            if not self._ring or not self._ring[0].fits(tokens, seqs, width):
                self._ring = [self._new(tokens, seqs, width)]
            return self._ring[0]
        if tokens > self.max_tokens or seqs > self.max_seqs or width > self.width:
            return self._new(tokens, seqs, width)  # a one-off: its copy keeps it alive
        ring = self._ring
        i = self._next % len(ring) if ring else 0
        if ring and (ring[i].copied.query() or len(ring) >= self.MAX_SETS):
            ring[i].copied.synchronize()
        else:
            ring.insert(i, self._new(0, 0, 0))
        self._next = i + 1
        return ring[i]

    def _new(self, tokens: int, seqs: int, width: int) -> HostSet:
        rows = torch.zeros(BUFFER_ROWS, max(tokens, self.max_tokens), dtype=torch.long, pin_memory=self.cuda)
        tables = torch.full((max(seqs, self.max_seqs), max(width, self.width)), self.fill, dtype=torch.long,
                            pin_memory=self.cuda)
        return HostSet(rows, tables, torch.cuda.Event() if self.cuda else None)
