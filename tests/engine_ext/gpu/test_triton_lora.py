"""The Triton batched LoRA op against the plain-torch reference, on the GPU."""

import pytest
import torch

from engine_ext.lora_ops import add_lora_reference

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

# (tokens, in, out, slot rank R, slots incl. the zero slot): decode, verify and prefill token counts,
# the 1B shapes of q (2048->2048), k/v (2048->512), down (8192->2048), and odd sizes.
CASES = [
    (1, 2048, 2048, 16, 9),
    (32, 2048, 512, 16, 33),
    (160, 2048, 2048, 64, 33),
    (37, 8192, 2048, 64, 5),
    (513, 2048, 8192, 16, 129),
    (19, 200, 72, 8, 4),
]


def _operands(t, fin, fout, rank, slots, dtype, gen, zero_fraction=0.25, runs=False):
    dev = "cuda"
    a = torch.randn(slots, fin, rank, generator=gen, device=dev).mul_(fin**-0.5).to(dtype)
    b = torch.randn(slots, rank, fout, generator=gen, device=dev).to(dtype)
    # Heterogeneous ranks: every other slot holds a smaller adapter, zero-padded up to R.
    for s in range(1, slots, 2):
        a[s, :, max(1, rank // 2):] = 0
        b[s, max(1, rank // 2):] = 0
    a[-1].zero_(), b[-1].zero_()  # the zero slot
    scale = torch.rand(slots, generator=gen, device=dev) * 2
    x = torch.randn(t, fin, generator=gen, device=dev).to(dtype)
    idx = torch.randint(0, slots - 1, (t,), generator=gen, device=dev)
    idx[torch.rand(t, generator=gen, device=dev) < zero_fraction] = slots - 1
    if runs:  # verify-pass layout: runs of 1..40 tokens on one slot (some cross the 16-token blocks)
        lengths = torch.randint(1, 41, (t,), generator=gen, device=dev)
        idx = torch.repeat_interleave(idx, lengths)[:t].contiguous()
    return x, a, b, scale, idx


def _rel(out, ref):
    """Relative error; absolute where the reference is exactly zero (a batch of base-only tokens)."""
    diff, denom = (out.double() - ref.double()).norm(), ref.double().norm()
    return (diff / denom).item() if denom > 0 else diff.item()


@pytest.mark.parametrize("t,fin,fout,rank,slots", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("runs", [False, True], ids=["mixed", "runs"])
def test_matches_reference(t, fin, fout, rank, slots, dtype, runs):
    from engine_ext.kernels.triton_lora import add_lora_triton

    gen = torch.Generator("cuda").manual_seed(t * 7 + fin)
    x, a, b, scale, idx = _operands(t, fin, fout, rank, slots, dtype, gen, runs=runs)
    y0 = torch.randn(t, fout, generator=gen, device="cuda").to(dtype)
    ref = y0.float().clone()
    add_lora_reference(ref, x.float(), a.float(), b.float(), scale, idx)
    out = y0.clone()
    add_lora_triton(out, x, a, b, scale, idx)
    assert torch.isfinite(out).all()
    assert _rel(out - y0, ref - y0) < 1e-2  # the delta itself, in bf16/fp16 tolerance
    skipped = idx == slots - 1
    assert torch.equal(out[skipped], y0[skipped])  # base-only tokens are not touched at all


def test_writes_only_its_column_slice_of_a_fused_output():
    from engine_ext.kernels.triton_lora import add_lora_triton

    gen = torch.Generator("cuda").manual_seed(3)
    x, a, b, scale, idx = _operands(24, 256, 96, 16, 6, torch.bfloat16, gen, zero_fraction=0.0)
    fused = torch.randn(24, 96 * 3, generator=gen, device="cuda").to(torch.bfloat16)
    before = fused.clone()
    add_lora_triton(fused[:, 96:192], x, a, b, scale, idx)
    ref = before[:, 96:192].float()
    add_lora_reference(ref, x.float(), a.float(), b.float(), scale, idx)
    assert torch.equal(fused[:, :96], before[:, :96]) and torch.equal(fused[:, 192:], before[:, 192:])
    assert _rel(fused[:, 96:192] - before[:, 96:192], ref - before[:, 96:192].float()) < 1e-2


def test_graph_replay_follows_a_new_slot_mix_without_recapture():
    from engine_ext.kernels.triton_lora import add_lora_triton

    gen = torch.Generator("cuda").manual_seed(5)
    x, a, b, scale, idx = _operands(32, 512, 256, 16, 9, torch.bfloat16, gen)
    y = torch.zeros(32, 256, device="cuda", dtype=torch.bfloat16)
    add_lora_triton(y, x, a, b, scale, idx)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y.zero_()
        add_lora_triton(y, x, a, b, scale, idx)
    for seed in range(3):
        idx.copy_(torch.randint(0, 9, (32,), generator=gen, device="cuda"))
        a[seed].normal_(generator=gen)  # an adapter swapped into a slot in place
        graph.replay()
        ref = torch.zeros(32, 256, device="cuda")
        add_lora_reference(ref, x.float(), a.float(), b.float(), scale, idx)
        assert _rel(y, ref) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_slots_rank_bounds_what_the_op_reads(dtype):
    """With each slot's rank (AdapterSlots.group_rank) and KernelSettings.rank_masks, the op reads only a slot's
    first `rank` columns of A (each module's, in a fused group) and rows of B: padding filled with garbage gives
    the result of the weights cut to the rank, in the one-module op, the fused-group op and the float32 delta."""
    from engine_ext.kernels import KernelSettings, triton_lora

    st = KernelSettings(rank_masks=1)
    gen = torch.Generator("cuda").manual_seed(11)
    t, fin, outs, rank, num_slots = 48, 2048, (2048, 512, 512), 64, 9
    nseg = len(outs)
    a = (torch.randn(num_slots, fin, nseg * rank, generator=gen, device="cuda") * fin**-0.5).to(dtype)
    b = torch.randn(num_slots, rank, sum(outs), generator=gen, device="cuda").to(dtype)
    ranks = torch.tensor([16, 64, 8, 32, 16, 1, 64, 4, 0], dtype=torch.int32, device="cuda")
    a_cut, b_cut = a.clone(), b.clone()
    for s, r in enumerate(ranks.tolist()):
        for seg in range(nseg):
            a_cut[s, :, seg * rank + r : (seg + 1) * rank] = 0
        b_cut[s, r:] = 0
    scale = torch.rand(num_slots, nseg, generator=gen, device="cuda")
    slots = torch.randint(0, num_slots, (t,), generator=gen, device="cuda")
    x = torch.randn(t, fin, generator=gen, device="cuda").to(dtype)
    y0 = torch.randn(t, sum(outs), generator=gen, device="cuda").to(dtype)
    segments = (0, outs[0], outs[0] + outs[1])
    ref, out = y0.clone(), y0.clone()
    triton_lora.add_lora_group_triton(ref, x, a_cut, b_cut, scale, slots, segments)
    triton_lora.add_lora_group_triton(out, x, a, b, scale, slots, segments, ranks, settings=st)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    one_a, one_b = a[:, :, :rank].contiguous(), b[:, :, : outs[0]].contiguous()
    ref, out = y0[:, : outs[0]].clone(), y0[:, : outs[0]].clone()
    triton_lora.add_lora_triton(ref, x, a_cut[:, :, :rank].contiguous(), b_cut[:, :, : outs[0]].contiguous(),
                                scale[:, 0].contiguous(), slots)
    triton_lora.add_lora_triton(out, x, one_a, one_b, scale[:, 0].contiguous(), slots, ranks, settings=st)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    delta = triton_lora.lora_delta(x, one_a, one_b, scale[:, 0].contiguous(), slots, ranks, settings=st)
    ref_delta = triton_lora.lora_delta(x, a_cut[:, :, :rank].contiguous(), b_cut[:, :, : outs[0]].contiguous(),
                                       scale[:, 0].contiguous(), slots)
    torch.testing.assert_close(delta, ref_delta, rtol=0, atol=0)
