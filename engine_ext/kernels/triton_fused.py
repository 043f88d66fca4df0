"""Fused element-wise work of the decoder layer in Triton: the kernels between the matrix products.

At small batches a decode step is bound by the number of kernels, not by bytes: the plain-torch
layer (model.TorchOps) runs about 36 small kernels per layer for the norms, the rotary embedding,
the KV-cache write, SiLU and the residual adds. These three kernels do the same work in four
launches per layer, rounding where torch rounds (each bf16 operation's result is rounded to bf16
before the next one reads it), so their outputs match the torch ops bit for bit up to the last
bit of an fp32 transcendental:

- add_rms_norm:  x = x + delta (rounded), h = weight * rms_norm(x)   one program per token
- rope_write_kv: rotate q in place in the fused qkv output, rotate k, write k and v into the
                 paged cache at each token's slot                      one program per (token, head)
- silu_mul:      act = silu(gate) * up from the fused gate/up output  one program per (token, column block)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, res_ptr, out_ptr, N, eps, stride_x, stride_d, stride_r, stride_o,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0)
    if HAS_DELTA:
        d = tl.load(d_ptr + row * stride_d + offs, mask=m, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_r + offs, x, mask=m)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    normed = (xf * (1.0 / tl.sqrt(var + eps))).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=m)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, weight * rms_norm(x + delta)); with delta None, (x, weight * rms_norm(x)).

    The sum is written in place into x (callers own x: it is the residual stream)."""
    num_tokens, n = x.shape
    out = torch.empty_like(x)
    if num_tokens:
        block = triton.next_power_of_2(n)
        _add_rms_norm_kernel[(num_tokens,)](
            x, delta if delta is not None else x, weight, x, out, n, eps, x.stride(0),
            delta.stride(0) if delta is not None else 0, x.stride(0), out.stride(0),
            HAS_DELTA=delta is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return x, out


@triton.jit
def _rope_write_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, slot_ptr, num_heads, num_kv_heads,
                          stride_t, stride_c, stride_s, stride_kb, stride_ks, stride_kh,
                          PAGE: tl.constexpr, HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, HALF)
    src = qkv_ptr + t * stride_t + h * (2 * HALF)
    x1 = tl.load(src + offs)
    x2 = tl.load(src + HALF + offs)
    dt = qkv_ptr.dtype.element_ty
    if h < num_heads + num_kv_heads:
        # torch: x * cos + cat(-x2, x1) * sin, every product and the sum rounded to the model dtype
        c1 = tl.load(cos_ptr + t * stride_c + offs).to(tl.float32)
        c2 = tl.load(cos_ptr + t * stride_c + HALF + offs).to(tl.float32)
        s1 = tl.load(sin_ptr + t * stride_s + offs).to(tl.float32)
        s2 = tl.load(sin_ptr + t * stride_s + HALF + offs).to(tl.float32)
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        o1 = ((f1 * c1).to(dt).to(tl.float32) + (-f2 * s1).to(dt).to(tl.float32)).to(dt)
        o2 = ((f2 * c2).to(dt).to(tl.float32) + (f1 * s2).to(dt).to(tl.float32)).to(dt)
        if h < num_heads:
            tl.store(src + offs, o1)
            tl.store(src + HALF + offs, o2)
        else:
            slot = tl.load(slot_ptr + t).to(tl.int64)
            dst = k_ptr + (slot // PAGE) * stride_kb + (slot % PAGE) * stride_ks + (h - num_heads) * stride_kh
            tl.store(dst + offs, o1.to(k_ptr.dtype.element_ty))
            tl.store(dst + HALF + offs, o2.to(k_ptr.dtype.element_ty))
    else:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        dst = (v_ptr + (slot // PAGE) * stride_kb + (slot % PAGE) * stride_ks
               + (h - num_heads - num_kv_heads) * stride_kh)
        tl.store(dst + offs, x1.to(v_ptr.dtype.element_ty))
        tl.store(dst + HALF + offs, x2.to(v_ptr.dtype.element_ty))


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """Rotate q and k of the fused [T, (H + 2 KVH) * D] qkv output, write k and v into the paged cache at
    `slot_mapping`; returns q as a [T, H, D] view of qkv (rotated in place)."""
    num_tokens, width = qkv.shape
    head_dim = width // (num_heads + 2 * num_kv_heads)
    if qkv.stride(1) != 1 or cos.stride(1) != 1 or sin.stride(1) != 1 or k_cache.stride(3) != 1:
        raise ValueError("rope_write_kv needs unit stride along the feature dimension")
    if head_dim & (head_dim - 1) or k_cache.stride() != v_cache.stride():
        raise ValueError("rope_write_kv needs a power-of-two head_dim and identically laid out K/V caches")
    if num_tokens:
        _rope_write_kv_kernel[(num_tokens, num_heads + 2 * num_kv_heads)](
            qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads,
            qkv.stride(0), cos.stride(0), sin.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            PAGE=k_cache.shape[1], HALF=head_dim // 2, num_warps=1)
    return qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, N, stride_g, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < N
    g = tl.load(gu_ptr + row * stride_g + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_g + N + cols, mask=m, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * u).to(dt), mask=m)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate_up[:, :N]) * gate_up[:, N:]   -> [T, N]."""
    num_tokens, width = gate_up.shape
    n = width // 2
    if gate_up.stride(1) != 1:
        raise ValueError("silu_mul needs unit stride along the feature dimension")
    out = torch.empty(num_tokens, n, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(n))
    if num_tokens:
        _silu_mul_kernel[(num_tokens, triton.cdiv(n, block))](gate_up, out, n, gate_up.stride(0), out.stride(0),
                                                             BLOCK=block, num_warps=4)
    return out


class TritonOps:
    """model.TorchOps' contract, in the fused kernels above."""

    add_rms_norm = staticmethod(add_rms_norm)
    rope_write_kv = staticmethod(rope_write_kv)
    silu_mul = staticmethod(silu_mul)
