"""Paged KV cache writes and the plain-torch paged attention reference.

Every sequence's keys/values live in fixed-size blocks of one cache tensor per layer,
`[num_blocks, block_size, num_kv_heads, head_dim]`; a block table maps a sequence's logical
blocks to physical ones. A faster kernel (kernels/triton_attention.py) replaces `paged_attention`
behind the same signature through AttnMetadata.kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class AttnMetadata:
    positions: torch.Tensor  # [T] absolute position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] flat cache slot (block * block_size + offset) each token's KV is written to
    block_tables: torch.Tensor  # [B, max_blocks] physical block ids, padded with 0
    token_seq: torch.Tensor  # [T] which sequence (row of block_tables) each token belongs to
    token_qidx: torch.Tensor  # [T] index of the token among its sequence's query tokens
    max_query_len: int
    # The attention kernel this forward runs (same signature as paged_attention); None: the torch
    # reference below. Set per forward by the model runner (backend.Backend.attention).
    kernel: Callable | None = None
    # Some sequence has several query tokens (a verify pass, a prompt): kernels may tile for that. None: from
    # max_query_len (a CUDA graph, whose max_query_len is its bucket, says which kind it was captured for).
    multi: bool | None = None

    def __post_init__(self) -> None:
        if self.multi is None:
            self.multi = self.max_query_len > 1


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor):
    """k_cache.view(-1, H, D)[slots[i]] = k[i]  (same for v)."""
    kvh, d = k_cache.shape[-2:]
    k_cache.view(-1, kvh, d).index_copy_(0, slots, k)
    v_cache.view(-1, kvh, d).index_copy_(0, slots, v)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    meta: AttnMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """out[t] = softmax(q[t] . K[seq(t), :pos(t)+1]^T * scale) @ V[seq(t), :pos(t)+1]   -> [T, H, D].

    Causal over each sequence's own cache; queries of one sequence may be many (prefill, verify)."""
    if meta.kernel is not None:
        return meta.kernel(q, k_cache, v_cache, meta, scale, sliding_window)
    num_tokens, heads, d = q.shape
    kvh = k_cache.shape[2]
    group = heads // kvh
    b, max_blocks = meta.block_tables.shape
    lk = max_blocks * k_cache.shape[1]
    keys = k_cache[meta.block_tables].reshape(b, lk, kvh, d).transpose(1, 2)  # (B, KVH, Lk, D)
    values = v_cache[meta.block_tables].reshape(b, lk, kvh, d).transpose(1, 2)
    qpad = q.new_zeros(b, meta.max_query_len, heads, d)
    qpad[meta.token_seq, meta.token_qidx] = q
    qpos = torch.zeros(b, meta.max_query_len, dtype=torch.long, device=q.device)
    qpos[meta.token_seq, meta.token_qidx] = meta.positions
    qg = qpad.view(b, meta.max_query_len, kvh, group, d).permute(0, 2, 3, 1, 4)  # (B, KVH, G, Q, D)
    scores = torch.einsum("bkgqd,bkld->bkgql", qg, keys).float() * scale
    key_pos = torch.arange(lk, device=q.device)
    allowed = key_pos[None, None, :] <= qpos[:, :, None]  # (B, Q, Lk)
    if sliding_window is not None:
        allowed &= key_pos[None, None, :] > qpos[:, :, None] - sliding_window
    scores.masked_fill_(~allowed[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    out = torch.einsum("bkgql,bkld->bqkgd", probs, values).reshape(b, meta.max_query_len, heads, d)
    return out[meta.token_seq, meta.token_qidx]

