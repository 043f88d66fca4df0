"""GPU decode benchmark: base-only, plain multi-LoRA and speculative decoding against the bytes model
and against HF transformers + PEFT on the same GPU (`--hf`: bench/hf_peer.py, each point in a process of its own),
in one run. Prints JSON (and writes --out).

Two levels, both reported for every point:
- forward: one decode-shaped forward through ModelRunner.run (CUDA graph replay + host packing),
  with `gpu_ms` = graph replay alone timed by CUDA events, `step_ms` = the call as the engine sees
  it (host packing, copies, replay, logits copy), against the bytes model
  (base weights + distinct adapter weights + KV read) / 4.3 TB/s;
- engine: LLMEngine.step() in a loop (scheduling, sampling, drafting, verification included):
  decode tokens/s and step (inter-token) latency p50/p99, acceptance for speculative modes.

    python bench/decode.py --out decode.json                         # 1B shape, default matrix
    python bench/decode.py --shapes llama-3.2-1b llama-3.1-8b --ranks 16 64 --hf
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import (  # noqa: E402
    SHAPES, build_random_adapter, build_random_model, machine, measure_decode, percentile, replay_ms, spec_delta)
from engine_ext import EngineConfig, KernelSettings, LLMEngine, SamplingParams, SpecConfig  # noqa: E402
from engine_ext.batch import SeqWork  # noqa: E402

HBM_BYTES_PER_S = 4.3e12  # measured device-to-device copy rate on this H200 (KINDS.md)
CONTEXT = 512  # tokens already in each sequence's cache for the forward-level points
MAX_K = 4


def build_model_on_gpu(out_dir: str, shape: str, seed: int = 0, residual_scale: float = 1.0) -> str:
    """bench.common.build_random_model's files, drawn on the GPU: an 8B model in seconds, not minutes.

    `residual_scale` < 1 scales o_proj and down_proj, so each layer adds little to the residual stream and the
    next-token distribution is peaked (the model tends to repeat its input token by a wide logit margin).
    A random model's logits are otherwise nearly flat, and rounding noise alone (different kernels in the
    drafting and the verify pass) flips ~6-10% of greedy drafts whatever the adapters' scale; with a
    peaked base the adapters' scale is what sets the acceptance rate. Same shapes, same bytes per step."""
    if os.path.isfile(os.path.join(out_dir, "model.safetensors")) or not torch.cuda.is_available():
        if residual_scale != 1.0 and not torch.cuda.is_available():
            raise ValueError("--peaked needs a GPU")
        return out_dir if os.path.isfile(os.path.join(out_dir, "model.safetensors")) else build_random_model(out_dir, shape)
    from safetensors.torch import save_file

    hidden, inter, layers, heads, kv, vocab = SHAPES[shape]
    hd = hidden // heads
    g = torch.Generator("cuda").manual_seed(seed)

    def w(*shape_, scale=1.0):
        return (torch.randn(*shape_, generator=g, device="cuda", dtype=torch.bfloat16) * (0.02 * scale)).cpu()

    ones = torch.ones(hidden, dtype=torch.bfloat16)
    t = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": ones}
    for i in range(layers):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": ones.clone(), p + "post_attention_layernorm.weight": ones.clone(),
              p + "self_attn.q_proj.weight": w(heads * hd, hidden), p + "self_attn.k_proj.weight": w(kv * hd, hidden),
              p + "self_attn.v_proj.weight": w(kv * hd, hidden),
              p + "self_attn.o_proj.weight": w(hidden, heads * hd, scale=residual_scale),
              p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden),
              p + "mlp.down_proj.weight": w(hidden, inter, scale=residual_scale)}
    os.makedirs(out_dir, exist_ok=True)
    save_file(t, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    del t
    # the same config.json as bench.common writes: write a tiny one aside and take its config
    tmp = tempfile.mkdtemp()
    build_random_model(tmp, "tiny")
    with open(os.path.join(tmp, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
               num_key_value_heads=kv, vocab_size=vocab)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out_dir


def bytes_model(engine, batch: int, distinct: int, rank: int, context: int) -> dict:
    spec = engine.spec
    # parameters() lists a tied embedding once: the LM head reads it whole, the lookup only B rows.
    base = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    per_adapter = 2 * rank * spec.num_layers * sum(i + o for i, o in spec.module_shapes().values())
    kv = 2 * batch * context * spec.num_layers * spec.kv_size * 2
    total = base + distinct * per_adapter + kv
    return {"base_bytes": base, "adapter_bytes": per_adapter, "kv_bytes": kv, "bytes": total,
            "bytes_model_ms": total / HBM_BYTES_PER_S * 1e3}


def _time_ms(fn, iters: int) -> tuple[float, float]:
    """(median of wall ms per call with a sync after each, p99)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2], times[min(len(times) - 1, int(0.99 * len(times)))]


def forward_point(engine, names: list[str | None], tokens_per_seq: int, use_lora: bool, iters: int) -> dict:
    """Time one decode (tokens_per_seq=1) or verify (k+1) forward of len(names) sequences at CONTEXT."""
    runner, slots, bs = engine.runner, engine.adapters.slots, engine.config.block_size
    nblocks = -(-(CONTEXT + tokens_per_seq) // bs)
    work = [SeqWork([7] * tokens_per_seq, CONTEXT, list(range(i * nblocks, (i + 1) * nblocks)),
                    engine.adapters.slot_of(n), num_logits=tokens_per_seq) for i, n in enumerate(names)]
    step_ms, step_p99 = _time_ms(lambda: runner.run(work, slots, use_lora=use_lora), iters)
    total = len(names) * tokens_per_seq
    bucket = next(b for b in runner.graphs.buckets if b >= total)
    lora_on = use_lora and any(n is not None for n in names)
    # a bare replay of rank 0's graph alone would wait forever on the other ranks' collectives
    tp = engine.config.tensor_parallel_size
    graphs = runner.graphs.graphs
    kind = (bucket, lora_on, lora_on and tokens_per_seq > 1)
    kind = kind if kind in graphs else kind[:2]  # an engine before graphs were kept per tokens a sequence (A/B)
    gpu_ms = replay_ms(graphs[kind][0], iters) if tp == 1 else None
    return {"step_ms": step_ms, "step_ms_p99": step_p99, "gpu_ms": gpu_ms, "bucket": bucket}


def cold_load(engine, workdir: str, shape: str, rank: int, repeats: int = 20, batch: int = 32, steps: int = 96,
              every: int = 4) -> dict:
    """Issue 7, point 4: a cold adapter's load from pinned host memory, and what it costs running requests.

    (i) load: `try_activate` (packed buffer -> slot, on the side stream) until its copy has landed, polled
    as the scheduler polls, against one pinned host-to-device copy of the adapter's real bytes
    (2 * rank * layers * sum(in + out)); medians of `repeats`, on an idle GPU.
    (ii) inter-token latency: `batch` requests decoding on warm adapters through LLMEngine.step() (plain
    multi-LoRA); every `every`-th step a cold load is activated just before the step, where the scheduler
    activates it, and its copy is issued once the step's forward is queued (AdapterSlots.flush). Steps with a
    copy in flight against the steps with none."""
    spec, adapters, slots = engine.spec, engine.adapters, engine.adapters.slots
    real_bytes = 2 * rank * spec.num_layers * sum(i + o for i, o in spec.module_shapes().values())
    packed = adapters.add("cold", os.path.join(workdir, f"{shape}-r{rank}"))  # parsed, packed and pinned

    issue_ms, load_ms = [], []
    for _ in range(repeats + 1):  # the first is a warm-up
        slots.deactivate("cold")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        adapters.try_activate("cold", set())
        slots.flush()  # where the engine issues it: right after queuing its step's forward (AdapterSlots.flush)
        t1 = time.perf_counter()
        while not adapters.ready("cold"):
            pass
        t2 = time.perf_counter()
        issue_ms.append((t1 - t0) * 1e3)
        load_ms.append((t2 - t0) * 1e3)
    slots.deactivate("cold")
    host = torch.empty(real_bytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(real_bytes, dtype=torch.uint8, device="cuda")
    copy_ms = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        copy_ms.append((time.perf_counter() - t0) * 1e3)
    del host, dev
    load, copy = percentile(load_ms[1:], 0.5), percentile(copy_ms[1:], 0.5)
    out = {"adapter_bytes": real_bytes, "packed_bytes": packed.nbytes, "load_repeats": repeats,
           "h2d_copy_ms": copy, "load_ms": load, "load_issue_ms": percentile(issue_ms[1:], 0.5),
           "load_over_h2d": load / copy}

    # (ii) batch of warm-adapter decodes, a cold load issued before every `every`-th step
    warm = [f"a{i}" for i in range(min(batch, slots.max_loras - 1))]  # one slot left for the cold adapter
    names = [warm[i % len(warm)] for i in range(batch)]
    engine.set_speculation(None)
    activate(engine, warm)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=steps + 16, ignore_eos=True)
    ids = [engine.add_request(prompt_token_ids=torch.randint(10, spec.vocab_size, (64,), generator=g).tolist(),
                              sampling_params=params, adapter_name=n) for n in names]
    for _ in range(8):  # prefill, graph capture, warm-up
        engine.step()
    quiet, loading, landed_in_step = [], [], 0
    for k in range(steps):
        if adapters.slots.slot_of("cold") is not None:  # free the slot again, outside the timed steps
            slots.synchronize()
            slots.deactivate("cold")
            torch.cuda.synchronize()
        cold = k % every == every - 1
        t0 = time.perf_counter()
        if cold:
            adapters.try_activate("cold", set(names))
        engine.step()
        torch.cuda.synchronize()
        (loading if cold else quiet).append((time.perf_counter() - t0) * 1e3)
        landed_in_step += cold and adapters.ready("cold")
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests:
        engine.step()
    slots.synchronize()
    slots.deactivate("cold")
    adapters.remove("cold")
    out |= {"itl_batch": batch, "itl_warm_adapters": len(warm), "itl_steps_quiet": len(quiet),
            "itl_steps_loading": len(loading), "itl_loads_landed_within_their_step": landed_in_step,
            "itl_ms_p50_quiet": percentile(quiet, 0.5), "itl_ms_max_quiet": max(quiet),
            "itl_ms_p50_loading": percentile(loading, 0.5), "itl_ms_max_loading": max(loading),
            "itl_rise_p50": percentile(loading, 0.5) / percentile(quiet, 0.5) - 1,
            "itl_rise_max": max(loading) / max(quiet) - 1}
    return out


def activate(engine, names: list[str]) -> None:
    for n in names:
        if not engine.adapters.try_activate(n, set(names)):
            raise RuntimeError(f"could not make {n} resident")
    engine.adapters.slots.synchronize()  # copies run on a side stream: landed before any forward reads them


def build_engine(model_dir: str, adapters: dict[str, str], max_loras: int, max_rank: int, max_graph_tokens: int,
                 kernels: KernelSettings | None = None, tp: int = 1, quantization: str | None = None):
    cfg = EngineConfig(model=model_dir, device="cuda", dtype="bfloat16", tensor_parallel_size=tp,
                       quantization=quantization,
                       max_loras=max_loras, max_lora_rank=max_rank, lora_slot_rank=max_rank,  # slots that wide
                       max_cpu_loras=max(64, len(adapters) + 1), kv_cache_memory_gb=24, max_num_seqs=128,
                       max_num_batched_tokens=8192, max_model_len=2048, lora_backend="triton", attn_backend="triton",
                       layer_ops="triton", kernels=kernels or KernelSettings(), cuda_graphs=True,
                       max_graph_tokens=max_graph_tokens,
                       speculative=SpecConfig(num_draft_tokens=MAX_K))  # sizes block tables for k <= MAX_K
    engine = LLMEngine(cfg)
    for n, p in adapters.items():
        engine.add_adapter(n, p)
    return engine


def engine_mode(engine, spec: SpecConfig | None, batch: int, names: list[str | None], gen: int, prompt_len: int,
                warm: bool = False):
    """Decode through LLMEngine.step(); `spec` None: plain multi-LoRA (or base-only when names are None).
    `warm`: the gate first serves one unmeasured window of the same mix, as a long-running server's
    gate has (it keeps pass times and per-adapter acceptance for the engine's lifetime)."""
    # One engine serves every mode so the model loads and the graphs are captured once; the mode is
    # the engine's speculation setting (None: plain steps), each with a fresh gate.
    engine.set_speculation(spec)
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(10, min(100000, engine.spec.vocab_size), (prompt_len,), generator=g).tolist()
               for _ in range(batch)]
    if warm and spec is not None:
        measure_decode(engine, prompts, names, gen, SamplingParams)
    before = engine.stats()
    out = measure_decode(engine, prompts, names, gen, SamplingParams)
    if spec is not None:
        out |= spec_delta(before, engine.stats())
    out["itl_ms_p50"] = out["step_ms_p50"]
    out["itl_ms_p99"] = out["step_ms_p99"]
    engine.set_speculation(None)
    return out


def hf_point(model_dir: str, adapter_dir: str | None, distinct: int, batch: int, gen: int, prompt_len: int,
             repeats: int) -> dict:
    """HF transformers (+ PEFT mixed-adapter batch) greedy decode tokens/s, prefill excluded: bench/hf_peer.py in a
    process of its own, as a user would run it (none of this process's engine state inside its timed window)."""
    cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_peer.py"), "--model", model_dir,
           "--distinct", str(distinct), "--batch", str(batch), "--gen", str(gen), "--prompt-len", str(prompt_len),
           "--repeats", str(repeats)] + (["--adapter", adapter_dir] if distinct else [])
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)  # its stderr goes to our log
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["llama-3.2-1b"])
    ap.add_argument("--ranks", nargs="+", type=int, default=[16, 64])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 128])
    ap.add_argument("--adapters", nargs="+", type=int, default=[0, 1, 8, 32, 128])
    ap.add_argument("--max-adapters-r64", type=int, default=32, help="cap on distinct rank-64 adapters (host memory)")
    ap.add_argument("--near-scale", type=float, default=0.02, help="adapter B scale for the speculative points")
    ap.add_argument("--vfar-scale", type=float, default=0.0,
                    help="also run speculative points on adapters at this B scale (0: skip), where plain should win")
    ap.add_argument("--mid-scales", nargs="*", type=float, default=[],
                    help="also run plain, forced and gated points on adapters at each of these B scales (between "
                         "the near and very far ones: acceptances where plain and drafting are close)")
    ap.add_argument("--slot-rank", type=int, default=None,
                    help="the slots' width (max_lora_rank and lora_slot_rank; default: each --ranks value, so the "
                         "adapters fill their slots); e.g. 64 for rank-16 adapters in rank-64 slots")
    ap.add_argument("--gen", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=1,
                    help="engine section: run every mode this many times (in rounds); report the median")
    ap.add_argument("--hf", action="store_true", help="also run HF transformers + PEFT as the peer")
    ap.add_argument("--peaked", action="store_true",
                    help="a base model with a peaked next-token distribution (see build_model_on_gpu)")
    ap.add_argument("--sections", nargs="+", default=["forward", "engine", "load"],
                    choices=["forward", "engine", "load"])
    ap.add_argument("--kernel-settings", type=json.loads, default={},
                    help='the Triton kernels\' launch settings that differ from the defaults, as JSON '
                         '(engine_ext.KernelSettings fields), e.g. \'{"attn_block_n": 64}\'')
    ap.add_argument("--workdir", default=os.environ.get("BENCH_DIR", tempfile.gettempdir()))
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (GPUs per engine)")
    ap.add_argument("--quantization", nargs="+", choices=["none", "fp8"], default=["none"],
                    help="the base weights' formats, each measured in turn in this run (EngineConfig.quantization)")
    ap.add_argument("--out")
    args = ap.parse_args()
    kernels = KernelSettings.from_dict(args.kernel_settings)
    results = {"machine": machine(), "command": " ".join(sys.argv), "hbm_bytes_per_s": HBM_BYTES_PER_S,
               "kernel_settings": asdict(kernels),
               "forward": [], "engine": [], "hf": [], "capture_s": {}}

    def dump():
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)

    for shape in args.shapes:
        t0 = time.perf_counter()
        model_dir = build_model_on_gpu(os.path.join(args.workdir, shape + ("-peaked" if args.peaked else "")), shape,
                                       residual_scale=0.001 if args.peaked else 1.0)
        print(f"[{shape}] model dir in {time.perf_counter() - t0:.0f} s", flush=True)
        for quant, rank in [(q, r) for q in args.quantization for r in args.ranks]:
            max_distinct = max(args.adapters) if rank <= 16 else min(max(args.adapters), args.max_adapters_r64)
            far = build_random_adapter(os.path.join(args.workdir, f"{shape}-r{rank}"), shape, rank, seed=rank)
            adapters = {f"a{i}": far for i in range(max_distinct)}
            if "engine" in args.sections:
                near = build_random_adapter(os.path.join(args.workdir, f"{shape}-r{rank}-near"), shape, rank,
                                            seed=rank, scale=args.near_scale)
                adapters |= {f"n{i}": near for i in range(32)}
                if args.vfar_scale:
                    vfar = build_random_adapter(os.path.join(args.workdir, f"{shape}-r{rank}-vfar"), shape, rank,
                                                seed=rank, scale=args.vfar_scale)
                    adapters |= {f"v{i}": vfar for i in range(32)}
                for j, scale in enumerate(args.mid_scales):
                    mid = build_random_adapter(os.path.join(args.workdir, f"{shape}-r{rank}-s{scale:g}"), shape, rank,
                                               seed=rank, scale=scale)
                    adapters |= {f"m{j}_{i}": mid for i in range(32)}
            t0 = time.perf_counter()
            engine = build_engine(model_dir, adapters, max_loras=max(max_distinct, 32),
                                  max_rank=max(rank, args.slot_rank or rank),
                                  max_graph_tokens=max(args.batches) * (MAX_K + 1), kernels=kernels, tp=args.tp,
                                  quantization=None if quant == "none" else quant)
            print(f"[{shape} r{rank} {quant}] engine up in {time.perf_counter() - t0:.0f} s", flush=True)
            try:
                run_shape_rank(engine, shape, rank, max_distinct, args, results, dump)
            except Exception as e:  # keep what was measured; the error goes into the JSON
                traceback.print_exc()
                results.setdefault("errors", []).append(f"{shape} r{rank}: {e!r}")
            dump()
            engine.close()  # a tensor-parallel engine's worker ranks hold their GPUs until stopped
            del engine
            gc.collect()  # the engine holds reference cycles: free its memory now, not inside the next measurement
            torch.cuda.empty_cache()
        if args.hf:
            try:
                run_hf(shape, model_dir, args, results)
            except Exception as e:
                traceback.print_exc()
                results.setdefault("errors", []).append(f"{shape} hf: {e!r}")
            dump()
    print(json.dumps(results, indent=1))
    dump()


def run_shape_rank(engine, shape, rank, max_distinct, args, results, dump) -> None:
    tag = dict(shape=shape, rank=rank, slot_rank=engine.config.max_lora_rank,
               quantization=engine.config.quantization or "none")
    if "load" in args.sections:
        results.setdefault("load", []).append(dict(tag, **cold_load(engine, args.workdir, shape, rank)))
        print(json.dumps(results["load"][-1]), flush=True)
    if "forward" in args.sections:
        forward_points(engine, tag, max_distinct, args, results)
        dump()
    if "engine" in args.sections:
        engine_points(engine, tag, max_distinct, args, results, dump)


def forward_points(engine, tag, max_distinct, args, results) -> None:
    shape, rank = tag["shape"], tag["rank"]
    # ---- forward level: the graphs, against the bytes model
    for batch in args.batches:
        for distinct in args.adapters:
            if distinct > min(batch, max_distinct) or (distinct == 0 and rank != args.ranks[0]):
                continue
            names = [f"a{i % distinct}" for i in range(batch)] if distinct else [None] * batch
            activate(engine, sorted({n for n in names if n}))
            point = forward_point(engine, names, 1, True, args.iters)
            if engine.runner.graphs.capture_seconds is not None and shape not in results["capture_s"]:
                results["capture_s"][shape] = {"seconds": engine.runner.graphs.capture_seconds,
                                               "graphs": len(engine.runner.graphs.graphs),
                                               "buckets": engine.runner.graphs.buckets}
            bm = bytes_model(engine, batch, distinct, rank, CONTEXT)
            rec = dict(tag, mode="base" if not distinct else "plain", batch=batch, adapters=distinct, tokens=batch,
                       **point, **bm, bw_fraction=bm["bytes_model_ms"] / point["gpu_ms"],
                       tokens_per_s_gpu=batch / point["gpu_ms"] * 1e3)
            results["forward"].append(rec)
            print(json.dumps({k: rec[k] for k in ("shape", "quantization", "rank", "mode", "batch", "adapters", "gpu_ms", "step_ms",
                                                  "bytes_model_ms", "bw_fraction")}), flush=True)
    # ---- forward level: verify passes (k+1 tokens a sequence, adapters on), one distinct adapter a sequence (up to
    # 32), at each batch; the plain step of the same batch and adapters is the "plain" point above
    for batch in args.batches:
        distinct = min(batch, max_distinct, 32)
        names = [f"a{i % distinct}" for i in range(batch)]
        activate(engine, sorted(set(names)))
        for k in range(1, MAX_K + 1):
            point = forward_point(engine, names, k + 1, True, args.iters)
            bm = bytes_model(engine, batch, distinct, rank, CONTEXT)
            results["forward"].append(dict(tag, mode=f"verify_k{k}", batch=batch, adapters=distinct,
                                           tokens=batch * (k + 1), **point, **bm,
                                           bw_fraction=bm["bytes_model_ms"] / point["gpu_ms"]))
            print(f"{tag['quantization']} batch {batch} verify k={k}: gpu {point['gpu_ms']:.3f} ms, step {point['step_ms']:.3f} ms",
                  flush=True)
    # ---- the floor under a verify pass: the same k+1 tokens a sequence through the base model alone (adapters off),
    # i.e. what attention and the products cost over k+1 queries before any LoRA work
    if 0 in args.adapters and rank == args.ranks[0]:
        for batch in args.batches:
            for k in range(1, MAX_K + 1):
                point = forward_point(engine, [None] * batch, k + 1, True, args.iters)
                results["forward"].append(dict(tag, mode=f"base_verify_k{k}", batch=batch, adapters=0,
                                               tokens=batch * (k + 1), **point))
                print(f"{tag['quantization']} batch {batch} base verify k={k}: gpu {point['gpu_ms']:.3f} ms", flush=True)


def engine_points(engine, tag, max_distinct, args, results, dump) -> None:
    """Engine level at batch 32: base / plain / speculative (gate off k=1..4, gate on k=4), for every adapter set
    (near, far, and the optional very far and middle scales), and the gate's check against the better of plain
    and forced speculation on the same set (`gate_check`)."""
    rank = tag["rank"]
    batch = 32 if 32 in args.batches else args.batches[0]
    distinct = min(batch, max_distinct, 32)
    names = [f"a{i % distinct}" for i in range(batch)]
    near = [f"n{i % distinct}" for i in range(batch)]
    gated = SpecConfig(num_draft_tokens=MAX_K, gate=True)
    forced = SpecConfig(num_draft_tokens=MAX_K, gate=False)
    modes = [("base", None, [None] * batch), ("plain", None, names), ("plain_near", None, near)]
    modes += [(f"spec_k{k}", SpecConfig(num_draft_tokens=k, gate=False), near) for k in range(1, MAX_K + 1)]
    modes += [(f"spec_k{MAX_K}_gate", gated, near), (f"spec_k{MAX_K}_gate_warm", gated, near),
              (f"spec_k{MAX_K}_gate_far", gated, names), (f"spec_k{MAX_K}_gate_far_warm", gated, names),
              (f"spec_k{MAX_K}_far", forced, names)]
    # each gated mode against the better of plain and forced drafting on its adapters (medians, and round by round)
    checks = {f"spec_k{MAX_K}_gate": ["plain_near"] + [f"spec_k{k}" for k in range(1, MAX_K + 1)],
              f"spec_k{MAX_K}_gate_far": ["plain", f"spec_k{MAX_K}_far"]}
    extra = [("vfar", "v")] if args.vfar_scale else []  # far enough from the base that plain should win
    extra += [(f"mid{j}", f"m{j}_") for j in range(len(args.mid_scales))]  # in between: the gate's hardest calls
    for label, prefix in extra:
        mix = [f"{prefix}{i % distinct}" for i in range(batch)]
        modes += [(f"plain_{label}", None, mix), (f"spec_k{MAX_K}_{label}", forced, mix),
                  (f"spec_k{MAX_K}_gate_{label}", gated, mix), (f"spec_k{MAX_K}_gate_{label}_warm", gated, mix)]
        checks[f"spec_k{MAX_K}_gate_{label}"] = [f"plain_{label}", f"spec_k{MAX_K}_{label}"]
    for mode in list(checks):
        checks[mode + "_warm"] = checks[mode]
    modes = [m for m in modes if m[0] != "base" or rank == args.ranks[0]]
    # --repeats: every mode's window again, in rounds (slow drift of the machine reaches every mode alike);
    # each mode reports the round with the median tokens/s (and every round's, tokens_per_s_runs). A gated
    # mode starts a fresh gate every round: a cold gate is cold in each.
    runs: dict[str, list[dict]] = {}
    for rnd in range(args.repeats):
        # a new order every round: a mode never always follows the same one (a heavy forced mode before a gated
        # one, say), so whatever the machine carries over from one window to the next reaches every mode alike
        for mode, spec, mode_names in random.Random(rnd).sample(modes, len(modes)):
            activate(engine, sorted({n for n in mode_names if n}))  # the scheduler admits one cold adapter a step
            out = engine_mode(engine, spec, batch, mode_names, args.gen, args.prompt_len,
                              warm=mode.endswith("_warm"))
            runs.setdefault(mode, []).append(out)
            print(json.dumps({"round": rnd} | {k: out.get(k) for k in ("tokens_per_s", "step_ms_p50", "acceptance",
                                                                       "gate_decisions", "cycle_passes", "gc_ms")}
                             | {"mode": mode}), flush=True)
    median = {}
    for mode, _, _ in modes:
        outs = sorted(runs[mode], key=lambda o: o["tokens_per_s"])
        out = outs[(len(outs) - 1) // 2]
        median[mode] = out["tokens_per_s"]
        rec = dict(tag, mode=mode, batch=batch, adapters=0 if mode == "base" else distinct, **out,
                   tokens_per_s_runs=[round(o["tokens_per_s"], 1) for o in runs[mode]])
        results["engine"].append(rec)
        dump()
        print(json.dumps({k: rec.get(k) for k in ("rank", "mode", "tokens_per_s", "tokens_per_s_runs", "step_ms_p50",
                                                  "step_ms_p99", "acceptance", "gate_decisions", "cycle_passes")}),
              flush=True)
    for mode, refs in checks.items():
        better = max(refs, key=median.get)
        rounds = [runs[mode][r]["tokens_per_s"] / max(runs[ref][r]["tokens_per_s"] for ref in refs) - 1
                  for r in range(args.repeats)]
        check = dict(tag, mode=mode, better=better, vs_better=median[mode] / median[better] - 1,
                     vs_better_rounds=[round(x, 4) for x in rounds], vs_better_rounds_median=statistics.median(rounds),
                     acceptance=statistics.median([o["acceptance"] or 0.0 for o in runs[mode]]))
        results.setdefault("gate_check", []).append(check)
        print(json.dumps(check), flush=True)
    dump()


def run_hf(shape, model_dir, args, results) -> None:
    batch = 32 if 32 in args.batches else args.batches[0]
    for rank in [None] + [r for r in args.ranks if r <= 16]:
        adapter_dir = None if rank is None else os.path.join(args.workdir, f"{shape}-r{rank}")
        distinct = 0 if rank is None else min(32, batch)
        t0 = time.perf_counter()
        # base: the engine's window, 3 times; PEFT: ~1 s a step at 1B, so 16 steps once
        out = hf_point(model_dir, adapter_dir, distinct, batch, args.gen if rank is None else min(args.gen, 16),
                       args.prompt_len, repeats=3 if rank is None else 1)
        rec = dict(out, shape=shape, rank=rank, wall_s=time.perf_counter() - t0)
        results["hf"].append(rec)
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
