"""The Triton kernels' logic on the CPU, through Triton's interpreter (float32; the interpreter's bf16 is not
torch's), against the plain-torch references. Run by test_kernels_interpreted.py in a subprocess with
TRITON_INTERPRET=1 (it must be set before the kernels are defined):

    TRITON_INTERPRET=1 python tests/engine_ext/interpreted_checks.py attention|gemm|fused|lora|host_copy|engine
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.nn.functional as F

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
    from engine_ext.kernels import triton_attention as ta

    g = torch.Generator().manual_seed(0)
    heads, kvh, d, rank, nslots = 8, 2, 16, 8, 4
    settings = [dict(MAX_SPLITS=1, ROWS=16, BLOCK_N=32), dict(MAX_SPLITS=1, ROWS=0, BLOCK_N=16),
                dict(MAX_SPLITS=4, SPLIT_BUDGET=1 << 16, ROWS=16, BLOCK_N=16)]
    for lens, qlens in (([37, 5, 2], [1, 1, 1]), ([37, 20, 6], [1, 3, 5])):
        q, kc, vc, meta = _attn_case(lens, qlens, heads, kvh, d, 4, g)
        for window in (None, 5):
            ref = paged_attention(q, kc, vc, meta, 0.25, window)
            for s in settings:
                for k, v in s.items():
                    setattr(ta, k, v)
                _close(ta.paged_attention_triton(q, kc, vc, meta, 0.25, window), ref)
        # the o_proj shrink in the epilogue (and in the split-KV combine)
        a_o = torch.randn(nslots, heads * d, rank, generator=g)
        a_o[-1] = 0
        slots = torch.tensor([0, nslots - 1, 2])[meta.token_seq]
        for s in settings[0], settings[2]:
            for k, v in s.items():
                setattr(ta, k, v)
            out, part = ta.paged_attention_triton(q, kc, vc, meta, 0.25, lora=(a_o, slots))
            live = slots != nslots - 1
            shrink = torch.einsum("ti,tir->tr", out.reshape(len(slots), -1), a_o[slots])
            _close(part.sum(0)[live], shrink[live])


def gemm():
    from engine_ext.kernels import triton_gemm as tg

    g = torch.Generator().manual_seed(1)
    for m, n, k, bias, target in ((5, 200, 300, True, 264), (32, 64, 512, False, 264), (17, 48, 256, True, 0)):
        tg.TARGET_BLOCKS, tg.BLOCK_N, tg.BLOCK_K = target, 32, 64
        x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
        b = torch.randn(n, generator=g) if bias else None
        _close(tg.skinny_matmul(x, w, b), F.linear(x, w, b))
        counters = tg._counters.get(x.device)
        assert counters is None or not counters.any()  # every split tile's ticket counter was reset
        # the one-module LoRA expand in the epilogue
        rank, parts, nslots = 8, 3, 4
        part = torch.randn(parts, m, rank, generator=g)
        bb = torch.randn(nslots, rank, n, generator=g)
        bb[-1] = 0
        scale = torch.rand(nslots, 1, generator=g)
        slots = torch.randint(0, nslots, (m,), generator=g)
        ref = F.linear(x, w, b)
        live = slots != nslots - 1
        ref[live] += torch.einsum("mr,mrn->mn", part.sum(0) * scale[slots], bb[slots])[live]
        _close(tg.skinny_matmul(x, w, b, (part, bb, scale, slots)), ref)
    # a fused group's expand (three modules, as q/k/v): each column tile takes its module's partials and scale
    m, n, k, rank, nslots, segs = 9, 128, 2048, 8, 4, (0, 64, 96)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    part = torch.randn(4, m, 3 * rank, generator=g)
    bb = torch.randn(nslots, rank, n, generator=g)
    bb[-1] = 0
    scale = torch.rand(nslots, 3, generator=g)
    slots = torch.randint(0, nslots, (m,), generator=g)
    ref = F.linear(x, w)
    live = slots != nslots - 1
    for seg, (lo, hi) in enumerate(zip(segs, (64, 96, 128))):
        s = part.sum(0)[:, seg * rank : (seg + 1) * rank] * scale[slots, seg][:, None]
        ref[live, lo:hi] += torch.einsum("mr,mrn->mn", s, bb[slots][:, :, lo:hi])[live]
    tg.TARGET_BLOCKS = 264
    assert tg.plan(m, n, k, 32)[3] > 1  # split K too
    _close(tg.skinny_matmul(x, w, None, (part, bb, scale, slots, segs)), ref)


def fused():
    from engine_ext.kernels import triton_fused as tf
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
    _, _, part_g = tf.add_rms_norm(x.clone(), d, w, 1e-5, lora=(ag, slots))
    gu = torch.randn(T, 2 * inter, generator=g)
    act_ref = TorchOps.silu_mul(ref_group(gu, h, ag, bg, sg, (0, inter)))[0]
    act, part_d = tf.silu_mul(gu.clone(), lora=(part_g, bg, sg, ad, slots))
    _close(act, act_ref)
    # the gate/up deltas already in gate_up (a product's epilogue added them): only the down shrink
    with_deltas = ref_group(gu, h, ag, bg, sg, (0, inter))
    act2, part_d2 = tf.silu_mul(with_deltas.clone(), lora=(None, None, None, ad, slots))
    _close(act2, act_ref)
    live = slots != S - 1
    _close(part_d2[:, live], part_d[:, live])
    y0 = torch.randn(T, hid, generator=g)
    y = y0.clone()
    lora_expand(y, part_d, bd, sd, slots, S - 1)
    _close(y, ref_group(y0, act, ad, bd, sd, (0,)))


def lora():
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


def host_copy():
    from engine_ext.kernels import host_copy as hc

    src = torch.arange(3000, dtype=torch.long).view(3, 1000)
    dst = torch.zeros_like(src)
    hc._copy_kernel[(3,)](src, dst, src.numel(), BLOCK=1024)
    assert torch.equal(src, dst)


def engine():
    """A tiny model through the engine with every Triton path on (the o shrink in attention, the skinny GEMM
    with its LoRA epilogue, forced split K; then every expand in a product): the plain-torch engine's tokens."""
    from tiny_models import build_adapter, build_model

    from engine_ext import EngineConfig, LLMEngine, SamplingParams
    from engine_ext.kernels import triton_gemm
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

    def linear(x, w, b=None, lora=None):  # the skinny kernel for every decode-sized product (x is on the CPU here)
        if 0 < x.shape[0] <= triton_gemm.MAX_ROWS:
            used.append(lora is not None)
            return triton_gemm.skinny_matmul(x, w, b, lora)
        return TorchOps_linear(x, w, b, lora)

    TorchOps_linear = TritonOps.linear
    TritonOps.fold_o_shrink, TritonOps.linear, triton_gemm.TARGET_BLOCKS = True, staticmethod(linear), 64
    assert run(lora_backend="triton", attn_backend="triton") == ref
    assert any(used)  # the epilogue expand ran
    TritonOps.expand_in_product = True  # q/k/v and gate/up expands in their products too
    used.clear()
    assert run(lora_backend="triton", attn_backend="triton") == ref
    assert sum(used) > 2 * len(used) // 5  # 4 of every 5 decode products carry an expand (the LM head none)


if __name__ == "__main__":
    globals()[sys.argv[1]]()
    print("ok", sys.argv[1])
