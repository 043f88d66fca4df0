"""The skinny decode GEMM (kernels/triton_gemm.py) against F.linear, in and out of CUDA graphs."""

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEV = "cuda"


def _close(out, ref, dtype):
    rel = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert rel < (1e-5 if dtype == torch.float32 else 1e-2), rel


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,n,k,bias", [(1, 3072, 2048, False), (32, 2048, 2048, False), (32, 2048, 8192, False),
                                        (8, 16384, 2048, False), (5, 1000, 300, True), (32, 200, 4096, True),
                                        (20, 48, 64, False)])
def test_matches_f_linear(dtype, m, n, k, bias):
    from engine_ext.kernels import triton_gemm as tg

    g = torch.Generator(DEV).manual_seed(m * 7 + n)
    x = torch.randn(m, k, device=DEV, generator=g).to(dtype)
    w = (torch.randn(n, k, device=DEV, generator=g) * k**-0.5).to(dtype)
    b = torch.randn(n, device=DEV, generator=g).to(dtype) if bias else None
    y = tg.skinny_matmul(x, w, b)
    _close(y, F.linear(x.double(), w.double(), None if b is None else b.double()), dtype)
    assert torch.equal(tg.skinny_matmul(x, w, b), y)  # deterministic: the split partials are summed in order
    counters = tg._counters.get(x.device)
    assert counters is None or not counters.any()  # every tile's counter was reset


@pytest.mark.parametrize("settings", [dict(BLOCK_N=32, BLOCK_K=256, NUM_STAGES=3, TARGET_BLOCKS=528),
                                      dict(BLOCK_N=128, BLOCK_K=64, NUM_STAGES=2, TARGET_BLOCKS=0)])
def test_launch_settings_change_speed_not_results(settings, monkeypatch):
    from engine_ext.kernels import triton_gemm as tg

    for name, value in settings.items():
        monkeypatch.setattr(tg, name, value)
    g = torch.Generator(DEV).manual_seed(3)
    x = torch.randn(32, 2048, device=DEV, generator=g)
    w = torch.randn(3072, 2048, device=DEV, generator=g) * 0.02
    _close(tg.skinny_matmul(x, w), F.linear(x.double(), w.double()), torch.float32)


def test_graph_replays_with_new_inputs():
    """Captured once with split K: the tickets reset, so every replay reduces correctly."""
    from engine_ext.kernels import triton_gemm as tg

    g = torch.Generator(DEV).manual_seed(5)
    x = torch.randn(32, 8192, device=DEV, generator=g).bfloat16()
    w = (torch.randn(2048, 8192, device=DEV, generator=g) * 0.01).bfloat16()
    assert tg.plan(32, 2048, 8192)[3] > 1
    tg.skinny_matmul(x, w)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = tg.skinny_matmul(x, w)
    for seed in range(3):
        x.copy_(torch.randn(32, 8192, device=DEV, generator=torch.Generator(DEV).manual_seed(seed)).bfloat16())
        graph.replay()
        _close(y, F.linear(x.double(), w.double()), torch.bfloat16)


def test_refuses_mismatched_operands():
    from engine_ext.kernels import triton_gemm as tg

    with pytest.raises(ValueError, match="do not fit"):
        tg.skinny_matmul(torch.zeros(4, 64, device=DEV), torch.zeros(32, 65, device=DEV))
    with pytest.raises(ValueError, match="unit stride"):
        tg.skinny_matmul(torch.zeros(64, 4, device=DEV).t(), torch.zeros(32, 64, device=DEV))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,n,k,rank,parts", [(32, 2048, 2048, 16, 32), (32, 2048, 8192, 16, 16), (7, 2048, 2048, 64, 4),
                                              (1, 512, 256, 8, 1)])
def test_lora_expand_in_the_epilogue(dtype, m, n, k, rank, parts):
    """y = x @ W^T, then the one-module LoRA expand from shrink partials, as F.linear + lora_expand give it
    (with split K too: the reducing split adds it)."""
    from engine_ext.kernels import triton_gemm as tg
    from engine_ext.kernels.triton_lora import lora_expand

    g = torch.Generator(DEV).manual_seed(m + n + rank)
    slots_n = 9
    x = torch.randn(m, k, device=DEV, generator=g).to(dtype)
    w = (torch.randn(n, k, device=DEV, generator=g) * k**-0.5).to(dtype)
    part = torch.randn(parts, m, rank, device=DEV, generator=g) * parts**-0.5
    b = (torch.randn(slots_n, rank, n, device=DEV, generator=g) * 0.1).to(dtype)
    b[-1] = 0
    scale = torch.rand(slots_n, 1, device=DEV, generator=g) * 2
    slots = torch.randint(0, slots_n, (m,), device=DEV, generator=g)
    slots[0] = 0  # at least one token on an adapter
    ref = F.linear(x, w)
    lora_expand(ref, part, b, scale, slots, slots_n - 1)
    y = tg.skinny_matmul(x, w, None, (part, b, scale, slots))
    _close(y, ref, dtype)
    base = slots == slots_n - 1
    _close(y[~base], ref[~base], dtype)
    assert torch.equal(tg.skinny_matmul(x, w, None, (part, b, scale, slots)), y)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,segments,n,k", [(32, (0, 2048, 2560), 3072, 2048), (32, (0, 8192), 16384, 2048),
                                            (5, (0, 64, 96), 128, 4096)])
def test_a_fused_groups_expand_in_the_epilogue(dtype, m, segments, n, k):
    """q/k/v and gate/up: each column tile adds its own module's expand (partials and scale of that module)."""
    from engine_ext.kernels import triton_gemm as tg
    from engine_ext.kernels.triton_lora import lora_expand

    g = torch.Generator(DEV).manual_seed(n + m)
    rank, slots_n, nseg = 16, 9, len(segments)
    x = torch.randn(m, k, device=DEV, generator=g).to(dtype)
    w = (torch.randn(n, k, device=DEV, generator=g) * k**-0.5).to(dtype)
    part = torch.randn(8, m, nseg * rank, device=DEV, generator=g) * 0.3
    b = (torch.randn(slots_n, rank, n, device=DEV, generator=g) * 0.1).to(dtype)
    b[-1] = 0
    scale = torch.rand(slots_n, nseg, device=DEV, generator=g) * 2
    slots = torch.randint(0, slots_n, (m,), device=DEV, generator=g)
    slots[0] = 0
    ref = F.linear(x, w)
    lora_expand(ref, part, b, scale, slots, slots_n - 1, segments)
    _close(tg.skinny_matmul(x, w, None, (part, b, scale, slots, segments)), ref, dtype)
