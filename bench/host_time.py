"""Host time of an engine step at a full batch on the CPU: the step's wall time less its model forwards', per mode
(plain, forced k, gated k), with a tiny random model so the forwards stay short. This is the host work of a step
(scheduling, the gate's planning, packing and queuing its forwards, reading the step before: committing, stops,
outputs), which the device's step must cover for the device never to wait. Also the interpreter's garbage collections during
the measured steps (count and milliseconds per generation), the slowest step, and what one full collection costs
after them (the pause the engine thread takes whenever the interpreter runs one: rare, but it stalls every stream);
`--gc freeze` first collects and freezes the start-up heap, as an LLM replica does once ready (AppConfig.gc_freeze).
`--stub-forward` replaces the model's forward with one that returns fixed logits at once, so a step's time is its host
work alone (the CPU's element-wise ops outside the forward included), and `--base-only` sends no adapter requests.
Prints one JSON object per mode.

    python bench/host_time.py --batch 128 --modes plain forced gated
    python bench/host_time.py --modes forced --gc default freeze
    python bench/host_time.py --modes plain --gc freeze --stub-forward [--base-only] [--prompt-len 1000]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "engine_ext"))

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--prompt-len", type=int, default=16, help="tokens of each prompt (the context the step carries)")
    ap.add_argument("--modes", nargs="+", default=["plain", "forced", "gated"], choices=["plain", "forced", "gated"])
    ap.add_argument("--gc", nargs="+", default=["default"], choices=["default", "freeze"])
    ap.add_argument("--stub-forward", action="store_true", help="fixed logits instead of the model's forward")
    ap.add_argument("--base-only", action="store_true", help="every request base-only")
    args = ap.parse_args()

    import torch

    from bench.common import zero_logits_forward
    from engine_ext import EngineConfig, LLMEngine, SamplingParams, SpecConfig
    from tiny_models import build_adapter, build_model

    torch.set_num_threads(1)
    work = tempfile.mkdtemp()
    max_len = args.prompt_len + 1024
    model = build_model("llama", os.path.join(work, "m"), max_position_embeddings=max_len)
    adapters = {f"a{i}": build_adapter(model, os.path.join(work, f"a{i}"), seed=i, r=8, target_modules=ALL, std=0.0)
                for i in range(args.adapters)}  # std 0: every draft is accepted, every cycle runs k passes
    names = [None] if args.base_only else list(adapters) + [None, None]
    collections: dict[int, list] = {}
    began: list[float] = []

    def on_gc(phase, info):  # every collection's duration, by generation
        if phase == "start":
            began.append(time.perf_counter())
        elif began:
            entry = collections.setdefault(info["generation"], [0, 0.0])
            entry[0] += 1
            entry[1] += time.perf_counter() - began.pop()

    gc.callbacks.append(on_gc)
    for mode, collector in [(m, c) for c in args.gc for m in args.modes]:
        engine = LLMEngine(EngineConfig(model=model, speculative=SpecConfig(num_draft_tokens=args.k), block_size=16,
                                        num_kv_blocks=args.batch * -(-max_len // 16) + 64, max_loras=args.adapters,
                                        max_num_seqs=args.batch, max_model_len=max_len))
        for n, p in adapters.items():
            engine.add_adapter(n, p)
        engine.set_speculation(None if mode == "plain" else SpecConfig(num_draft_tokens=args.k, gate=mode == "gated"))
        for i in range(args.batch):
            engine.add_request(f"r{i}", prompt_token_ids=[(i * 7 + j) % 200 + 1 for j in range(args.prompt_len)],
                               sampling_params=SamplingParams(max_tokens=900, ignore_eos=True),
                               adapter_name=names[i % len(names)])
        forward = [0.0]
        run = engine.runner.model.forward

        stub = zero_logits_forward(engine.runner.spec.vocab_size)

        def timed(*a, **kw):
            start = time.perf_counter()
            out = (stub if args.stub_forward else run)(*a, **kw)
            forward[0] += time.perf_counter() - start
            return out

        engine.runner.model.forward = timed
        for i in range(10**6):  # every prompt in (long ones take several steps), and the gate's first measurements
            if i >= 8 and len(engine.scheduler.running) == args.batch and not engine.scheduler.waiting:
                break
            engine.step()
        if collector == "freeze":
            gc.collect()
            gc.freeze()
        collections.clear()
        slowest = 0.0
        forward[0], tokens0 = 0.0, engine.stats()["base"]["tokens"] + sum(
            a["tokens"] for a in engine.stats()["adapters"].values())
        start = time.perf_counter()
        for _ in range(args.steps):
            step_start = time.perf_counter()
            engine.step()
            slowest = max(slowest, time.perf_counter() - step_start)
        seconds = time.perf_counter() - start
        during = {g: {"count": c, "ms": round(t * 1e3, 1)} for g, (c, t) in sorted(collections.items())}
        full = time.perf_counter()
        gc.collect()
        full = time.perf_counter() - full
        stats = engine.stats()
        tokens = stats["base"]["tokens"] + sum(a["tokens"] for a in stats["adapters"].values()) - tokens0
        spec = stats.get("speculative") or {}
        print(json.dumps({"mode": mode, "gc": collector, "tracked_objects": len(gc.get_objects()),
                          "batch": args.batch, "steps": args.steps,
                          "host_ms_per_step": round((seconds - forward[0]) / args.steps * 1e3, 2),
                          "forward_ms_per_step": round(forward[0] / args.steps * 1e3, 2),
                          "host_us_per_token": round((seconds - forward[0]) / tokens * 1e6, 2),
                          "slowest_step_ms": round(slowest * 1e3, 1), "full_collection_ms": round(full * 1e3, 1),
                          "collections": during,
                          "cycle_passes": spec.get("cycle_passes"), "gate_decisions": spec.get("gate_decisions")}),
              flush=True)
        del engine, run, timed
        gc.unfreeze()
        gc.collect()


if __name__ == "__main__":
    main()
