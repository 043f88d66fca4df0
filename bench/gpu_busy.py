"""GPU busy time of open-loop serving: bench/serve_load.py's runs with torch.profiler recording every CUDA kernel,
and per run the union of the kernel intervals over the run's wall time (the fraction of the makespan the GPU was
doing anything), beside serve_load's tokens/s, TTFT and TPOT, and the engine's host time per step (the step's wall
time less what it spent waiting for the device, when the engine reports it).

`--tree DIR` runs the serve_load.py (and engine) of another checkout of this repository, e.g. an earlier commit
unpacked beside this one (`git archive <commit> | tar -x -C DIR`), so both are measured in one call on the same
machine: its code is imported from DIR, only the profiling around its runs comes from here.

    python bench/gpu_busy.py --out busy.json -- --shape llama-3.2-1b --modes base plain gated forced --runs burst burst
    python bench/gpu_busy.py --tree .ab/d515d84 --out busy-old.json -- --shape llama-3.2-1b --runs burst burst

Everything after `--` goes to serve_load.py. Prints one JSON object (serve_load's, each measured run with `busy`
added)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def kernel_union_seconds(intervals: list[tuple[int, int]]) -> float:
    """Total length of the union of [start, end) intervals in nanoseconds, in seconds."""
    total, end = 0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total / 1e9


GAP_EDGES_US = (5, 20, 100, 500, 2000)  # the idle-gap histogram's bucket edges


def idle_gaps(intervals: list[tuple[int, int]]) -> dict:
    """The device's idle gaps between the union's segments: per bucket of GAP_EDGES_US (the label is its upper
    edge, "inf" past the last) the count and total ms. Where a run's idle time goes: many short gaps are launch
    latency between kernels, long ones the device waiting for the host."""
    edges = [*GAP_EDGES_US, float("inf")]
    out = {str(e): {"count": 0, "ms": 0.0} for e in edges}
    end = None
    for start, stop in sorted(intervals):
        if end is not None and start > end:
            gap_us = (start - end) / 1e3
            bucket = out[str(next(e for e in edges if gap_us <= e))]
            bucket["count"] += 1
            bucket["ms"] += gap_us / 1e3
        end = stop if end is None else max(end, stop)
    return {k: {"count": v["count"], "ms": round(v["ms"], 3)} for k, v in out.items()}


def top_kernels(events: list[tuple[str, int, int]], n: int = 25) -> list[dict]:
    """The n kernels with the most device time: name (cut to 80 characters), count, total and mean us."""
    totals: dict[str, list[int]] = {}
    for name, start, stop in events:
        t = totals.setdefault(name[:80], [0, 0])
        t[0] += 1
        t[1] += stop - start
    rows = sorted(totals.items(), key=lambda kv: -kv[1][1])[:n]
    return [{"kernel": k, "count": c, "ms": round(ns / 1e6, 3), "mean_us": round(ns / c / 1e3, 2)}
            for k, (c, ns) in rows]


def _kernels(prof) -> list[tuple[str, int, int]]:
    """(name, start, end) in ns of every CUDA kernel the profiler recorded (kineto's raw events: building the Python
    function events of a long run would take longer than the run)."""
    out = []
    for e in prof.profiler.kineto_results.events():
        if e.device_type().name == "CUDA" and e.duration_ns() > 0 and "Memcpy" not in e.name() \
                and "Memset" not in e.name():
            out.append((e.name(), e.start_ns(), e.start_ns() + e.duration_ns()))
    return out


def profiled(replay, every: int, breakdown: bool = False):
    """serve_load.replay, measured when it replays a measured run (warm-up requests' ids start with "w"): its wall
    time, steps and the engine's host time per step; every `every`-th measured run also under torch.profiler (CUDA
    kernels only), for the busy fraction. Profiling slows the host (a callback per launch), so a throughput is read
    from the runs not profiled. The first measured run first freezes the start-up heap, as an LLM replica does once
    ready (deployments: AppConfig.gc_freeze), so that no full collection walks it during the runs."""
    import gc

    import torch
    from torch.profiler import ProfilerActivity, profile

    results: list[dict] = []

    def run(engine, requests, *args, **kwargs):
        if not requests or requests[0].request_id.startswith("w") or not torch.cuda.is_available():
            return replay(engine, requests, *args, **kwargs)
        if not results:
            gc.collect()
            gc.freeze()
        torch.cuda.synchronize()
        before = engine.stats()
        profiling = (len(results) + 1) % every == 0
        prof = profile(activities=[ProfilerActivity.CUDA]) if profiling else None
        if prof is not None:
            prof.__enter__()
        start = time.perf_counter()
        records = replay(engine, requests, *args, **kwargs)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        if prof is not None:
            prof.__exit__(None, None, None)
        after = engine.stats()
        steps = max(1, after["num_steps"] - before["num_steps"])
        tokens = sum(len(r.token_ids) for r in records)
        row = {"profiled": profiling, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
               "steps": steps, "ms_per_step": round(seconds / steps * 1e3, 3)}
        if "device_wait_s" in after:  # the host's own time per step: the rest is waiting for the device
            wait = after["device_wait_s"] - before["device_wait_s"]
            row["host_ms_per_step"] = round((seconds - wait) / steps * 1e3, 3)
        if prof is not None:
            events = _kernels(prof)
            kernels = [(start, stop) for _, start, stop in events]
            busy = kernel_union_seconds(kernels)
            row |= {"busy_fraction": round(busy / seconds, 3), "kernel_seconds": round(busy, 3),
                    "kernels": len(kernels)}
            if breakdown:
                row |= {"idle_gaps": idle_gaps(kernels), "top_kernels": top_kernels(events)}
        results.append(row)
        return records

    return run, results


def main() -> None:
    argv = sys.argv[1:]
    rest = argv[argv.index("--") + 1 :] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", default=None, help="a checkout whose serve_load.py and engine to run (default: this)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile-every", type=int, default=2,
                    help="profile every n-th measured run (give serve_load each run twice: --runs burst burst)")
    ap.add_argument("--breakdown", action="store_true",
                    help="also the profiled runs' idle-gap histogram and the kernels with the most device time")
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    tree = os.path.abspath(args.tree or os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, tree)
    for name in [m for m in sys.modules if m == "bench" or m.startswith(("bench.", "engine_ext"))]:
        del sys.modules[name]
    import bench.serve_load as serve_load

    serve_load.replay, busy = profiled(serve_load.replay, args.profile_every, args.breakdown)
    out_path = args.out or os.path.join(os.environ.get("BENCH_DIR", "/tmp"), "gpu-busy-serve-load.json")
    sys.argv = ["serve_load.py", *rest, "--out", out_path]
    stdout = sys.stdout
    sys.stdout = open(os.devnull, "w")  # serve_load prints its JSON; ours, with busy added, follows
    try:
        serve_load.main()
    finally:
        sys.stdout.close()
        sys.stdout = stdout
    with open(out_path) as f:
        result = json.load(f)
    measured = [r for r in result["runs"] if "crash" not in r]
    for run, b in zip(measured, busy):
        run["busy"] = b
        print("busy", json.dumps({"tree": tree, "mode": run["mode"], "run": run["run"], **b}), file=sys.stderr)
    result["tree"] = tree
    text = json.dumps(result, indent=1)
    with open(out_path, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
