"""Sweep the launch settings of the decode kernels with LoRA (kernels/triton_fused.py, and the split
shrink/expand kernels of kernels/triton_lora.py that the fused path keeps for o and down) at the
Llama-3.2-1B shape: 32 tokens, each on its own adapter (rank 16 by default), one weight set per layer;
each kernel timed as a CUDA graph of 16 calls (one per layer) beside the bytes its adapter tiles take
(the floor at 4.3 TB/s). The settings are engine_ext.KernelSettings fields. Prints JSON rows and the best
setting per kernel.

    python bench/fused_sweep.py [--rank 16]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import graph_ms  # noqa: E402
from engine_ext.kernels import KernelSettings  # noqa: E402
from engine_ext.kernels import triton_fused as tf  # noqa: E402
from engine_ext.kernels import triton_lora as tl_mod  # noqa: E402

HBM = 4.3e12
HIDDEN, INTER, Q, KV, HEADS, KVH, D, LAYERS = 2048, 8192, 2048, 512, 32, 8, 64, 16


def layer_args(rank, tokens, slots, g):
    def r(*shape, std=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * std).bfloat16()

    idx = torch.arange(tokens, device="cuda") % (slots - 1)
    qkv_w = Q + 2 * KV
    nblk = tokens * 40
    return {
        "x": r(tokens, HIDDEN), "delta": r(tokens, HIDDEN), "w": r(HIDDEN), "idx": idx,
        "a_qkv": r(slots, HIDDEN, 3 * rank, std=0.02), "b_qkv": r(slots, rank, qkv_w, std=0.02),
        "s_qkv": torch.ones(slots, 3, device="cuda"), "qkv": r(tokens, qkv_w),
        "cos": r(tokens, D), "sin": r(tokens, D), "kc": r(nblk, 16, KVH, D), "vc": r(nblk, 16, KVH, D),
        "slot_mapping": torch.arange(tokens, device="cuda") * 16,
        "a_gu": r(slots, HIDDEN, 2 * rank, std=0.02), "b_gu": r(slots, rank, 2 * INTER, std=0.02),
        "s_gu": torch.ones(slots, 2, device="cuda"), "a_down": r(slots, INTER, rank, std=0.02),
        "gate_up": r(tokens, 2 * INTER), "attn": r(tokens, Q), "o_out": r(tokens, HIDDEN),
        "a_o": r(slots, Q, rank, std=0.02), "b_o": r(slots, rank, HIDDEN, std=0.02),
        "s_o": torch.ones(slots, device="cuda"),
    }


def norm_qkv(L, s=KernelSettings()):
    return tf.add_rms_norm(L["x"], L["delta"], L["w"], 1e-5, (L["a_qkv"], L["idx"]), settings=s)


def rope(L, part, s=KernelSettings()):
    return tf.rope_write_kv(L["qkv"], L["cos"], L["sin"], L["kc"], L["vc"], L["slot_mapping"], HEADS, KVH,
                            (part, L["b_qkv"], L["s_qkv"], L["idx"]), settings=s)


def silu(L, part, s=KernelSettings()):
    return tf.silu_mul(L["gate_up"], (part, L["b_gu"], L["s_gu"], L["a_down"], L["idx"]), settings=s)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    g = torch.Generator("cuda").manual_seed(0)
    layers = [layer_args(args.rank, args.tokens, args.tokens + 1, g) for _ in range(LAYERS)]
    parts = [norm_qkv(L)[2] for L in layers]
    gu_parts = [tf.add_rms_norm(L["x"], L["delta"], L["w"], 1e-5, (L["a_gu"], L["idx"]))[2] for L in layers]
    per_tok = 2 * args.rank  # bytes per element x rank
    floors = {"norm_qkv": HIDDEN * 3 * per_tok, "rope": (Q + 2 * KV) * per_tok, "silu": 3 * INTER * per_tok,
              "o_lora": (Q + HIDDEN) * per_tok, "down_expand": HIDDEN * per_tok}
    floors = {k: v * args.tokens * LAYERS / HBM * 1e3 for k, v in floors.items()}
    rows, best = [], {}

    def record(kernel, setting, fn):
        ms = graph_ms(lambda: [fn(L, i) for i, L in enumerate(layers)], 50)
        row = {"kernel": kernel, **setting, "ms16": ms, "floor_ms16": floors[kernel]}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if kernel not in best or ms < best[kernel]["ms16"]:
            best[kernel] = row

    base = KernelSettings()
    for chunk, warps in itertools.product((64, 128, 256), (1, 2, 4)):
        s = replace(base, norm_chunk=chunk, norm_lora_warps=warps)
        record("norm_qkv", {"chunk": chunk, "warps": warps}, lambda L, i: norm_qkv(L, s))
    for warps in (1, 2):
        s = replace(base, rope_lora_warps=warps)
        record("rope", {"warps": warps}, lambda L, i: rope(L, parts[i], s))
    for block, warps in itertools.product((128, 256, 512, 1024), (2, 4)):
        s = replace(base, silu_lora_block=block, silu_lora_warps=warps)
        record("silu", {"block": block, "warps": warps}, lambda L, i: silu(L, gu_parts[i], s))
    # the split kernels the fused path keeps: o's shrink + expand, and the down expand of silu's partials
    down_parts = [silu(L, gu_parts[i])[1] for i, L in enumerate(layers)]
    for block_n, warps in itertools.product((0, 128, 256), (2, 4)):
        s = replace(base, expand_block_n=block_n, shrink_warps=warps, expand_warps=warps)
        record("o_lora", {"block_n": block_n, "warps": warps},
               lambda L, i: tl_mod.add_lora_triton(L["o_out"], L["attn"], L["a_o"], L["b_o"], L["s_o"], L["idx"],
                                                   settings=s))
        record("down_expand", {"block_n": block_n, "warps": warps},
               lambda L, i: tl_mod.lora_expand(L["o_out"], down_parts[i], L["b_o"], L["s_o"], L["idx"],
                                               L["a_o"].shape[0] - 1, settings=s))
    for k, row in best.items():
        print("BEST", k, json.dumps(row))


if __name__ == "__main__":
    main()
