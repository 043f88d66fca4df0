"""The FP8 weights' W8A16 GEMM (kernels/triton_fp8.py) against the plain-torch reference (quantization.fp8_linear), and
the same kernel over bf16 weights against F.linear, on the GPU: the 1B and 8B shapes' products at decode, verify and prompt token counts, odd sizes, a bias, strided rows,
other launch settings. In bfloat16 the kernel rounds once where the reference rounds its product and then its
scaled product, so both are held to the float32 reference within bf16 rounding."""

import pytest
import torch

from engine_ext.quantization import fp8_linear, quantize_fp8

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

# (tokens, in, out): 1B qkv / gate_up, 8B o / down, verify and prompt sizes, odd sizes
CASES = [(1, 2048, 3072), (32, 2048, 16384), (8, 4096, 4096), (160, 14336, 4096), (513, 2048, 3072), (7, 200, 72),
         (2048, 4096, 1024)]
BF16_ROUNDING = 2.0**-8  # bfloat16 keeps 8 significant bits


def _rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("t,fin,fout", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_matches_reference(t, fin, fout, dtype, bias):
    from engine_ext.kernels.triton_fp8 import fp8_linear_triton

    g = torch.Generator("cuda").manual_seed(t + fin + fout)
    w8, scale = quantize_fp8(torch.randn(fout, fin, generator=g, device="cuda") * fin**-0.5)
    b = torch.randn(fout, generator=g, device="cuda").to(dtype) if bias else None
    x = torch.randn(t, fin + 16, generator=g, device="cuda").to(dtype)[:, 8:fin + 8]  # rows strided past their length
    exact = fp8_linear(x.float(), w8, scale, None if b is None else b.float())
    out = fp8_linear_triton(x, w8, scale, b)
    assert out.dtype == dtype and out.shape == (t, fout)
    if dtype == torch.float32:
        assert _rel(out, exact) < 1e-5
    else:
        reference = fp8_linear(x, w8, scale, b)  # the reference in bf16, as a CPU engine in bf16 would run it
        assert _rel(out, exact) < BF16_ROUNDING
        assert _rel(out, exact) <= 1.5 * _rel(reference, exact) + 1e-4


def test_launch_settings_change_nothing():
    from engine_ext.kernels import KernelSettings
    from engine_ext.kernels.triton_fp8 import fp8_linear_triton

    g = torch.Generator("cuda").manual_seed(0)
    w8, scale = quantize_fp8(torch.randn(4096, 4096, generator=g, device="cuda"))
    for t in (1, 5, 16, 32, 64, 160):
        x = torch.randn(t, 4096, generator=g, device="cuda").to(torch.bfloat16)
        ref = fp8_linear_triton(x, w8, scale)
        for s in (KernelSettings(fp8_block_k=64, fp8_block_n=16, fp8_stages=2, fp8_warps=2),
                  KernelSettings(fp8_block_k=512, fp8_block_n=128, fp8_stages=6, fp8_warps=8),
                  KernelSettings(fp8_split_steps=1 << 10),  # never split
                  KernelSettings(fp8_block_k=64, fp8_programs=4096, fp8_split_steps=1),  # split in 32
                  # transposed tiles (weights first): tokens in tiles of 16 to 256, narrow and split
                  KernelSettings(fp8_swap_tokens=256), KernelSettings(fp8_swap_tokens=256, fp8_block_m=256),
                  KernelSettings(fp8_swap_tokens=256, fp8_block_m=16, fp8_block_n=64, fp8_block_k=64),
                  KernelSettings(fp8_swap_tokens=256, fp8_block_m=128, fp8_programs=4096, fp8_split_steps=1),
                  # a few tokens in the GEMV kernel (no tensor cores), K split and not
                  KernelSettings(fp8_gemv_tokens=16), KernelSettings(fp8_gemv_tokens=16, fp8_gemv_block_n=32,
                                                                     fp8_block_k=512, fp8_split_steps=1 << 10),
                  # products past a few tokens in their own tiles
                  KernelSettings(fp8_multi_tokens=4, fp8_multi_block_k=32, fp8_multi_block_n=256),
                  KernelSettings(fp8_multi_tokens=32, fp8_multi_block_k=64, fp8_multi_block_n=64)):
            assert _rel(fp8_linear_triton(x, w8, scale, settings=s), ref) < 2e-3  # bf16 outputs, sums in another order


@pytest.mark.parametrize("t,fin,fout", CASES)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_the_same_gemm_over_dense_weights_matches_f_linear(t, fin, fout, bias):
    """linear_triton (the kernel over bf16 weights, no scale: TritonOps.linear from triton_linear_tokens tokens)
    against cuBLAS's product, both held to the float32 product within bf16 rounding."""
    import torch.nn.functional as F

    from engine_ext.kernels import KernelSettings
    from engine_ext.kernels.triton_fp8 import linear_triton

    g = torch.Generator("cuda").manual_seed(t + fin + fout)
    w = (torch.randn(fout, fin, generator=g, device="cuda") * fin**-0.5).to(torch.bfloat16)
    b = torch.randn(fout, generator=g, device="cuda").to(torch.bfloat16) if bias else None
    x = torch.randn(t, fin + 16, generator=g, device="cuda").to(torch.bfloat16)[:, 8:fin + 8]
    exact = F.linear(x.float(), w.float(), None if b is None else b.float())
    cublas = F.linear(x, w, b)
    for settings in (KernelSettings(), KernelSettings(fp8_swap_tokens=256, fp8_block_m=128)):
        out = linear_triton(x, w, b, settings=settings)
        assert out.dtype == torch.bfloat16 and out.shape == (t, fout)
        assert _rel(out, exact) < BF16_ROUNDING
        assert _rel(out, exact) <= 1.5 * _rel(cublas, exact) + 1e-4
