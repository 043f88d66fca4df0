"""Host cost of the served loop, with the model's forward stubbed (fixed logits, at once) so every second is host
work: `--batch` requests of `--tokens` tokens each streamed at once through AsyncLLMEngine to consumers that do
what an LLM replica does with every chunk (a real `LLMServer.generate`, each of its chunk dicts pickled as Serve
hands it to Ray), with the engine core per mode:

  bare     LLMEngine.step in a plain loop, nothing else on the interpreter: the core's own host time
  thread   the core on a thread of the consumers' process (EngineConfig.engine_process False)
  process  the core in a process of its own (engine_process True), as `serve run deployments.app` runs it

The modes alternate within each run. Prints one JSON object per measurement (tokens per second through the
streams; the core's milliseconds per step: its `step()` calls and publishing their outputs; chunks each stream
handed out, fewer than its tokens when the consumers fell behind and took what they missed as one), then one
summary: per mode the medians, process against thread, the core's step time against the bare loop's, and the load
average over the run.

    python bench/async_host.py --modes bare thread process --runs 5
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import pickle
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("bare", "thread", "process")


def stubbed_engine(config):
    """The core's engine, its forward returning zero logits for the rows asked for (a[3]: the logits indices):
    the factory a core process imports by name (AsyncLLMEngine's engine_factory)."""
    from bench.common import zero_logits_forward
    from engine_ext import LLMEngine

    engine = LLMEngine(config, detokenize=False)
    engine.runner.model.forward = zero_logits_forward(engine.runner.spec.vocab_size)
    return engine


def prompt(i: int) -> list[int]:
    return [(i * 7 + j) % 200 + 1 for j in range(16)]


def run_bare(engine, args) -> dict:
    from engine_ext import SamplingParams

    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    gc.collect()
    start = time.perf_counter()
    for i in range(args.batch):
        engine.add_request(f"r{i}", prompt_token_ids=prompt(i), sampling_params=params)
    steps, step_s, tokens = 0, 0.0, 0
    while engine.has_unfinished_requests:
        began = time.perf_counter()
        outs = engine.step()
        step_s += time.perf_counter() - began
        steps += 1
        tokens += sum(len(o.new_token_ids) for o in outs)
    seconds = time.perf_counter() - start
    return {"tokens": tokens, "tokens_per_s": round(tokens / seconds), "steps": steps,
            "core_ms_per_step": round(step_s / steps * 1e3, 3)}


def replica(engine):
    """A real LLMServer over `engine`, as an LLM replica holds it (no registry: base-model requests only)."""
    from deployments.config import AppConfig
    from deployments.replica.llm_server import LLMServer

    return LLMServer(AppConfig(), engine, registry=None, replica_id="bench")


async def serve(server, args) -> tuple[int, int, float]:
    """Every request through server.generate at once, each chunk pickled -> (tokens, chunks, seconds)."""
    from deployments.data_plane.protocol import GenerateRequest

    counts = {"chunks": 0}

    async def consume(i: int) -> int:
        req = GenerateRequest(f"r{i}", None, {"max_tokens": args.tokens, "ignore_eos": True},
                              prompt_token_ids=prompt(i))
        n = 0
        async for chunk in server.generate(req):
            pickle.dumps(chunk)  # what Serve's streaming does with each item the replica yields
            if chunk["type"] == "delta":
                n += chunk["num_tokens"]
                counts["chunks"] += 1
            elif chunk["type"] == "error":
                raise RuntimeError(chunk["message"])
        return n

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(consume(i) for i in range(args.batch))))
    return tokens, counts["chunks"], time.perf_counter() - start


def run_served(engine, args) -> dict:
    before = engine.stats()["core"]
    gc.collect()
    tokens, chunks, seconds = asyncio.run(serve(replica(engine), args))
    core = engine.stats()["core"]
    steps = max(1, core["steps"] - before["steps"])
    publish = core["publish_s"] - before["publish_s"]
    busy = core["step_s"] - before["step_s"] + publish
    return {"tokens": tokens, "tokens_per_s": round(tokens / seconds), "steps": steps,
            "core_ms_per_step": round(busy / steps * 1e3, 3), "publish_ms_per_step": round(publish / steps * 1e3, 3),
            "chunks_per_request": round(chunks / args.batch, 1)}


def summary(results: list[dict], load: tuple[float, float]) -> dict:
    out = {"summary": True, "load_avg_1m": {"start": load[0], "end": load[1]}}
    for mode in MODES:
        rows = [r for r in results if r["mode"] == mode]
        if rows:
            out[mode] = {k: statistics.median(r[k] for r in rows) for k in ("tokens_per_s", "core_ms_per_step")}
    if "thread" in out and "process" in out:
        out["process_over_thread_tokens_per_s"] = round(out["process"]["tokens_per_s"] /
                                                        out["thread"]["tokens_per_s"], 2)
    if "bare" in out:
        for mode in ("thread", "process"):
            if mode in out:
                out[f"{mode}_core_step_over_bare"] = round(out[mode]["core_ms_per_step"] /
                                                           out["bare"]["core_ms_per_step"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=128, help="requests streamed at once (max_num_seqs)")
    ap.add_argument("--tokens", type=int, default=200, help="tokens each request generates")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = ap.parse_args()
    sys.path[:0] = [HERE, os.path.join(HERE, "tests", "engine_ext"), os.path.dirname(os.path.abspath(__file__))]

    import torch

    from engine_ext import AsyncLLMEngine, EngineConfig
    from tiny_models import build_model

    torch.set_num_threads(1)  # and so the core process's (it takes its client's)
    model = build_model("llama", os.path.join(tempfile.mkdtemp(), "m"))

    def config(process: bool):
        return EngineConfig(model=model, block_size=16, num_kv_blocks=args.batch * 16 + 64, max_num_seqs=args.batch,
                            max_model_len=args.tokens + 64, engine_process=process)

    factory = f"{os.path.splitext(os.path.basename(__file__))[0]}:stubbed_engine"
    engines = {"thread": lambda: AsyncLLMEngine(config(False), stubbed_engine(config(False))),
               "process": lambda: AsyncLLMEngine(config(True), engine_factory=factory)}
    served = {mode: engines[mode]() for mode in args.modes if mode != "bare"}
    bare = stubbed_engine(config(False)) if "bare" in args.modes else None
    gc.collect()
    gc.freeze()  # as a replica does once ready (AppConfig.gc_freeze); a core process does it itself
    load, results = os.getloadavg()[0], []
    try:
        for run in range(args.runs):
            for mode in args.modes:
                row = run_bare(bare, args) if mode == "bare" else run_served(served[mode], args)
                row = {"mode": mode, "run": run, "batch": args.batch} | row
                results.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for engine in served.values():
            engine.shutdown()
    print(json.dumps(summary(results, (load, os.getloadavg()[0]))), flush=True)


if __name__ == "__main__":
    main()
