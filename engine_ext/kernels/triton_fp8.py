"""The FP8 base weights' products on the GPU: a W8A16 GEMM in Triton (quantization.Fp8Weights' matmul).

    y = (x @ float(W8).T) * scale (+ bias)      x [T, in] bf16/fp16/fp32, W8 [out, in] e4m3, scale [out] fp32

the contract of quantization.fp8_linear, the plain-torch reference. Each program owns a [BLOCK_M, BLOCK_N] tile of
y: it streams its BLOCK_N rows of W8 once (one byte a weight), widens each [BLOCK_K, BLOCK_N] tile to the
activations' dtype in registers and multiplies it on the tensor cores with float32 accumulation; the per-channel
scale and the bias are applied to the float32 sum, which is rounded once to the activations' dtype.

Decode-sized products (up to `SMALL_M` tokens: decode steps, drafting and verify passes) read the weights once for
all of their tokens, so they are bound by the weights' bytes: the tile is one BLOCK_M of tokens by a BLOCK_N narrow
enough that the products' programs fill the chip (`KernelSettings.fp8_programs`), and each program keeps
`fp8_stages` K tiles in flight. Larger products (prompts) are bound by arithmetic and take square tiles, programs
ordered in groups of GROUP_M row tiles so a group's weight tiles are reused from L2.

Activations are not quantized, so the products stay within bf16 rounding of the reference. `bench/fp8_gemm.py` times
this kernel beside cuBLAS's bf16 product and `torch._scaled_mm` (FP8 x FP8 with per-token activation scales), and
sweeps the launch settings; the defaults here are not yet measured on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .settings import KernelSettings

_DEFAULTS = KernelSettings()
SMALL_M = 64  # products of up to this many tokens take the bytes-bound tiles
# Prompt-sized tiles: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
_LARGE = (128, 128, 64, 8, 3)
GROUP_M = 8
# Shared memory the pipeline stages may take (the H100/H200 allow 227 KB a block; the rest is the compiler's)
SMEM_BUDGET = 160 * 1024


@triton.jit
def _w8a16_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                  HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    # GROUP row tiles side by side walk the columns together (their weight tiles shared through L2)
    per_group = GROUP * grid_n
    first_m = (pid // per_group) * GROUP
    group_rows = tl.minimum(grid_m - first_m, GROUP)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_in = rm < M
    n_in = rn < N
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]  # [BLOCK_K, BLOCK_N]: W8 read transposed
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_in[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_in[None, :], other=0.0)
        else:
            k_in = rk + k0 < K
            x = tl.load(x_ptrs, mask=m_in[:, None] & k_in[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_in[None, :] & k_in[:, None], other=0.0)
        if IEEE:
            acc = tl.dot(x, w.to(x.dtype), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc *= tl.load(scale_ptr + rn, mask=n_in, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_in, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_in[:, None] & n_in[None, :])


def launch_config(M: int, N: int, K: int, settings: KernelSettings = _DEFAULTS, x_bytes: int = 2
                  ) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of a [M, K] x [K, N] product whose activations take x_bytes an
    element; the stages are as many as the settings ask for while their tiles fit SMEM_BUDGET."""
    if M > SMALL_M:
        block_m, block_n, block_k, warps, stages = _LARGE
        return block_m, block_n, block_k, warps, _fit(stages, block_m, block_n, block_k, x_bytes)
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64
    block_k = min(settings.fp8_block_k, max(16, triton.next_power_of_2(K)))
    block_n = settings.fp8_block_n
    if block_n == 0:  # the widest column tile (at most 128, at least 16) whose programs still fill the chip
        block_n = 128
        while block_n > 16 and triton.cdiv(N, block_n) * triton.cdiv(M, block_m) < settings.fp8_programs:
            block_n //= 2
    return block_m, block_n, block_k, settings.fp8_warps, _fit(settings.fp8_stages, block_m, block_n, block_k, x_bytes)


def _fit(stages: int, block_m: int, block_n: int, block_k: int, x_bytes: int) -> int:
    """At most `stages` pipeline stages (at least 1) whose x and W8 tiles fit in SMEM_BUDGET bytes."""
    per_stage = block_m * block_k * x_bytes + block_k * block_n
    return max(1, min(stages, SMEM_BUDGET // per_stage))


def fp8_linear_triton(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                      *, settings: KernelSettings = _DEFAULTS) -> torch.Tensor:
    """quantization.fp8_linear's contract on the GPU: x [..., in], w8 [out, in] float8_e4m3fn (rows contiguous),
    scale [out] float32, bias [out] or None -> y [..., out] in x's dtype."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, K = x2.shape
    N = w8.shape[0]
    if w8.shape[1] != K or w8.stride(1) != 1 or scale.numel() != N:
        raise ValueError(f"fp8 product: x {tuple(x.shape)}, w8 {tuple(w8.shape)} (strides {w8.stride()}), "
                         f"{scale.numel()} scales")
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y.reshape(*lead, N)
    block_m, block_n, block_k, warps, stages = launch_config(M, N, K, settings, x.element_size())
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
    _w8a16_kernel[grid](x2, w8, scale, bias if bias is not None else scale, y, M, N, K, x2.stride(0), w8.stride(0),
                        y.stride(0), HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                        GROUP=GROUP_M, EVEN_K=K % block_k == 0, IEEE=x.dtype == torch.float32, num_warps=warps,
                        num_stages=stages)
    return y.reshape(*lead, N)
