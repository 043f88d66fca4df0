"""The FP8 base weights' products on the GPU: a W8A16 GEMM in Triton (quantization.Fp8Weights' matmul).

    y = (x @ float(W8).T) * scale (+ bias)      x [T, in] bf16/fp16/fp32, W8 [out, in] e4m3, scale [out] fp32

the contract of quantization.fp8_linear, the plain-torch reference. Each program owns a [BLOCK_M, BLOCK_N] tile of
y over a range of the K columns: it streams its BLOCK_N rows of W8 once (one byte a weight), widens each
[BLOCK_K, BLOCK_N] tile to the activations' dtype in registers and multiplies it on the tensor cores with float32
accumulation; the per-channel scale and the bias are applied to the float32 sum, which is rounded once to the
activations' dtype.

Decode-sized products (up to `BYTES_BOUND_M` tokens: decode steps, drafting and verify passes) are bound by the
weights' bytes. Their tiles are at most `fp8_block_m` (64) tokens by `fp8_block_n` columns, a column's tiles side by
side so their weight tiles come from L2 once one has read them, computed as y = x @ W8.T or, up to `fp8_swap_tokens`
tokens, transposed (y.T = W8 @ x.T: the widened weights the tensor cores' first operand, the tokens the narrow
second); when those tiles are too few to keep every SM streaming
(`fp8_programs`), K is split between programs (split-K): each writes its float32 partial sum, and a second kernel
adds the partials in split order (deterministic: no atomics) and applies scale and bias. Larger products (prompts)
are bound by arithmetic and take square tiles, programs ordered in groups of GROUP_M row tiles so a group's weight
tiles are reused from L2.

Activations are not quantized, so the products stay within bf16 rounding of the reference. `bench/fp8_gemm.py` times
this kernel beside cuBLAS's bf16 product and `torch._scaled_mm` (FP8 x FP8 with per-token activation scales), and
sweeps the launch settings (bench/RESULTS.md, section 15).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .settings import KernelSettings

_DEFAULTS = KernelSettings()
BYTES_BOUND_M = 256  # products of up to this many tokens take the bytes-bound tiles
# Prompt-sized tiles: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
_LARGE = (128, 128, 64, 8, 3)
GROUP_M = 8
# Shared memory the pipeline stages may take (the H100/H200 allow 227 KB a block; the rest is the compiler's)
SMEM_BUDGET = 160 * 1024
SUM_BLOCK = 1024  # columns a program of the split-sum kernel adds up


@triton.jit
def _w8a16_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, part_ptr, M, N, K, K_SPLIT, stride_xm, stride_wn,
                  stride_ym, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, EVEN_K: tl.constexpr,
                  IEEE: tl.constexpr, SPLIT: tl.constexpr, SWAP: tl.constexpr):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    # GROUP row tiles side by side walk the columns together (their weight tiles shared through L2)
    per_group = GROUP * grid_n
    first_m = (pid // per_group) * GROUP
    group_rows = tl.minimum(grid_m - first_m, GROUP)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    k_first = pid_k * K_SPLIT  # this program's K columns: [k_first, k_first + K_SPLIT), K_SPLIT a BLOCK_K multiple
    rk = k_first + tl.arange(0, BLOCK_K)
    # SWAP: the transposed tile, y.T = W8 @ x.T, [BLOCK_N, BLOCK_M]: the widened weights are the tensor cores' first
    # operand (kept in registers) and the few tokens the narrow second; else y = x @ W8.T, [BLOCK_M, BLOCK_N]
    if SWAP:
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
        x_ptrs = x_ptr + rm.to(tl.int64) * stride_xm + rk[:, None]  # [BLOCK_K, BLOCK_M]
        w_ptrs = w_ptr + rn.to(tl.int64) * stride_wn + rk[None, :]  # [BLOCK_N, BLOCK_K]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        x_ptrs = x_ptr + rm.to(tl.int64) * stride_xm + rk[None, :]  # [BLOCK_M, BLOCK_K]
        w_ptrs = w_ptr + rn.to(tl.int64) * stride_wn + rk[:, None]  # [BLOCK_K, BLOCK_N]: W8 read transposed
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    m_in = rm < M
    n_in = rn < N
    for k0 in range(k_first, tl.minimum(k_first + K_SPLIT, K), BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_in, other=0.0)
            w = tl.load(w_ptrs, mask=n_in, other=0.0)
        else:
            k_left = K - (k0 - k_first)  # rk - k_first + k0 < K
            x_k = (rk[:, None] if SWAP else rk[None, :]) < k_left
            w_k = (rk[None, :] if SWAP else rk[:, None]) < k_left
            x = tl.load(x_ptrs, mask=m_in & x_k, other=0.0)
            w = tl.load(w_ptrs, mask=n_in & w_k, other=0.0)
        if SWAP:
            if IEEE:
                acc = tl.dot(w.to(x.dtype), x, acc, input_precision="ieee")
            else:
                acc = tl.dot(w.to(x.dtype), x, acc)
        else:
            if IEEE:
                acc = tl.dot(x, w.to(x.dtype), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w.to(x.dtype), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SPLIT == 1:
        if HAS_SCALE:
            acc *= tl.load(scale_ptr + rn, mask=n_in, other=0.0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_in, other=0.0).to(tl.float32)
        tl.store(y_ptr + rm.to(tl.int64) * stride_ym + rn, acc.to(y_ptr.dtype.element_ty), mask=m_in & n_in)
    else:  # this split's partial sum, float32 [SPLIT, M, N]
        tl.store(part_ptr + (pid_k * M + rm).to(tl.int64) * N + rn, acc, mask=m_in & n_in)


@triton.jit
def _split_sum_kernel(part_ptr, scale_ptr, bias_ptr, y_ptr, M, N, stride_ym, HAS_SCALE: tl.constexpr,
                      HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """y[m, cols] = (the SPLIT partial sums, added in split order) (* scale) (+ bias), rounded once."""
    m = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n_in = rn < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(part_ptr + (s * M + m).to(tl.int64) * N + rn, mask=n_in, other=0.0)
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + rn, mask=n_in, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_in, other=0.0).to(tl.float32)
    tl.store(y_ptr + m.to(tl.int64) * stride_ym + rn, acc.to(y_ptr.dtype.element_ty), mask=n_in)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, part_ptr, M, N, K, K_SPLIT, stride_xm, stride_wn,
                 stride_ym, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, M_TILE: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr):
    """The products of a few tokens without the tensor cores: a program widens its [BLOCK_N, BLOCK_K] weight tiles
    to float32 once and multiplies them by each of its M_TILE tokens' rows (float32 sums), over its K share."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = rn < N
    k_first = pid_k * K_SPLIT
    rk = k_first + tl.arange(0, BLOCK_K)
    rows = tl.arange(0, M_TILE)
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    acc = tl.zeros((M_TILE, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_first, tl.minimum(k_first + K_SPLIT, K), BLOCK_K):
        k_in = rk + (k0 - k_first) < K
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_in[:, None], other=0.0).to(tl.float32)
        else:
            w = tl.load(w_ptrs, mask=n_in[:, None] & k_in[None, :], other=0.0).to(tl.float32)
        for i in tl.static_range(M_TILE):
            m = pid_m * M_TILE + i
            x = tl.load(x_ptr + m.to(tl.int64) * stride_xm + rk + (k0 - k_first), mask=k_in & (m < M),
                        other=0.0).to(tl.float32)
            acc += tl.where(rows[:, None] == i, tl.sum(w * x[None, :], axis=1)[None, :], 0.0)
        w_ptrs += BLOCK_K
    rm = pid_m * M_TILE + rows[:, None]
    mask = (rm < M) & n_in[None, :]
    if SPLIT == 1:
        if HAS_SCALE:
            acc *= tl.load(scale_ptr + rn, mask=n_in, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_in, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm.to(tl.int64) * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + (pid_k * M + rm).to(tl.int64) * N + rn[None, :], acc, mask=mask)


def _gemv_config(M: int, N: int, K: int, settings: KernelSettings) -> tuple[int, int, int, int]:
    """(M_TILE, BLOCK_N, BLOCK_K, split) of the GEMV kernel: every token in one tile (weights read once), K split
    as the GEMM's decode tiles split it."""
    m_tile = triton.next_power_of_2(M)
    block_n = min(settings.fp8_gemv_block_n, max(16, triton.next_power_of_2(N)))
    block_k = min(settings.fp8_block_k, max(16, triton.next_power_of_2(K)))
    tiles, steps, split = triton.cdiv(N, block_n), triton.cdiv(K, block_k), 1
    while tiles * split < settings.fp8_programs and steps >= 2 * split * settings.fp8_split_steps:
        split *= 2
    return m_tile, block_n, block_k, split


def launch_config(M: int, N: int, K: int, settings: KernelSettings = _DEFAULTS, x_bytes: int = 2, w_bytes: int = 1
                  ) -> tuple[int, int, int, int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, split, swap) of a [M, K] x [K, N] product whose activations take
    x_bytes an element and weights w_bytes; split is how many programs share a tile's K columns, the stages are as
    many as the settings ask for while their tiles fit SMEM_BUDGET, and swap computes the tile transposed (weights
    first)."""
    if M > BYTES_BOUND_M:
        block_m, block_n, block_k, warps, stages = _LARGE
        return block_m, block_n, block_k, warps, _fit(stages, block_m, block_n, block_k, x_bytes, w_bytes), 1, False
    block_m = min(settings.fp8_block_m, max(16, triton.next_power_of_2(M)))
    block_k, block_n = settings.fp8_block_k, settings.fp8_block_n
    if settings.fp8_multi_tokens and M > settings.fp8_multi_tokens:  # verify passes, short prompts
        block_k, block_n = settings.fp8_multi_block_k or block_k, settings.fp8_multi_block_n or block_n
    block_k = min(block_k, max(16, triton.next_power_of_2(K)))
    block_n = min(block_n, max(16, triton.next_power_of_2(N)))
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    steps = triton.cdiv(K, block_k)
    # split K (in halves, quarters, ...) while the tiles are fewer than the programs asked for and each share keeps
    # at least fp8_split_steps K tiles to stream
    split = 1
    while tiles * split < settings.fp8_programs and steps >= 2 * split * settings.fp8_split_steps:
        split *= 2
    stages = _fit(settings.fp8_stages, block_m, block_n, block_k, x_bytes, w_bytes)
    return block_m, block_n, block_k, settings.fp8_warps, stages, split, M <= settings.fp8_swap_tokens


def _fit(stages: int, block_m: int, block_n: int, block_k: int, x_bytes: int, w_bytes: int = 1) -> int:
    """At most `stages` pipeline stages (at least 1) whose x and weight tiles fit in SMEM_BUDGET bytes."""
    per_stage = block_m * block_k * x_bytes + block_k * block_n * w_bytes
    return max(1, min(stages, SMEM_BUDGET // per_stage))


def fp8_linear_triton(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                      *, settings: KernelSettings = _DEFAULTS) -> torch.Tensor:
    """quantization.fp8_linear's contract on the GPU: x [..., in], w8 [out, in] float8_e4m3fn (rows contiguous),
    scale [out] float32, bias [out] or None -> y [..., out] in x's dtype."""
    if scale.numel() != w8.shape[0]:
        raise ValueError(f"fp8 product: w8 {tuple(w8.shape)}, {scale.numel()} scales")
    return _gemm(x, w8, scale, bias, settings)


def linear_triton(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                  *, settings: KernelSettings = _DEFAULTS) -> torch.Tensor:
    """F.linear's contract with the same kernel over weights in x's dtype (no widening, no scale): x [..., in],
    w [out, in] (rows contiguous), bias [out] or None -> y [..., out]. Decode- and verify-sized products take its
    split-K tiles (TritonOps.linear, KernelSettings.triton_linear_tokens)."""
    return _gemm(x, w, None, bias, settings)


def _gemm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
          settings: KernelSettings) -> torch.Tensor:
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, K = x2.shape
    N = w.shape[0]
    if w.shape[1] != K or w.stride(1) != 1:
        raise ValueError(f"product: x {tuple(x.shape)}, w {tuple(w.shape)} (strides {w.stride()})")
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y.reshape(*lead, N)
    scale_arg = scale if scale is not None else y  # never read without HAS_SCALE
    bias_arg = bias if bias is not None else scale_arg
    if M <= settings.fp8_gemv_tokens:
        m_tile, block_n, block_k, split = _gemv_config(M, N, K, settings)
        k_split = triton.cdiv(triton.cdiv(K, block_k), split) * block_k
        split = triton.cdiv(K, k_split)
        part = torch.empty(split, M, N, dtype=torch.float32, device=x.device) if split > 1 else y
        _gemv_kernel[(triton.cdiv(N, block_n), split, triton.cdiv(M, m_tile))](
            x2, w, scale_arg, bias_arg, y, part, M, N, K, k_split, x2.stride(0), w.stride(0), y.stride(0),
            HAS_SCALE=scale is not None, HAS_BIAS=bias is not None, M_TILE=m_tile, BLOCK_N=block_n, BLOCK_K=block_k,
            EVEN_K=K % block_k == 0, SPLIT=split, num_warps=settings.fp8_warps)
        return _sum_splits(y, part, scale, bias, split).reshape(*lead, N)
    block_m, block_n, block_k, warps, stages, split, swap = launch_config(M, N, K, settings, x.element_size(),
                                                                          w.element_size())
    k_split = triton.cdiv(triton.cdiv(K, block_k), split) * block_k
    split = triton.cdiv(K, k_split)  # no empty share when K's tiles do not divide evenly
    part = torch.empty(split, M, N, dtype=torch.float32, device=x.device) if split > 1 else y
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n), split)
    _w8a16_kernel[grid](x2, w, scale_arg, bias_arg, y, part, M, N, K, k_split, x2.stride(0), w.stride(0), y.stride(0),
                        HAS_SCALE=scale is not None, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
                        BLOCK_K=block_k, GROUP=GROUP_M, EVEN_K=K % block_k == 0, IEEE=x.dtype == torch.float32,
                        SPLIT=split, SWAP=swap, num_warps=warps, num_stages=stages)
    return _sum_splits(y, part, scale, bias, split).reshape(*lead, N)


def _sum_splits(y: torch.Tensor, part: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
                split: int) -> torch.Tensor:
    """y from the float32 partial sums of a product whose K was split (scale and bias applied once); as it is
    when it was not (the product kernel wrote y itself)."""
    if split > 1:
        M, N = y.shape
        scale_arg = scale if scale is not None else y
        _split_sum_kernel[(M, triton.cdiv(N, SUM_BLOCK))](part, scale_arg, bias if bias is not None else scale_arg,
                                                          y, M, N, y.stride(0), HAS_SCALE=scale is not None,
                                                          HAS_BIAS=bias is not None, SPLIT=split, BLOCK=SUM_BLOCK,
                                                          num_warps=4)
    return y
