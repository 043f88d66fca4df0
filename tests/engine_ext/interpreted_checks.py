"""The Triton kernels' logic on the CPU, through Triton's interpreter (float32; the interpreter's bf16 is not
torch's), against the plain-torch references. Run by test_kernels_interpreted.py in a subprocess with
TRITON_INTERPRET=1 (it must be set before the kernels are defined):

    TRITON_INTERPRET=1 python tests/engine_ext/interpreted_checks.py GROUP

GROUP: attention, fused, ranks, lora, engine, fp8, growth, metadata or commit (the function of that name below).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), HERE]

from engine_ext.attention import AttnMetadata, paged_attention  # noqa: E402
from engine_ext.lora_ops import add_lora_reference  # noqa: E402


def _close(out, ref, tol=1e-4):
    err = ((out.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-12)).item()
    assert err < tol, err


def _attn_case(lens, qlens, heads, kvh, d, page, g):
    nblk = sum(-(-n // page) for n in lens) + 2
    perm = torch.randperm(nblk, generator=g).tolist()
    width = max(-(-n // page) for n in lens)
    tables, used = [], 0
    for n in lens:
        nb = -(-n // page)
        tables.append(perm[used : used + nb] + [0] * (width - nb))
        used += nb
    pos, seq, qidx = [], [], []
    for i, (n, m) in enumerate(zip(lens, qlens)):
        pos += list(range(n - m, n))
        seq += [i] * m
        qidx += list(range(m))
    t = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    meta = AttnMetadata(positions=t(pos), slot_mapping=t([0] * len(pos)), block_tables=t(tables), token_seq=t(seq),
                        token_qidx=t(qidx), max_query_len=max(qlens))
    kc, vc = (torch.randn(nblk, page, kvh, d, generator=g) for _ in range(2))
    return torch.randn(len(pos), heads, d, generator=g), kc, vc, meta


def attention():
    from engine_ext.kernels import KernelSettings
    from engine_ext.kernels.triton_attention import paged_attention_triton

    g = torch.Generator().manual_seed(0)
    heads, kvh, d = 8, 2, 16
    settings = [KernelSettings(attn_max_splits=1, attn_rows=16, attn_block_n=32),
                KernelSettings(attn_max_splits=1, attn_rows=0, attn_block_n=16, attn_rows_multi=0),
                KernelSettings(attn_max_splits=4, attn_split_budget=1 << 16, attn_rows=16, attn_block_n=16),
                KernelSettings(attn_max_splits=4, attn_split_budget=1 << 16, attn_rows=16, attn_rows_multi=64,
                               attn_block_n=16)]
    # one-token and several-token sequences side by side (narrow and wide tiles), runs past one wide tile
    for lens, qlens in (([37, 5, 2], [1, 1, 1]), ([37, 20, 6], [1, 3, 5]), ([40, 19, 9, 30], [17, 1, 9, 5])):
        q, kc, vc, meta = _attn_case(lens, qlens, heads, kvh, d, 4, g)
        for window in (None, 5):
            ref = paged_attention(q, kc, vc, meta, 0.25, window)
            for s in settings:
                _close(paged_attention_triton(q, kc, vc, meta, 0.25, window, settings=s), ref)


def fused():
    from engine_ext.kernels import triton_fused as tf
    from engine_ext.kernels import triton_lora as tlr
    from engine_ext.kernels.triton_lora import lora_expand
    from engine_ext.model import TorchOps
    from engine_ext.rope import cos_sin

    g = torch.Generator().manual_seed(2)
    T, H, KVH, D, hid, inter, S, R = 6, 4, 2, 16, 600, 2100, 4, 8
    qs, kvs = H * D, KVH * D
    slots = torch.tensor([0, 0, 3, 1, 2, 1])  # 3: the zero slot

    def stack(*shape):
        t = torch.randn(*shape, generator=g)
        t[-1] = 0
        return t

    def ref_group(y, x, a, b, sc, segs):
        y = y.clone()
        ends = list(segs[1:]) + [y.shape[1]]
        for s, (lo, hi) in enumerate(zip(segs, ends)):
            add_lora_reference(y[:, lo:hi], x, a[:, :, s * R : (s + 1) * R], b[:, :, lo:hi], sc[:, s].contiguous(),
                               slots)
        return y

    x, d, w = torch.randn(T, hid, generator=g), torch.randn(T, hid, generator=g), torch.randn(hid, generator=g)
    aq, bq, sq = stack(S, hid, 3 * R), stack(S, R, qs + 2 * kvs), stack(S, 3).abs()
    ag, bg, sg = stack(S, hid, 2 * R), stack(S, R, 2 * inter), stack(S, 2).abs()
    ad, bd, sd = stack(S, inter, R), stack(S, R, hid), stack(S, 1).abs()
    _, h, _ = TorchOps.add_rms_norm(x.clone(), d, w, 1e-5)
    _, h2, part = tf.add_rms_norm(x.clone(), d, w, 1e-5, lora=(aq, slots))
    _close(h2, h)
    e = torch.randn(T, hid, generator=g)  # `extra`: a float32 delta beside d
    x_ref, h_ref, _ = TorchOps.add_rms_norm(x.clone(), d + e, w, 1e-5)
    x3, h3, _ = tf.add_rms_norm(x.clone(), d, w, 1e-5, lora=(aq, slots), extra=e)
    _close(x3, x_ref)
    _close(h3, h_ref)
    rows = torch.tensor([5, 0, 2, 2])  # the final norm on the rows whose logits are wanted
    x4, h4, _ = tf.add_rms_norm(x.clone(), d, w, 1e-5, extra=e, rows=rows)
    _close(x4, x_ref[rows])
    _close(h4, h_ref[rows])
    x5, h5, _ = tf.add_rms_norm(x.clone(), None, w, 1e-5, rows=rows)
    _close(x5, x[rows])
    _close(h5, TorchOps.add_rms_norm(x[rows], None, w, 1e-5)[1])
    qkv = torch.randn(T, qs + 2 * kvs, generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    cos, sin = cos_sin(inv, torch.tensor([3, 4, 0, 9, 2, 5]), torch.float32)
    caches = [torch.zeros(8, 4, KVH, D) for _ in range(4)]
    kv_slots = torch.tensor([1, 2, 7, 12, 20, 30])
    q1 = TorchOps.rope_write_kv(ref_group(qkv, h, aq, bq, sq, (0, qs, qs + kvs)), cos, sin, caches[0], caches[1],
                                kv_slots, H, KVH)
    q2 = tf.rope_write_kv(qkv.clone(), cos, sin, caches[2], caches[3], kv_slots, H, KVH, lora=(part, bq, sq, slots))
    _close(q2, q1)
    _close(caches[2], caches[0])
    _close(caches[3], caches[1])
    # the q/k/v deltas as a float32 buffer computed beside the product (DecoderLayer.beside_lora)
    d_qkv = tlr.group_delta(h, aq, bq, sq, slots, (0, qs, qs + kvs), run_tokens=2)
    _close(d_qkv + qkv, ref_group(qkv, h, aq, bq, sq, (0, qs, qs + kvs)))
    caches_e = [torch.zeros(8, 4, KVH, D) for _ in range(2)]
    q_e = tf.rope_write_kv(qkv.clone(), cos, sin, *caches_e, kv_slots, H, KVH, extra=d_qkv)
    _close(q_e, q1)
    _close(caches_e[0], caches[0])
    _close(caches_e[1], caches[1])
    q_t = TorchOps.rope_write_kv(qkv.clone(), cos, sin, *[torch.zeros(8, 4, KVH, D) for _ in range(2)], kv_slots, H,
                                 KVH, extra=d_qkv)
    _close(q_t, q1)
    table = cos_sin(inv, torch.arange(12), torch.float32)  # cos/sin over positions, read by each token's position
    caches += [torch.zeros(8, 4, KVH, D) for _ in range(2)]
    q3 = tf.rope_write_kv(qkv.clone(), *table, caches[4], caches[5], kv_slots, H, KVH, lora=(part, bq, sq, slots),
                          positions=torch.tensor([3, 4, 0, 9, 2, 5]))
    assert torch.equal(q3, q2) and torch.equal(caches[4], caches[2]) and torch.equal(caches[5], caches[3])
    _, _, part_g = tf.add_rms_norm(x.clone(), d, w, 1e-5, lora=(ag, slots))
    gu = torch.randn(T, 2 * inter, generator=g)
    act_ref = TorchOps.silu_mul(ref_group(gu, h, ag, bg, sg, (0, inter)))[0]
    act, part_d = tf.silu_mul(gu.clone(), lora=(part_g, bg, sg, ad, slots))
    _close(act, act_ref)
    d_gu = tlr.group_delta(h, ag, bg, sg, slots, (0, inter))
    _close(tf.silu_mul(gu.clone(), extra=d_gu)[0], act_ref)
    _close(TorchOps.silu_mul(gu.clone(), extra=d_gu)[0], act_ref)
    y0 = torch.randn(T, hid, generator=g)
    y = y0.clone()
    lora_expand(y, part_d, bd, sd, slots, S - 1)
    ref = ref_group(y0, act, ad, bd, sd, (0,))
    _close(y, ref)
    # the down delta on its own (the side-stream expand): zero on the zero slot, whatever its partials hold
    part_d[:, slots == S - 1] = float("nan")
    _close(tf.expand_delta(part_d, bd, sd, slots) + y0, ref)


def ranks():
    """With each slot's rank given (AdapterSlots.group_rank) and KernelSettings.rank_masks, the kernels read only a slot's first `rank` columns of
    each module's A and rows of B: a slot whose padding holds garbage gives the result of its weights cut to its
    rank, in the fused kernels (norm + shrink, rotary + expand, SiLU + expand + down shrink, the down delta's expand).
    (The split shrink's K loop has runtime bounds, which this interpreter does not run: gpu/test_triton_lora.py checks
    it.)"""
    from engine_ext.kernels import KernelSettings
    from engine_ext.kernels import triton_fused as tf
    from engine_ext.rope import cos_sin

    st = KernelSettings(rank_masks=1)
    g = torch.Generator().manual_seed(4)
    T, H, KVH, D, hid, inter, S, R = 7, 4, 2, 16, 96, 160, 4, 8
    qs, kvs = H * D, KVH * D
    slots = torch.tensor([0, 1, 3, 2, 1, 0, 2])  # 3: the zero slot
    ranks = torch.tensor([8, 3, 5, 0], dtype=torch.int32)

    def stacks(fan_in, outs):
        """(A, B) full of values everywhere, and the same cut to each slot's rank (what the kernels must see)."""
        nseg = len(outs)
        a, b = torch.randn(S, fan_in, nseg * R, generator=g), torch.randn(S, R, sum(outs), generator=g)
        a_cut, b_cut = a.clone(), b.clone()
        for s, r in enumerate(ranks.tolist()):
            for seg in range(nseg):
                a_cut[s, :, seg * R + r : (seg + 1) * R] = 0
            b_cut[s, r:] = 0
        return a, b, a_cut, b_cut

    x = torch.randn(T, hid, generator=g)
    # the fused kernels: norm + q/k/v shrink, rotary + expand
    aq, bq, aq_cut, bq_cut = stacks(hid, (qs, kvs, kvs))
    d, w = torch.randn(T, hid, generator=g), torch.randn(hid, generator=g)
    _, h_ref, part_ref = tf.add_rms_norm(x.clone(), d, w, 1e-5, lora=(aq_cut, slots))
    _, h, part = tf.add_rms_norm(x.clone(), d, w, 1e-5, lora=(aq, slots, ranks, R), settings=st)
    live = slots != S - 1
    _close(h, h_ref)
    _close(part[:, live], part_ref[:, live])
    qkv = torch.randn(T, qs + 2 * kvs, generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    cos, sin = cos_sin(inv, torch.arange(T), torch.float32)
    kv_slots = torch.arange(T) * 3
    caches = [torch.zeros(8, 4, KVH, D) for _ in range(4)]
    q_ref = tf.rope_write_kv(qkv.clone(), cos, sin, caches[0], caches[1], kv_slots, H, KVH,
                             lora=(part_ref, bq_cut, sq := torch.rand(S, 3, generator=g), slots))
    q = tf.rope_write_kv(qkv.clone(), cos, sin, caches[2], caches[3], kv_slots, H, KVH,
                         lora=(part, bq, sq, slots, ranks),
                         settings=st)
    _close(q, q_ref)
    _close(caches[2], caches[0])
    _close(caches[3], caches[1])
    # SiLU + gate/up expand + down shrink (the down module at another rank), the down delta on the side stream
    ag, bg, ag_cut, bg_cut = stacks(hid, (inter, inter))
    ad, bd, ad_cut, bd_cut = stacks(inter, (hid,))
    down_ranks = torch.tensor([2, 3, 8, 0], dtype=torch.int32)
    for s, r in enumerate(down_ranks.tolist()):
        ad_cut[s] = ad[s]
        ad_cut[s, :, r:] = 0
        bd_cut[s] = bd[s]
        bd_cut[s, r:] = 0
    sg, sd = torch.rand(S, 2, generator=g), torch.rand(S, 1, generator=g)
    _, _, pg_ref = tf.add_rms_norm(x.clone(), d, w, 1e-5, lora=(ag_cut, slots))
    _, _, pg = tf.add_rms_norm(x.clone(), d, w, 1e-5, lora=(ag, slots, ranks, R), settings=st)
    gu = torch.randn(T, 2 * inter, generator=g)
    act_ref, pd_ref = tf.silu_mul(gu.clone(), lora=(pg_ref, bg_cut, sg, ad_cut, slots))
    act, pd = tf.silu_mul(gu.clone(), lora=(pg, bg, sg, ad, slots, ranks, down_ranks), settings=st)
    _close(act, act_ref)
    _close(pd[:, live].sum(0), pd_ref[:, live].sum(0))
    _close(tf.expand_delta(pd, bd, sd, slots, down_ranks, settings=st), tf.expand_delta(pd_ref, bd_cut, sd, slots))


def lora():
    import triton

    from engine_ext.kernels import KernelSettings
    from engine_ext.kernels import triton_lora as tlr

    g = torch.Generator().manual_seed(3)
    for t, fin, fout, r, S, runs in ((5, 64, 48, 16, 4, False), (40, 128, 96, 32, 5, True), (37, 600, 64, 16, 3, True)):
        a, b = torch.randn(S, fin, r, generator=g), torch.randn(S, r, fout, generator=g)
        a[-1], b[-1] = 0, 0
        sc, x = torch.rand(S, generator=g), torch.randn(t, fin, generator=g)
        if runs:
            idx = torch.randint(0, S, (t,), generator=g).repeat_interleave(torch.randint(1, 20, (t,), generator=g))[:t]
        else:
            idx = torch.randint(0, S, (t,), generator=g)
        y0 = torch.randn(t, fout, generator=g)
        ref, out = y0.clone(), y0.clone()
        add_lora_reference(ref, x, a, b, sc, idx)
        tlr.add_lora_triton(out, x, a, b, sc, idx)
        _close(out, ref)
        delta = tlr.lora_delta(x, a, b, sc, idx)  # the whole delta, float32, into a buffer of its own
        assert delta.dtype == torch.float32 and torch.all(delta[idx == S - 1] == 0)
        _close(delta + y0, ref)
        for run_tokens in (3, 64):  # K splits sized by runs of a verify pass's tokens: the same delta
            _close(tlr.lora_delta(x, a, b, sc, idx, run_tokens=run_tokens) + y0, ref)
        for programs in (1, 1 << 16):  # one K split, or as many as K tiles (KernelSettings.shrink_programs)
            st = KernelSettings(shrink_programs=programs)
            part = tlr.lora_shrink(x, a, idx, S - 1, settings=st)
            k_tile = min(8192 // max(16, r), triton.next_power_of_2(fin))  # the shrink's K tile (triton_lora._tile)
            assert part.shape[0] == (1 if programs == 1 else -(-fin // k_tile))
            _close(tlr.lora_delta(x, a, b, sc, idx, settings=st) + y0, ref)
    # a fused group's deltas, with 16-aligned module starts (one launch each) and without (one per module)
    for segs, fout in (((0, 32, 48), 64), ((0, 40), 72)):
        t, fin, r, S = 12, 96, 8, 3
        a, b = torch.randn(S, fin, len(segs) * r, generator=g), torch.randn(S, r, fout, generator=g)
        a[-1], b[-1] = 0, 0
        sc, x = torch.rand(S, len(segs), generator=g), torch.randn(t, fin, generator=g)
        idx = torch.tensor([0, 0, 0, 1, 1, 2, 2, 0, 1, 1, 1, 1])
        ref, out = torch.zeros(t, fout), torch.zeros(t, fout)
        tlr.add_lora_group_triton(ref, x, a, b, sc, idx, segs)
        delta = tlr.group_delta(x, a, b, sc, idx, segs, run_tokens=4)
        assert torch.all(delta[idx == S - 1] == 0)
        _close(delta, ref)


def engine():
    """A tiny model through the engine with the Triton kernels (fused LoRA at decode, the o and down deltas
    beside their products): the plain-torch engine's tokens."""
    from tiny_models import build_adapter, build_model

    from engine_ext import EngineConfig, LLMEngine, SamplingParams
    from engine_ext.kernels.triton_fused import TritonOps

    root = tempfile.mkdtemp()
    m = build_model("llama", root + "/m")
    every = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    adapters = {"a": build_adapter(m, root + "/a", seed=1, r=8, target_modules=every, std=0.03),
                "b": build_adapter(m, root + "/b", seed=2, r=16, target_modules=("q_proj", "o_proj", "down_proj"),
                                   std=0.08)}

    def run(**kw):
        e = LLMEngine(EngineConfig(model=m, max_loras=2, block_size=4, num_kv_blocks=64, **kw))
        for n, p in adapters.items():
            e.add_adapter(n, p)
        outs = e.generate(prompt_token_ids=[[1, 2, 3, 4, 5], [7, 8, 9], [3, 3]], adapter_names=["a", None, "b"],
                          sampling_params=SamplingParams(max_tokens=5, ignore_eos=True))
        return [o.token_ids for o in outs]

    ref = run()
    used = []
    lora_delta = TritonOps.lora_delta

    def counted(self, *args, **kw):
        used.append(1)
        return lora_delta(self, *args, **kw)

    TritonOps.lora_delta = counted
    assert run(lora_backend="triton", attn_backend="triton", layer_ops="triton") == ref
    assert used  # the fused path ran
    used.clear()
    assert run(lora_backend="triton", attn_backend="triton") == ref  # the Triton LoRA and attention, torch ops
    assert not used
    # other launch settings change nothing, the products in the split-K Triton GEMM included
    assert run(lora_backend="triton", attn_backend="triton", layer_ops="triton",
               kernels={"attn_block_n": 16, "attn_rows": 0, "norm_chunk": 64, "silu_lora_block": 128,
                        "expand_block_n": 16, "shrink_warps": 4, "triton_linear_tokens": 1}) == ref
    # speculative cycles: their verify passes (several tokens of one sequence) fold LoRA as decode steps do, and with
    # fold_multi_token_ranks and beside_multi_token_ranks 0 apply it with the split kernels after each product
    # instead; attention's wide tiles on and off
    from engine_ext import SpecConfig

    spec = SpecConfig(num_draft_tokens=3, gate=False)
    kernels = dict(lora_backend="triton", attn_backend="triton", layer_ops="triton")
    assert run(speculative=spec, **kernels) == ref
    assert used
    used.clear()
    assert run(speculative=spec, kernels={"fold_multi_token_ranks": 0, "beside_multi_token_ranks": 0,
                                          "attn_rows_multi": 0}, **kernels) == ref
    assert not used  # every adapter-on forward of a forced cycle has several tokens of a sequence: none folded
    # ...and beside the products, every group's delta beside its product: multi-token forwards past a fold bound
    # (by rank, and by the layer's columns) and decode steps with beside_lora_tokens
    besides = []
    group_delta = TritonOps.group_delta

    def counted_group(self, *args, **kw):
        besides.append(kw.get("multi"))
        return group_delta(self, *args, **kw)

    TritonOps.group_delta = counted_group
    assert run(speculative=spec, kernels={"fold_multi_token_ranks": 0, "beside_lora_tokens": 4096}, **kernels) == ref
    assert besides and all(besides) and used  # group_delta for q/k/v and gate/up, lora_delta for o and down
    besides.clear()
    assert run(speculative=spec, kernels={"fold_multi_token_columns": 1}, **kernels) == ref
    assert besides
    besides.clear()
    assert run(kernels={"fold_decode_tokens": 0, "beside_lora_tokens": 4096}, **kernels) == ref
    assert besides and not any(besides)  # decode steps (and prompts) beside the products
    # "mixed": attention's LoRA folded, the MLP's beside its products
    from engine_ext.model import DecoderLayer

    halves = []
    real = {name: getattr(DecoderLayer, name) for name in ("_attention_beside", "_mlp_beside")}
    for name, method in real.items():
        setattr(DecoderLayer, name, lambda *a, name=name, method=method: halves.append(name) or method(*a))
    assert run(speculative=spec, kernels={"fold_multi_token_columns": 1, "mixed_multi_tokens": 4096}, **kernels) == ref
    for name, method in real.items():
        setattr(DecoderLayer, name, method)
    assert "_mlp_beside" in halves and "_attention_beside" not in halves  # every multi-token forward mixed

def fp8():
    """The W8A16 GEMM against quantization.fp8_linear: decode-sized and prompt-sized products, ragged N and K, a bias,
    a strided x, launch settings; then a tiny FP8 model through the engine with the Triton layer ops (the GEMM in
    every product) against the FP8 engine on the plain-torch ops."""
    from tiny_models import build_adapter, build_model

    from engine_ext import EngineConfig, LLMEngine, SamplingParams
    from engine_ext.kernels import KernelSettings
    from engine_ext.kernels.triton_fp8 import fp8_linear_triton, launch_config, linear_triton
    from engine_ext.quantization import fp8_linear, quantize_fp8

    g = torch.Generator().manual_seed(0)
    narrow = KernelSettings(fp8_block_k=32, fp8_block_n=16, fp8_stages=1, fp8_warps=1)
    # K split in 2, 4 and 8 shares (one of them shorter when K's tiles do not divide evenly), and not split
    split = KernelSettings(fp8_block_k=16, fp8_block_n=16, fp8_programs=1 << 20, fp8_split_steps=1, fp8_stages=2)
    for m, n, k, bias in [(1, 48, 64, False), (5, 200, 300, True), (17, 64, 256, False), (40, 96, 80, True),
                          (70, 130, 96, False), (300, 40, 48, True)]:
        w8, scale = quantize_fp8(torch.randn(n, k, generator=g))
        b = torch.randn(n, generator=g) if bias else None
        x = torch.randn(m, k + 8, generator=g)[:, 3:k + 3]  # rows strided past their length
        ref = fp8_linear(x, w8, scale, b)
        # each also with its decode-sized tiles transposed (weights first), tokens in tiles of up to 128, and with
        # products of up to 16 tokens in the GEMV kernel (K split or not)
        for settings in (KernelSettings(), narrow, split):
            _close(fp8_linear_triton(x, w8, scale, b, settings=settings), ref)
            swapped = dataclasses.replace(settings, fp8_swap_tokens=256, fp8_block_m=128)
            _close(fp8_linear_triton(x, w8, scale, b, settings=swapped), ref)
            gemv = dataclasses.replace(settings, fp8_gemv_tokens=16, fp8_gemv_block_n=16)
            _close(fp8_linear_triton(x, w8, scale, b, settings=gemv), ref)
            multi = dataclasses.replace(settings, fp8_multi_tokens=4, fp8_multi_block_k=16, fp8_multi_block_n=32)
            _close(fp8_linear_triton(x, w8, scale, b, settings=multi), ref)
        # the same kernel over dense weights (no widening, no scale): F.linear's contract
        w = torch.randn(n, k, generator=g)
        for settings in (KernelSettings(), split, dataclasses.replace(split, fp8_swap_tokens=256),
                         dataclasses.replace(split, fp8_gemv_tokens=16)):
            _close(linear_triton(x, w, b, settings=settings), torch.nn.functional.linear(x, w, b))
    # TritonOps.linear takes it from triton_linear_tokens tokens up to 256, cuBLAS's F.linear elsewhere
    from engine_ext.kernels import triton_fused

    taken = []
    real = triton_fused.linear_triton
    triton_fused.linear_triton = lambda *a, **kw: taken.append(a[0].shape[0]) or real(*a, **kw)
    ops = triton_fused.TritonOps(KernelSettings(triton_linear_tokens=4), torch.device("cpu"))
    w, b = torch.randn(24, 40, generator=g), torch.randn(24, generator=g)
    for t in (1, 3, 4, 17, 256, 257):
        x = torch.randn(t, 40, generator=g)
        _close(ops.linear(x, w, b), torch.nn.functional.linear(x, w, b))
    triton_fused.linear_triton = real
    assert taken == [4, 17, 256]
    x3 = torch.randn(2, 3, 64, generator=g)
    w8, scale = quantize_fp8(torch.randn(32, 64, generator=g))
    _close(fp8_linear_triton(x3, w8, scale), fp8_linear(x3, w8, scale))
    assert fp8_linear_triton(x3[:0], w8, scale).shape == (0, 3, 32)
    # K is split while the tiles are fewer than the programs asked for, each share keeping fp8_split_steps K tiles;
    # a wide product or a prompt is not split
    wide128 = KernelSettings(fp8_block_n=128)
    assert launch_config(1, 4096, 4096, wide128)[5] == 8 and launch_config(1, 131072, 4096, wide128)[5] == 1
    assert launch_config(1, 4096, 4096, KernelSettings(fp8_block_n=128, fp8_split_steps=16))[5] == 2
    assert launch_config(1, 4096, 4096, wide128)[1] == 128 and launch_config(1, 4096, 4096)[1] == 64
    assert launch_config(160, 4096, 4096)[0] == 64 and launch_config(1000, 4096, 4096)[0] > 64
    assert launch_config(1000, 4096, 4096)[5] == 1
    # past fp8_multi_tokens tokens (and up to the bytes-bound limit) the multi-token tiles; 0 keeps the decode ones
    multi = KernelSettings(fp8_multi_tokens=32, fp8_multi_block_k=64, fp8_multi_block_n=256, fp8_block_k=128,
                           fp8_block_n=128)
    assert launch_config(32, 4096, 4096, multi)[1:3] == (128, 128)
    assert launch_config(33, 4096, 4096, multi)[1:3] == (256, 64) and launch_config(160, 4096, 4096, multi)[2] == 64
    assert launch_config(1000, 4096, 4096, multi)[1:3] == launch_config(1000, 4096, 4096)[1:3]
    assert launch_config(160, 4096, 4096, KernelSettings(fp8_multi_tokens=32, fp8_multi_block_n=0))[1:3] == (64, 64)
    assert launch_config(160, 4096, 4096, KernelSettings(fp8_multi_tokens=0))[1:3] == (64, 128)
    # transposed tiles up to fp8_swap_tokens tokens, never for a prompt; the token side up to fp8_block_m
    wide = KernelSettings(fp8_swap_tokens=160, fp8_block_m=256)
    assert launch_config(160, 4096, 4096, wide)[6] and not launch_config(161, 4096, 4096, wide)[6]
    assert launch_config(160, 4096, 4096, wide)[0] == 256 and not launch_config(1000, 4096, 4096, wide)[6]

    root = tempfile.mkdtemp()
    model = build_model("llama", root + "/m")
    adapter = build_adapter(model, root + "/a", seed=1, r=8, std=0.03)

    def run(**kw):
        e = LLMEngine(EngineConfig(model=model, max_loras=2, block_size=4, num_kv_blocks=64, quantization="fp8", **kw))
        e.add_adapter("a", adapter)
        outs = e.generate(prompt_token_ids=[[1, 2, 3, 4, 5], [7, 8, 9]], adapter_names=["a", None],
                          sampling_params=SamplingParams(max_tokens=5, ignore_eos=True))
        return e, [o.token_ids for o in outs]

    _, ref = run()
    engine, out = run(lora_backend="triton", attn_backend="triton", layer_ops="triton")
    assert out == ref
    assert engine.runner.model.layers[0].linear.__self__.matmul.func is fp8_linear_triton
    assert run(lora_backend="triton", attn_backend="triton", layer_ops="triton", kernels={"fp8_gemv_tokens": 8})[1] == ref


def commit():
    from commit_cases import check_commit_kernel
    from engine_ext.kernels.triton_verify import commit_rows_triton

    assert check_commit_kernel(commit_rows_triton, torch.device("cpu")) > 50


def growth():
    """Slots that grow mid-run (test_slot_growth.py) with the Triton kernels: the tokens equal full-width slots'."""
    import test_slot_growth as t

    from engine_ext import SpecConfig

    adapters = t.workload(tempfile.mkdtemp())
    kernels = dict(lora_backend="triton", attn_backend="triton", layer_ops="triton")
    for spec in (None, SpecConfig(num_draft_tokens=3, gate=False)):
        grown_engine, grown = t.run(adapters, kernels, 8, spec)
        _, full = t.run(adapters, kernels, None, spec)
        assert grown == full and len(grown) == 3, (grown, full)
        assert grown_engine.adapters.slots.rank == 32 and grown_engine.adapters.slots.generation == 1


def metadata():
    """The metadata fix-ups (apply_sources, advance_forward) against their references, exactly (metadata_cases.py);
    then a tiny model's speculative cycles with layer_ops "triton" (drafting passes relaunched, every forward's ids and
    positions from the device) run both kernels and give the plain-torch engine's tokens."""
    import metadata_cases as m
    from tiny_models import build_adapter, build_model

    from engine_ext import EngineConfig, LLMEngine, SamplingParams, SpecConfig
    from engine_ext.kernels import triton_metadata as tm

    assert m.check_apply_sources(tm.apply_sources_triton, "cpu") == len(m.SOURCES) * len(m.SIZES)
    assert m.check_advance_forward(tm.advance_forward_triton, "cpu") == 4 * len(m.SIZES)
    m.check_advance_refuses_short_tokens(tm.advance_forward_triton, "cpu")

    root = tempfile.mkdtemp()
    model = build_model("llama", root + "/m")
    adapter = build_adapter(model, root + "/a", seed=1, r=8, std=0.03)

    def run(**kw):
        e = LLMEngine(EngineConfig(model=model, max_loras=2, block_size=4, num_kv_blocks=64, debug_checks=True,
                                   speculative=SpecConfig(num_draft_tokens=3, gate=False), **kw))
        e.add_adapter("a", adapter)
        outs = e.generate(prompt_token_ids=[[1, 2, 3, 4, 5], [7, 8, 9], [3, 3]], adapter_names=["a", None, "a"],
                          sampling_params=SamplingParams(max_tokens=9, ignore_eos=True))
        return [o.token_ids for o in outs]

    calls = []
    for name in ("apply_sources_triton", "advance_forward_triton"):
        real = getattr(tm, name)
        setattr(tm, name, lambda *a, name=name, real=real: calls.append(name) or real(*a))
    ref = run()
    assert not calls  # the plain-torch engine runs the references
    assert run(layer_ops="triton") == ref
    assert {"apply_sources_triton", "advance_forward_triton"} <= set(calls), set(calls)


if __name__ == "__main__":
    globals()[sys.argv[1]]()
    print("ok", sys.argv[1])
