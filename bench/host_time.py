"""Host time of an engine step at a full batch on the CPU: the step's wall time less its forwards' (ModelRunner.run),
per mode (plain, forced k, gated k), with a tiny random model so the forwards stay short. This is the time a GPU
waits for the host between a cycle's sync and its next pass (settling, emitting, scheduling, the gate's planning)
plus the packing that a GPU overlaps with the passes before it. Prints one JSON object per mode.

    python bench/host_time.py --batch 128 --modes plain forced gated
"""

from __future__ import annotations

import argparse
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
    ap.add_argument("--modes", nargs="+", default=["plain", "forced", "gated"], choices=["plain", "forced", "gated"])
    args = ap.parse_args()

    import torch

    from engine_ext import EngineConfig, LLMEngine, SamplingParams, SpecConfig
    from tiny_models import build_adapter, build_model

    torch.set_num_threads(1)
    work = tempfile.mkdtemp()
    model = build_model("llama", os.path.join(work, "m"), max_position_embeddings=1024)
    adapters = {f"a{i}": build_adapter(model, os.path.join(work, f"a{i}"), seed=i, r=8, target_modules=ALL, std=0.0)
                for i in range(args.adapters)}  # std 0: every draft is accepted, every cycle runs k passes
    names = list(adapters) + [None, None]
    for mode in args.modes:
        engine = LLMEngine(EngineConfig(model=model, speculative=SpecConfig(num_draft_tokens=args.k), block_size=16,
                                        num_kv_blocks=8192, max_loras=args.adapters, max_num_seqs=args.batch,
                                        max_model_len=1024))
        for n, p in adapters.items():
            engine.add_adapter(n, p)
        engine.set_speculation(None if mode == "plain" else SpecConfig(num_draft_tokens=args.k, gate=mode == "gated"))
        for i in range(args.batch):
            engine.add_request(f"r{i}", prompt_token_ids=[(i * 7 + j) % 200 + 1 for j in range(16)],
                               sampling_params=SamplingParams(max_tokens=900, ignore_eos=True),
                               adapter_name=names[i % len(names)])
        forward = [0.0]
        run = engine.runner.run

        def timed(*a, **kw):
            start = time.perf_counter()
            out = run(*a, **kw)
            forward[0] += time.perf_counter() - start
            return out

        engine.runner.run = timed
        for _ in range(8):  # prompts and the gate's first measurements
            engine.step()
        forward[0], tokens0 = 0.0, engine.stats()["base"]["tokens"] + sum(
            a["tokens"] for a in engine.stats()["adapters"].values())
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        seconds = time.perf_counter() - start
        stats = engine.stats()
        tokens = stats["base"]["tokens"] + sum(a["tokens"] for a in stats["adapters"].values()) - tokens0
        spec = stats.get("speculative") or {}
        print(json.dumps({"mode": mode, "batch": args.batch, "steps": args.steps,
                          "host_ms_per_step": round((seconds - forward[0]) / args.steps * 1e3, 2),
                          "forward_ms_per_step": round(forward[0] / args.steps * 1e3, 2),
                          "host_us_per_token": round((seconds - forward[0]) / tokens * 1e6, 2),
                          "cycle_passes": spec.get("cycle_passes"), "gate_decisions": spec.get("gate_decisions")}),
              flush=True)


if __name__ == "__main__":
    main()
