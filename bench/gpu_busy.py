"""GPU busy time of open-loop serving: bench/serve_load.py's runs with torch.profiler recording every CUDA kernel,
and per run the union of the kernel intervals over the run's wall time (the fraction of the makespan the GPU was
doing anything), beside serve_load's tokens/s, TTFT and TPOT, and the engine's host time per step (the step's wall
time less what it spent waiting for the device, when the engine reports it).

`--tree DIR` runs the serve_load.py (and engine) of another checkout of this repository, e.g. an earlier commit
unpacked beside this one (`git archive <commit> | tar -x -C DIR`), so both are measured in one call on the same
machine: its code is imported from DIR, only the profiling around its runs comes from here.

    python bench/gpu_busy.py --out busy.json -- --shape llama-3.2-1b --modes base plain gated forced --runs burst burst
    python bench/gpu_busy.py --tree .ab/d515d84 --out busy-old.json -- --shape llama-3.2-1b --runs burst burst
    python bench/gpu_busy.py --out busy-core.json -- --loop core --modes base plain gated --runs burst burst

With `--loop core` the engine core runs in a process of its own, as an LLM replica runs it, and records its kernels
there (AsyncLLMEngine.start_profile); `--loop served` is the same client with the core on a thread of this process.

Everything after `--` goes to serve_load.py. Prints one JSON object (serve_load's, each measured run with `busy`
added)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

# The profiling code of this checkout, loaded by its path: `--tree` swaps the engine_ext package for another's
_spec = importlib.util.spec_from_file_location(
    "_gpu_busy_profiling", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "engine_ext",
                                        "profiling.py"))
device_profiling = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(device_profiling)


def profiled(replay, every: int, breakdown: bool = False):
    """serve_load.replay, measured when it replays a measured run (warm-up requests' ids start with "w"): its wall
    time, steps and the engine's host time per step; every `every`-th measured run also under torch.profiler (CUDA
    kernels only), for the busy fraction. Profiling slows the host (a callback per launch), so a throughput is read
    from the runs not profiled. The first measured run first freezes the start-up heap, as an LLM replica does once
    ready (deployments: AppConfig.gc_freeze), so that no full collection walks it during the runs.

    An engine core in a process of its own (serve_load --loop core: `engine` is its AsyncLLMEngine) is profiled
    where it runs (AsyncLLMEngine.start_profile): a profiler here would see none of its kernels."""
    import gc

    import torch

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
        remote = hasattr(engine, "start_profile")  # an engine core process: it launches the kernels, it records them
        local = None if remote or not profiling else device_profiling.DeviceProfile()
        if profiling:
            (engine.start_profile if remote else local.start)(breakdown)
        start = time.perf_counter()
        records = replay(engine, requests, *args, **kwargs)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        summary = None if not profiling else engine.stop_profile() if remote else local.stop()
        after = engine.stats()
        steps = max(1, after["num_steps"] - before["num_steps"])
        tokens = sum(len(r.token_ids) for r in records)
        row = {"profiled": profiling, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
               "steps": steps, "ms_per_step": round(seconds / steps * 1e3, 3), "core_process": remote}
        if "device_wait_s" in after:  # the host's own time per step: the rest is waiting for the device
            wait = after["device_wait_s"] - before["device_wait_s"]
            row["host_ms_per_step"] = round((seconds - wait) / steps * 1e3, 3)
        if summary is not None:
            busy = summary.pop("kernel_seconds")
            summary.pop("device", None)
            row |= {"busy_fraction": round(busy / seconds, 3), "kernel_seconds": round(busy, 3), **summary}
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
