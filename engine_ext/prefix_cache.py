"""Prefix caching keyed by adapter: which KV blocks may be shared between requests, and their keys.

A full block's key is a hash chain: h_i = sha256(h_{i-1} || its block_size token ids), h_{-1} = the sequence's
root, sha256 of (adapter name, adapter version) (`root_hash`; the base model is its own root). The KV of a
position depends on every token before it and on the weights that computed it, and a chain hash covers exactly
those: blocks are shared only within one (adapter, version), a base-only request's only with base-only ones, and
the hash is cryptographic, so two different prefixes never meet under one key.

Which KV is final, and so may be filed (BlockManager.register), follows from who writes it:
- A prompt (a new request, or a preempted one computing its tokens again) is computed whole in one adapter-on
  forward: a plain step's, or in a speculative cycle the first drafting pass with room for it or the verify pass
  (plan.py: a PROMPT entry always has its adapter on).
- A committed token's KV is written by the forward that takes it as input, in the step after the one that drew
  it: a plain step and a rider's drafting pass run the adapter on; a drafter's drafting passes write KV with the
  adapters off at the positions of its last token and its drafts, and the verify pass (adapter on) rewrites every
  one of them, [last, d1..dm], before anything reads them. Past the accepted drafts those positions hold KV of
  rejected tokens: the next step overwrites them.
- Overlap: step N+1 is queued before step N is read, so at the time a step is queued nothing of it is final.
  Once step N is read and its tokens committed (LLMEngine._commit_run), the sequence's positions
  [0, num_tokens - 1) hold adapter-on KV of committed tokens (Sequence.num_computed), and step N+1, planned from
  where N leaves the sequence, writes only at num_tokens - 1 and past it.
So the blocks filed are the full blocks below num_computed, at the read of the step that completed them, and
only for a sequence still running (an aborted one, or one preempted while a queued step held it, files none). A
cached block is never written again: a request that takes it computes from the block after it, and always
computes its last token itself (its logits start the output)."""

from __future__ import annotations

import hashlib
from array import array


def root_hash(adapter: str | None, version: int) -> bytes:
    """The chain root of one adapter version (adapter None: the base model alone)."""
    return hashlib.sha256(repr((adapter, version)).encode()).digest()


def chain_hashes(hashes: list[bytes], root: bytes, token_ids: list[int], block_size: int, num_blocks: int) -> None:
    """Extend `hashes` (the chain of `token_ids`' first blocks so far) to its first `num_blocks` full blocks."""
    parent = hashes[-1] if hashes else root
    for i in range(len(hashes), num_blocks):
        block = array("q", token_ids[i * block_size : (i + 1) * block_size])
        parent = hashlib.sha256(parent + block.tobytes()).digest()
        hashes.append(parent)

