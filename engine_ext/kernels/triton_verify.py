"""A cycle's commit in one launch: each row's tokens in commit order, how many it commits, its last token and its
shift, from the token buffer and the plan's index lanes (speculation/verify.py `commit_rows` is the reference).

The torch form is about a dozen small launches (the gathers, the draft comparison's cumprod, the count, the last
token's gather, the concatenation for the host copy), each a few microseconds of host time on the critical path
between a cycle's verify pass and its host copy. One program per row does them in registers: its lanes are at most
k + passes + 1 wide.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# Every runtime argument, none specialised on its value or alignment: a new batch size compiles nothing
_ARGS = ["buf_ptr", "lanes_ptr", "out_ptr", "last_ptr", "shift_ptr", "R", "W", "stride_out", "has_shift"]
_MIN_BLOCK_W = 16  # lanes of one row (k + passes + 1 wide): one variant up to 16, so warm-up compiles it


@triton.jit(do_not_specialize=_ARGS, do_not_specialize_on_alignment=_ARGS)
def _commit_kernel(buf_ptr, lanes_ptr, out_ptr, last_ptr, shift_ptr, R, W, stride_out, has_shift,
                   BLOCK_W: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    w = tl.arange(0, BLOCK_W)
    inside = w < W
    lane = lanes_ptr + r * W + w  # lane i of row r: lanes_ptr + (i * R + r) * W
    order = tl.load(lane, mask=inside, other=-1)
    draft = tl.load(lane + R * W, mask=inside, other=-1)
    target = tl.load(lane + 2 * R * W, mask=inside, other=-1)
    fixed = tl.load(lanes_ptr + 3 * R * W + r * W)
    verifies = (tl.load(lanes_ptr + 4 * R * W + r * W) > 0).to(tl.int64)
    tokens = tl.load(buf_ptr + tl.maximum(order, 0), mask=inside, other=0)
    drawn = tl.load(buf_ptr + tl.maximum(draft, 0), mask=inside, other=0)
    wanted = tl.load(buf_ptr + tl.maximum(target, 0), mask=inside, other=0)
    # accepted: the leading drafts equal to their target (the first lane that is not a draft or differs; lanes past
    # W read as no draft)
    miss = (drawn != wanted) | (draft < 0)
    accepted = tl.min(tl.where(miss, w, BLOCK_W), axis=0).to(tl.int64)
    count = fixed + verifies * (accepted + 1)
    tl.store(out_ptr + r * stride_out + w, tokens, mask=inside)
    tl.store(out_ptr + r * stride_out + W, count)
    at = tl.maximum(count - 1, 0)
    tl.store(last_ptr + r, tl.sum(tl.where(w == at, tokens, 0), axis=0))
    if has_shift != 0:
        tl.store(shift_ptr + r, verifies * accepted)


def commit_rows_triton(buf: torch.Tensor, lanes: torch.Tensor, shifts: bool):
    """verify.commit_rows in one launch: buf [N] long, lanes [5, R, W] long (executor._Layout's table, on the
    device) -> (out [R, W + 1]: tokens then the count, last [R], shift [R] or None)."""
    _, rows, width = lanes.shape
    out = torch.empty(rows, width + 1, dtype=torch.long, device=buf.device)
    last = torch.empty(rows, dtype=torch.long, device=buf.device)
    shift = torch.empty(rows, dtype=torch.long, device=buf.device) if shifts else last
    _commit_kernel[(rows,)](buf, lanes, out, last, shift, rows, width, out.stride(0), int(shifts),
                            BLOCK_W=max(_MIN_BLOCK_W, triton.next_power_of_2(width)))
    return out, last, shift if shifts else None
