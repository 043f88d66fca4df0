"""The fused element-wise kernels and the fused-group LoRA op against their plain-torch references."""

import pytest
import torch

from engine_ext.lora_ops import add_lora_reference
from engine_ext.model import TorchOps
from engine_ext.rope import cos_sin

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEV = "cuda"


def _gen(seed):
    return torch.Generator(DEV).manual_seed(seed)


def _agree(out, ref, dtype):
    """bf16: at least 99.9% of elements bit-identical and the rest within one rounding step;
    fp32: within 1e-5 relative."""
    assert torch.isfinite(out).all()
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        return
    same = (out == ref).float().mean().item()
    assert same > 0.999, same
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,hidden", [(1, 2048), (32, 2048), (160, 4096), (7, 200)])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm(dtype, tokens, hidden, with_delta):
    from engine_ext.kernels.triton_fused import add_rms_norm

    g = _gen(tokens + hidden)
    x = torch.randn(tokens, hidden, generator=g, device=DEV).to(dtype)
    delta = torch.randn(tokens, hidden, generator=g, device=DEV).to(dtype) if with_delta else None
    w = (1 + 0.1 * torch.randn(hidden, generator=g, device=DEV)).to(dtype)
    ref_x, ref_h, _ = TorchOps.add_rms_norm(x.clone(), delta, w, 1e-5)
    out_x, out_h, part = add_rms_norm(x.clone(), delta, w, 1e-5)
    assert part is None
    assert torch.equal(out_x, ref_x)  # one rounded add: exact
    _agree(out_h, ref_h, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_delta,with_extra", [(True, True), (True, False), (False, False)])
def test_add_rms_norm_on_selected_rows(dtype, with_delta, with_extra):
    """The final norm reads only the rows whose logits are wanted (`rows`): x[rows] etc. without the gathers."""
    from engine_ext.kernels.triton_fused import add_rms_norm

    g = _gen(7)
    x = torch.randn(40, 2048, generator=g, device=DEV).to(dtype)
    delta = torch.randn(40, 2048, generator=g, device=DEV).to(dtype) if with_delta else None
    extra = torch.randn(40, 2048, generator=g, device=DEV) if with_extra else None
    w = (1 + 0.1 * torch.randn(2048, generator=g, device=DEV)).to(dtype)
    rows = torch.tensor([39, 0, 5, 5, 17], device=DEV)
    ref_x, ref_h, _ = add_rms_norm(x[rows], None if delta is None else delta[rows], w, 1e-5, None,
                                   None if extra is None else extra[rows])
    out_x, out_h, _ = add_rms_norm(x, delta, w, 1e-5, None, extra, rows=rows)
    assert torch.equal(out_x, ref_x) and torch.equal(out_h, ref_h)
    torch_x, torch_h, _ = TorchOps.add_rms_norm(x, delta, w, 1e-5, None, extra, rows=rows)
    _agree(out_x, torch_x, dtype)
    _agree(out_h, torch_h, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 64), (14, 2, 64), (8, 8, 128), (4, 2, 16)])
def test_rope_write_kv(dtype, heads, kv_heads, head_dim):
    from engine_ext.kernels.triton_fused import rope_write_kv

    g = _gen(heads * head_dim)
    tokens, blocks, page = 37, 40, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g, device=DEV).to(dtype)
    positions = torch.randint(0, 4000, (tokens,), generator=g, device=DEV)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=DEV).float() / head_dim))
    cos, sin = cos_sin(inv_freq, positions, dtype)
    slots = torch.randperm(blocks * page, generator=g, device=DEV)[:tokens]
    caches = [torch.randn(blocks, page, kv_heads, head_dim, generator=g, device=DEV).to(dtype) for _ in range(2)]
    ref_k, ref_v = caches[0].clone(), caches[1].clone()
    out_k, out_v = caches[0].clone(), caches[1].clone()
    ref_q = TorchOps.rope_write_kv(qkv.clone(), cos, sin, ref_k, ref_v, slots, heads, kv_heads)
    fused = qkv.clone()
    out_q = rope_write_kv(fused, cos, sin, out_k, out_v, slots, heads, kv_heads)
    _agree(out_q, ref_q, dtype)
    _agree(out_k, ref_k, dtype)
    assert torch.equal(out_v, ref_v)
    assert torch.equal(fused[:, heads * head_dim :], qkv[:, heads * head_dim :])  # k/v columns untouched
    # cos/sin as tables over positions (CausalLM.build_rope_table), read by each token's position: the same bits
    table = cos_sin(inv_freq, torch.arange(4000, device=DEV), dtype)
    by_pos = qkv.clone()
    k2, v2 = caches[0].clone(), caches[1].clone()
    q2 = rope_write_kv(by_pos, *table, k2, v2, slots, heads, kv_heads, positions=positions)
    assert torch.equal(q2, out_q) and torch.equal(k2, out_k) and torch.equal(v2, out_v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,inter", [(1, 8192), (32, 8192), (160, 14336), (5, 100)])
def test_silu_mul(dtype, tokens, inter):
    from engine_ext.kernels.triton_fused import silu_mul

    gate_up = (3 * torch.randn(tokens, 2 * inter, generator=_gen(inter), device=DEV)).to(dtype)
    _agree(silu_mul(gate_up)[0], TorchOps.silu_mul(gate_up)[0], dtype)


# ---------------------------------------------------------------- the fused-group LoRA op
def _group(tokens, fan_in, outs, rank, num_slots, dtype, g, runs):
    nseg, total = len(outs), sum(outs)
    a = (torch.randn(num_slots, fan_in, nseg * rank, generator=g, device=DEV) * fan_in**-0.5).to(dtype)
    b = torch.randn(num_slots, rank, total, generator=g, device=DEV).to(dtype)
    for s in range(1, num_slots, 2):  # heterogeneous ranks, zero-padded up to R
        for seg in range(nseg):
            a[s, :, seg * rank + rank // 2 : (seg + 1) * rank] = 0
        b[s, rank // 2 :] = 0
    a[-1].zero_(), b[-1].zero_()
    scale = torch.rand(num_slots, nseg, generator=g, device=DEV) * 2
    scale[-1] = 0
    x = torch.randn(tokens, fan_in, generator=g, device=DEV).to(dtype)
    if runs:  # verify layout: every sequence's k+1 tokens on one slot
        idx = torch.randint(0, num_slots, (tokens // 5 + 1,), generator=g, device=DEV).repeat_interleave(5)[:tokens]
    else:
        idx = torch.randint(0, num_slots, (tokens,), generator=g, device=DEV)
    segments = tuple(int(sum(outs[:i])) for i in range(nseg))
    return x, a, b, scale, idx.contiguous(), segments


def _group_reference(y0, x, a, b, scale, idx, segments, rank):
    ref = y0.float().clone()
    ends = list(segments[1:]) + [y0.shape[1]]
    for seg, (start, end) in enumerate(zip(segments, ends)):
        add_lora_reference(ref[:, start:end], x.float(), a[:, :, seg * rank : (seg + 1) * rank].float(),
                           b[:, :, start:end].float(), scale[:, seg].contiguous(), idx)
    return ref


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,fan_in,outs,rank,runs", [
    (32, 2048, (2048, 512, 512), 16, False),  # 1B q/k/v at decode
    (160, 2048, (2048, 512, 512), 64, True),  # 1B q/k/v at a k=4 verify pass
    (32, 2048, (8192, 8192), 64, False),  # 1B gate/up
    (17, 8192, (2048,), 16, True),  # 1B down, one module
    (9, 96, (48, 24, 24), 8, False),  # segment starts that fit no 16-column tile: per-module fallback
])
def test_group_op_matches_the_per_module_reference(dtype, tokens, fan_in, outs, rank, runs):
    from engine_ext.kernels import triton_lora

    g = _gen(tokens * rank + fan_in)
    x, a, b, scale, idx, segments = _group(tokens, fan_in, outs, rank, 9, dtype, g, runs)
    y0 = torch.randn(tokens, sum(outs), generator=g, device=DEV).to(dtype)
    ref = _group_reference(y0, x, a, b, scale, idx, segments, rank)
    out = y0.clone()
    triton_lora.add_lora_group_triton(out, x, a, b, scale, idx, segments)
    diff, denom = (out.double() - ref.double()), (ref.double() - y0.double())
    assert (diff.norm() / denom.norm()).item() < 1e-2
    base = idx == 8
    assert torch.equal(out[base], y0[base])  # the zero slot's tokens are not touched


def test_the_triton_backend_binds_its_settings(tmp_path):
    """lora_backend / attn_backend / layer_ops "triton" launch the kernels with EngineConfig.kernels."""
    from engine_ext import EngineConfig, KernelSettings
    from engine_ext.backend import Backend
    from engine_ext.kernels.triton_attention import paged_attention_triton
    from engine_ext.kernels.triton_fused import TritonOps
    from engine_ext.kernels.triton_lora import add_lora_group_triton, add_lora_triton

    settings = KernelSettings(attn_block_n=64, shrink_warps=4)
    config = EngineConfig(model=str(tmp_path), device=DEV, lora_backend="triton", attn_backend="triton",
                          layer_ops="triton", kernels=settings)
    backend = Backend.from_config(config, torch.device(DEV))
    assert backend.lora_op.func is add_lora_triton and backend.lora_op.keywords == {"settings": settings}
    assert backend.group_lora_op.func is add_lora_group_triton
    assert backend.group_lora_op.keywords["settings"] is settings
    assert backend.attention.func is paged_attention_triton and backend.attention.keywords["settings"] is settings
    assert isinstance(backend.layer_ops, TritonOps) and backend.layer_ops.settings is settings
    assert backend.layer_ops.side_branch.stream is not None
    plain = Backend.from_config(EngineConfig(model=str(tmp_path), device=DEV), torch.device(DEV))
    assert plain.group_lora_op is None and plain.attention is None and not isinstance(plain.layer_ops, TritonOps)


# ---------------------------------------------------------------- LoRA folded into the element-wise kernels
def test_o_delta_on_the_side_stream_equals_the_in_place_op():
    """lora_delta (shrink + store-mode expand, float32) on a SideBranch, joined, then added to the base
    output: add_lora_triton's result, in and out of a CUDA graph."""
    from engine_ext.kernels.triton_fused import SideBranch
    from engine_ext.kernels.triton_lora import add_lora_triton, lora_delta

    g = _gen(7)
    tokens, hidden, rank, num_slots, dtype = 32, 2048, 16, 9, torch.bfloat16
    slots = torch.randint(0, num_slots, (tokens,), generator=g, device=DEV)
    a = _slot_stack(num_slots, hidden, rank, g, dtype, hidden**-0.5)
    b = _slot_stack(num_slots, rank, hidden, g, dtype, 0.5)
    scale = torch.rand(num_slots, generator=g, device=DEV)
    x = torch.randn(tokens, hidden, generator=g, device=DEV).to(dtype)
    y0 = torch.randn(tokens, hidden, generator=g, device=DEV).to(dtype)
    ref = y0.clone()
    add_lora_triton(ref, x, a, b, scale, slots)
    branch = SideBranch(x.device)

    def forward():
        with branch:
            delta = lora_delta(x, a, b, scale, slots)
        base = y0 * 1  # the main stream's work meanwhile
        branch.join()
        return (base.float() + delta).to(dtype)

    eager = forward()
    _agree(eager, ref, dtype)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)  # the captured branch computes what the eager one did



def _slot_stack(num_slots, rows, cols, g, dtype, scale=1.0):
    t = (torch.randn(num_slots, rows, cols, generator=g, device=DEV) * scale).to(dtype)
    t[-1] = 0  # the zero slot
    return t


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,rank,runs", [(1, 16, False), (32, 16, False), (32, 64, False), (160, 64, True),
                                              (40, 16, True)])
def test_lora_folded_into_norm_rope_and_silu(dtype, tokens, rank, runs):
    """One layer's q/k/v and gate/up/down LoRA through the fused kernels against the reference composition:
    norm, base output + per-module LoRA (lora_ops reference), then rotary/KV write and SiLU (TorchOps)."""
    from engine_ext.kernels import KernelSettings

    _check_lora_folding(dtype, tokens, rank, runs, KernelSettings())


def _check_lora_folding(dtype, tokens, rank, runs, settings, head_dim=64):
    from functools import partial

    from engine_ext.kernels import triton_lora
    from engine_ext.kernels.triton_fused import TritonOps

    ops = TritonOps(settings, torch.device(DEV))
    add_rms_norm, rope_write_kv, silu_mul = ops.add_rms_norm, ops.rope_write_kv, ops.silu_mul
    expand_delta = ops.expand_delta
    lora_expand = partial(triton_lora.lora_expand, settings=settings)

    g = _gen(tokens * 131 + rank)
    hidden, inter, num_slots = 2048, 8192, 9
    heads, kv_heads = (32, 8) if head_dim >= 64 else (8, 2)
    qs, kvs = heads * head_dim, kv_heads * head_dim
    if runs:
        slots = torch.randint(0, num_slots, (tokens // 5,), generator=g, device=DEV).repeat_interleave(5)
    else:
        slots = torch.randint(0, num_slots, (tokens,), generator=g, device=DEV)
    a_qkv = _slot_stack(num_slots, hidden, 3 * rank, g, dtype, hidden**-0.5)
    b_qkv = _slot_stack(num_slots, rank, qs + 2 * kvs, g, dtype, 0.5)
    a_gu = _slot_stack(num_slots, hidden, 2 * rank, g, dtype, hidden**-0.5)
    b_gu = _slot_stack(num_slots, rank, 2 * inter, g, dtype, 0.5)
    a_down = _slot_stack(num_slots, inter, rank, g, dtype, inter**-0.5)
    b_down = _slot_stack(num_slots, rank, hidden, g, dtype, 0.5)
    sc = {n: torch.rand(num_slots, k, generator=g, device=DEV) * 2 for n, k in (("qkv", 3), ("gu", 2), ("down", 1))}

    def ref_group(y, x, a, b, scale, segments):
        return _group_reference(y, x, a, b, scale, slots, segments, rank).to(dtype)

    x = torch.randn(tokens, hidden, generator=g, device=DEV).to(dtype)
    delta = torch.randn(tokens, hidden, generator=g, device=DEV).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g, device=DEV)).to(dtype)
    _, h, _ = TorchOps.add_rms_norm(x.clone(), delta, w, 1e-5)
    _, h2, part = add_rms_norm(x.clone(), delta, w, 1e-5, (a_qkv, slots))
    _agree(h2, h, dtype)
    # q/k/v: a base output plus the deltas, then rotary + cache write
    qkv = torch.randn(tokens, qs + 2 * kvs, generator=g, device=DEV).to(dtype)
    positions = torch.randint(0, 2000, (tokens,), generator=g, device=DEV)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=DEV).float() / head_dim))
    cos, sin = cos_sin(inv_freq, positions, dtype)
    kv_slots = torch.randperm(64 * 16, generator=g, device=DEV)[:tokens]
    caches = [torch.zeros(64, 16, kv_heads, head_dim, device=DEV, dtype=dtype) for _ in range(4)]
    ref_q = TorchOps.rope_write_kv(ref_group(qkv, h, a_qkv, b_qkv, sc["qkv"], (0, qs, qs + kvs)), cos, sin,
                                   caches[0], caches[1], kv_slots, heads, kv_heads)
    out_q = rope_write_kv(qkv.clone(), cos, sin, caches[2], caches[3], kv_slots, heads, kv_heads,
                          (part, b_qkv, sc["qkv"], slots))
    for out, ref in ((out_q, ref_q), (caches[2], caches[0]), (caches[3], caches[1])):
        assert ((out.double() - ref.double()).norm() / ref.double().norm()).item() < 1e-2
    # gate/up deltas, SiLU, the down shrink; the down expand
    _, _, part_gu = add_rms_norm(x.clone(), delta, w, 1e-5, (a_gu, slots))
    gate_up = torch.randn(tokens, 2 * inter, generator=g, device=DEV).to(dtype)
    ref_act = TorchOps.silu_mul(ref_group(gate_up, h, a_gu, b_gu, sc["gu"], (0, inter)))[0]
    act, part_down = silu_mul(gate_up.clone(), (part_gu, b_gu, sc["gu"], a_down, slots))
    assert ((act.double() - ref_act.double()).norm() / ref_act.double().norm()).item() < 1e-2
    y0 = torch.randn(tokens, hidden, generator=g, device=DEV).to(dtype)
    ref_y = ref_group(y0, act, a_down, b_down, sc["down"], (0,))
    y = y0.clone()
    lora_expand(y, part_down, b_down, sc["down"], slots, num_slots - 1)
    assert ((y.double() - ref_y.double()).norm() / (ref_y.double() - y0.double()).norm()).item() < 1e-2
    base = slots == num_slots - 1
    assert torch.equal(y[base], y0[base])
    # the same down delta into a float32 buffer of its own (the model's side stream), added by the next norm
    # kernel as `extra`: what the in-place expand left in y (up to where the compiler folds y's add into the
    # product's accumulator), and the norm of y0 + extra is exactly the norm of the sum rounded
    extra = expand_delta(part_down, b_down, sc["down"], slots)
    assert extra.dtype == torch.float32 and torch.all(extra[base] == 0)
    y_side = (y0.float() + extra).to(dtype)
    assert ((y_side.double() - ref_y.double()).norm() / (ref_y.double() - y0.double()).norm()).item() < 1e-2
    res, h3, _ = add_rms_norm(x.clone(), y0, w, 1e-5, (a_qkv, slots), extra=extra)
    ref_res, ref_h3, _ = add_rms_norm(x.clone(), y_side, w, 1e-5, (a_qkv, slots))
    assert torch.equal(res, ref_res) and torch.equal(h3, ref_h3)


@pytest.mark.parametrize("setting", [
    {"norm_chunk": 64, "norm_lora_warps": 1, "silu_lora_block": 128, "silu_lora_warps": 2, "rope_lora_warps": 2},
    {"norm_chunk": 256, "norm_lora_bk": 64, "silu_lora_block": 1024, "silu_lora_sb": 128, "rope_lora_warps": 4},
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lora_folding_under_other_launch_settings(setting, dtype):
    """The launch settings change tiling and the number of partials (up to 64 down-shrink partials summed by
    the expand), never results."""
    from engine_ext.kernels import KernelSettings

    _check_lora_folding(dtype, 32, 16, False, KernelSettings(**setting, expand_block_n=128, expand_warps=2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,rank,run_tokens", [(160, 16, 4), (160, 64, 4), (40, 16, 1), (37, 16, 4)])
def test_lora_deltas_beside_the_products_added_by_rope_and_silu(dtype, tokens, rank, run_tokens):
    """DecoderLayer.beside_lora's kernels: the q/k/v and gate/up deltas (group_delta, float32, on a side branch,
    in and out of a CUDA graph) added by the rotary and SiLU kernels give the reference composition; K splits
    sized for runs of any length (a verify pass's 5 tokens, runs of 1) change nothing but the split count."""
    from engine_ext.kernels import KernelSettings
    from engine_ext.kernels.triton_fused import TritonOps

    ops = TritonOps(KernelSettings(multi_run_tokens=run_tokens), torch.device(DEV))
    g = _gen(tokens * 7 + rank)
    hidden, inter, num_slots, heads, kv_heads, head_dim = 2048, 8192, 9, 32, 8, 64
    qs, kvs = heads * head_dim, kv_heads * head_dim
    slots = torch.randint(0, num_slots, (-(-tokens // 5),), generator=g, device=DEV).repeat_interleave(5)[:tokens]
    a_qkv = _slot_stack(num_slots, hidden, 3 * rank, g, dtype, hidden**-0.5)
    b_qkv = _slot_stack(num_slots, rank, qs + 2 * kvs, g, dtype, 0.5)
    a_gu = _slot_stack(num_slots, hidden, 2 * rank, g, dtype, hidden**-0.5)
    b_gu = _slot_stack(num_slots, rank, 2 * inter, g, dtype, 0.5)
    sc_qkv, sc_gu = (torch.rand(num_slots, k, generator=g, device=DEV) * 2 for k in (3, 2))
    h = torch.randn(tokens, hidden, generator=g, device=DEV).to(dtype)

    def ref_group(y, a, b, scale, segments):
        return _group_reference(y, h, a, b, scale, slots, segments, rank).to(dtype)

    def rel(out, ref):
        return ((out.double() - ref.double()).norm() / ref.double().norm()).item()

    qkv = torch.randn(tokens, qs + 2 * kvs, generator=g, device=DEV).to(dtype)
    gate_up = torch.randn(tokens, 2 * inter, generator=g, device=DEV).to(dtype)
    positions = torch.randint(0, 2000, (tokens,), generator=g, device=DEV)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=DEV).float() / head_dim))
    cos, sin = cos_sin(inv_freq, positions, dtype)
    kv_slots = torch.randperm(64 * 16, generator=g, device=DEV)[:tokens]
    caches = [torch.zeros(64, 16, kv_heads, head_dim, device=DEV, dtype=dtype) for _ in range(4)]
    ref_q = TorchOps.rope_write_kv(ref_group(qkv, a_qkv, b_qkv, sc_qkv, (0, qs, qs + kvs)), cos, sin, caches[0],
                                   caches[1], kv_slots, heads, kv_heads)
    ref_act = TorchOps.silu_mul(ref_group(gate_up, a_gu, b_gu, sc_gu, (0, inter)))[0]

    def forward():
        with ops.side_branch:
            d_qkv = ops.group_delta(h, a_qkv, b_qkv, sc_qkv, slots, (0, qs, qs + kvs), multi=True)
            d_gu = ops.group_delta(h, a_gu, b_gu, sc_gu, slots, (0, inter), multi=True)
        base = qkv * 1  # the main stream's product meanwhile
        ops.side_branch.join()
        q = ops.rope_write_kv(base, cos, sin, caches[2], caches[3], kv_slots, heads, kv_heads, extra=d_qkv)
        return q, ops.silu_mul(gate_up, extra=d_gu)[0], d_qkv

    q, act, d_qkv = forward()
    base_rows = slots == num_slots - 1
    assert d_qkv.dtype == torch.float32 and torch.all(d_qkv[base_rows] == 0)
    for out, ref in ((q, ref_q), (caches[2], caches[0]), (caches[3], caches[1]), (act, ref_act)):
        assert rel(out, ref) < 1e-2
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = forward()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(outs[0], q) and torch.equal(outs[1], act)  # the captured branch computes what eager did
