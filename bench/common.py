"""Shared benchmark helpers: random-weight model and adapter directories written directly as
safetensors (fast at 1B+ shapes), and a decode-throughput measurement through the engine."""

from __future__ import annotations

import gc
import json
import os
import platform
import subprocess
import time

import torch
from safetensors.torch import save_file

SHAPES = {
    # name: (hidden, intermediate, layers, heads, kv_heads, vocab)
    "llama-3.2-1b": (2048, 8192, 16, 32, 8, 128256),
    "llama-3.1-8b": (4096, 14336, 32, 32, 8, 128256),
    "llama-3.1-70b": (8192, 28672, 80, 64, 8, 128256),  # 141 GB of bf16 weights: tensor-parallel only
    "tiny": (256, 688, 4, 8, 2, 4096),
}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_random_model(out_dir: str, shape: str, dtype=torch.bfloat16, seed: int = 0) -> str:
    if os.path.isfile(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    hidden, inter, layers, heads, kv, vocab = SHAPES[shape]
    head_dim = hidden // heads
    os.makedirs(out_dir, exist_ok=True)
    g = torch.Generator().manual_seed(seed)

    def w(*s, std=0.02):
        return (torch.randn(*s, generator=g) * std).to(dtype)

    t = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": torch.ones(hidden, dtype=dtype)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=dtype)
        t[p + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=dtype)
        t[p + "self_attn.q_proj.weight"] = w(heads * head_dim, hidden)
        t[p + "self_attn.k_proj.weight"] = w(kv * head_dim, hidden)
        t[p + "self_attn.v_proj.weight"] = w(kv * head_dim, hidden)
        t[p + "self_attn.o_proj.weight"] = w(hidden, heads * head_dim)
        t[p + "mlp.gate_proj.weight"] = w(inter, hidden)
        t[p + "mlp.up_proj.weight"] = w(inter, hidden)
        t[p + "mlp.down_proj.weight"] = w(hidden, inter)
    save_file(t, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=hidden,
                  intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv, vocab_size=vocab, rms_norm_eps=1e-5, max_position_embeddings=4096,
                  tie_word_embeddings=True, torch_dtype="bfloat16",
                  rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return out_dir


def build_random_adapter(out_dir: str, shape: str, rank: int, seed: int, scale: float = 1.0,
                         dtype=torch.bfloat16) -> str:
    """A PEFT-layout LoRA on all seven projections; `scale` controls its distance from the base."""
    hidden, inter, layers, heads, kv, _ = SHAPES[shape]
    head_dim = hidden // heads
    dims = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv * head_dim), "v_proj": (hidden, kv * head_dim),
            "o_proj": (heads * head_dim, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}
    os.makedirs(out_dir, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    t = {}
    for i in range(layers):
        for m, (fin, fout) in dims.items():
            parent = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            p = f"base_model.model.model.layers.{i}.{parent}.{m}"
            t[p + ".lora_A.weight"] = (torch.randn(rank, fin, generator=g) / fin**0.5).to(dtype)
            t[p + ".lora_B.weight"] = (torch.randn(fout, rank, generator=g) * 0.02 * scale).to(dtype)
    save_file(t, os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(PROJECTIONS),
                   "base_model_name_or_path": "random"}, f)
    return out_dir


def zero_logits_forward(vocab: int):
    """A stand-in for the model's forward: zero logits for the rows asked for (its 4th argument, the logits
    indices), returned at once, one tensor per row count made on first use, so that a step's time is its host
    work alone."""
    fixed: dict[int, torch.Tensor] = {}

    def forward(*a, **kw) -> torch.Tensor:
        n = a[3].shape[0]
        out = fixed.get(n)
        if out is None:
            out = fixed[n] = torch.zeros(n, vocab)
        return out

    return forward


def measure_decode(engine, prompts: list[list[int]], adapters: list[str | None], max_tokens: int, params_cls,
                   warmup_steps: int = 3) -> dict:
    """Decode throughput after the prefill: tokens/s and per-step (inter-token) latency percentiles."""
    params = params_cls(max_tokens=max_tokens, ignore_eos=True)
    for i, (p, a) in enumerate(zip(prompts, adapters)):
        engine.add_request(f"b{time.monotonic_ns()}-{i}", prompt_token_ids=p, sampling_params=params, adapter_name=a)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    for _ in range(1 + warmup_steps):  # prefill, then a few decode steps out of the timing
        engine.step()
    sync()
    step_times, tokens = [], 0
    collections = []  # the collector's passes inside the window: (generation, seconds)

    def on_gc(phase, info):
        if phase == "start":
            collections.append((info["generation"], time.perf_counter()))
        elif collections:
            gen, t0 = collections[-1]
            collections[-1] = (gen, time.perf_counter() - t0)

    gc.callbacks.append(on_gc)
    start = time.perf_counter()
    try:
        while engine.has_unfinished_requests:
            t0 = time.perf_counter()
            outs = engine.step()
            sync()
            step_times.append(time.perf_counter() - t0)
            tokens += sum(len(o.new_token_ids) for o in outs)
    finally:
        gc.callbacks.remove(on_gc)
    elapsed = time.perf_counter() - start
    return {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed if elapsed else None,
            "steps": len(step_times), "step_ms_p50": percentile(step_times, 0.5) * 1e3,
            "step_ms_p99": percentile(step_times, 0.99) * 1e3,
            "gc_passes": len(collections), "gc_ms": sum(t for _, t in collections) * 1e3,
            "gc_full_passes": sum(gen == 2 for gen, _ in collections)}


def spec_delta(before: dict, after: dict) -> dict:
    """Acceptance, drafted tokens, cycles (by drafting passes), plain steps, joins and gate decisions between two
    engine.stats() snapshots of a speculating engine ({} when speculation is off)."""
    if "speculative" not in after:
        return {}
    drafted = accepted = 0
    for name, a in after["adapters"].items():
        b = before.get("adapters", {}).get(name, {})
        drafted += (a.get("drafted_tokens") or 0) - (b.get("drafted_tokens") or 0)
        accepted += (a.get("accepted_tokens") or 0) - (b.get("accepted_tokens") or 0)
    sb, sa = before.get("speculative") or {}, after["speculative"]
    decisions = {k: v - (sb.get("gate_decisions") or {}).get(k, 0) for k, v in sa["gate_decisions"].items()}
    passes = {k: v - (sb.get("cycle_passes") or {}).get(k, 0) for k, v in sa["cycle_passes"].items()}
    return {"acceptance": accepted / drafted if drafted else None, "drafted_tokens": drafted,
            "cycles": sa["cycles"] - sb.get("cycles", 0), "plain_steps": sa["plain_steps"] - sb.get("plain_steps", 0),
            "cycle_passes": {str(k): v for k, v in sorted(passes.items()) if v},
            "joined": sa["joined"] - sb.get("joined", 0),
            "ridden_prompts": sa.get("ridden_prompts", 0) - sb.get("ridden_prompts", 0),
            "paced_prompts": sa.get("paced_prompts", 0) - sb.get("paced_prompts", 0),
            "gate_decisions": {k: v for k, v in decisions.items() if v}}


def percentile(values, q: float) -> float | None:
    """The nearest-rank q-quantile of `values` (None when empty)."""
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def machine() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    return f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores (torch {torch.__version__})"


def commit() -> str:
    """The checkout's short commit id (empty outside a git checkout): what a benchmark's JSON says it measured."""
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()


def replay_ms(graph, iters: int = 20) -> float:
    """GPU milliseconds of one replay of a captured CUDA graph (after one warm replay), timed with events."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def graph_ms(fn, iters: int = 20) -> float:
    """GPU milliseconds of one call of `fn`: run once (compiles), capture it in a CUDA graph, time replays."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return replay_ms(graph, iters)
