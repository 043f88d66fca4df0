"""Host cost of the served loop: AsyncLLMEngine (what an LLM replica runs) streaming `--batch` requests at once to
asyncio consumers, on the CPU with a tiny random model whose forward is stubbed (fixed logits, at once), so every
second is host work: the engine thread's steps and handing their outputs to the event loop, and the loop's consumers.
Prints one JSON object per run: tokens per second through the streams, the engine thread's milliseconds per step
(whole `step()` calls, and handing their outputs to the loop), the event loop's wakeups from the engine thread per
step (each request's admission included), and the chunks each stream handed out (fewer than its tokens when it fell
behind the engine: the outputs it missed come as one).

`--tree DIR` imports the engine of another checkout (e.g. an earlier commit unpacked with `git archive`), so an A/B
runs the same script over both:

    python bench/async_host.py --batch 128 --runs 3
    mkdir -p .ab/old && git archive HEAD~1 engine_ext | tar -x -C .ab/old
    python bench/async_host.py --tree .ab/old --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=128, help="requests streamed at once (max_num_seqs)")
    ap.add_argument("--tokens", type=int, default=200, help="tokens each request generates")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tree", default=None, help="a checkout whose engine_ext to import (default: this one)")
    args = ap.parse_args()
    tree = os.path.abspath(args.tree or HERE)
    sys.path[:0] = [tree, os.path.join(HERE, "tests", "engine_ext")]

    import torch

    from engine_ext import AsyncLLMEngine, EngineConfig, LLMEngine, SamplingParams
    from tiny_models import build_model

    torch.set_num_threads(1)
    model = build_model("llama", os.path.join(tempfile.mkdtemp(), "m"))
    for run in range(args.runs):
        engine = LLMEngine(EngineConfig(model=model, block_size=16, num_kv_blocks=args.batch * 16 + 64,
                                        max_num_seqs=args.batch, max_model_len=args.tokens + 64))
        vocab, fixed = engine.runner.spec.vocab_size, {}
        # the logits rows asked for (a[3]: the logits indices), zeros: the step's time is its host work
        engine.runner.model.forward = lambda *a, **kw: fixed.setdefault(a[3].shape[0], torch.zeros(a[3].shape[0], vocab))
        spent = {"step": 0.0, "deliver": 0.0, "steps": 0, "wakeups": 0, "chunks": 0}
        step = engine.step

        def timed_step(*a, **kw):
            start = time.perf_counter()
            try:
                return step(*a, **kw)
            finally:
                spent["step"] += time.perf_counter() - start
                spent["steps"] += 1

        engine.step = timed_step
        served = AsyncLLMEngine(engine.config, engine)
        deliver = served._publish

        def timed_publish(outs):
            start = time.perf_counter()
            try:
                return deliver(outs)
            finally:
                spent["deliver"] += time.perf_counter() - start

        served._publish = timed_publish
        served._context.publish = timed_publish
        params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)

        async def consume(i: int) -> int:
            n = 0
            async for out in served.generate(prompt_token_ids=[(i * 7 + j) % 200 + 1 for j in range(16)],
                                              sampling_params=params, request_id=f"r{i}"):
                n += len(out.new_token_ids)
                spent["chunks"] += 1
            return n

        async def serve() -> tuple[int, float]:
            loop = asyncio.get_running_loop()
            call = loop.call_soon_threadsafe

            def counted(*a, **kw):  # every wakeup of the loop from the engine thread
                spent["wakeups"] += 1
                return call(*a, **kw)

            loop.call_soon_threadsafe = counted
            start = time.perf_counter()
            tokens = sum(await asyncio.gather(*(consume(i) for i in range(args.batch))))
            return tokens, time.perf_counter() - start

        gc.collect()
        tokens, seconds = asyncio.run(serve())
        served.shutdown()
        steps = max(1, spent["steps"])
        print(json.dumps({"tree": tree, "run": run, "batch": args.batch, "tokens": tokens,
                          "tokens_per_s": round(tokens / seconds), "steps": spent["steps"],
                          "engine_ms_per_step": round(spent["step"] / steps * 1e3, 3),
                          "deliver_ms_per_step": round(spent["deliver"] / steps * 1e3, 3),
                          "wakeups_per_step": round(spent["wakeups"] / steps, 2),
                          "chunks_per_request": round(spent["chunks"] / args.batch, 1)}), flush=True)


if __name__ == "__main__":
    main()
