"""Device activity of an engine over a span of serving, recorded with torch.profiler where the engine's steps run: on a
GPU the CUDA kernels (copies and memsets left out), on a CPU the operators. An engine core in a process of its own
records them there (AsyncLLMEngine.start_profile / stop_profile): a profiler only sees the kernels its own process
launched.

The summary is what the benchmarks report: the union of the events' intervals (the time the device did anything),
the idle gaps between them by length, and the events with the most time."""

from __future__ import annotations

from typing import Any

__all__ = ["DeviceProfile", "kernel_union_seconds", "idle_gaps", "top_kernels", "summarize", "GAP_EDGES_US"]

GAP_EDGES_US = (5, 20, 100, 500, 2000)  # the idle-gap histogram's bucket edges


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


def summarize(events: list[tuple[str, int, int]], breakdown: bool = False) -> dict:
    """kernel_seconds (the union), kernels (how many), span_seconds (first start to last end); with `breakdown`
    also idle_gaps and top_kernels."""
    intervals = [(start, stop) for _, start, stop in events]
    out: dict[str, Any] = {"kernel_seconds": round(kernel_union_seconds(intervals), 6), "kernels": len(events),
                           "span_seconds": round((max(s for _, s in intervals) - min(s for s, _ in intervals)) / 1e9, 6)
                           if intervals else 0.0}
    if breakdown:
        out |= {"idle_gaps": idle_gaps(intervals), "top_kernels": top_kernels(events)}
    return out


def _events(prof, cuda: bool) -> list[tuple[str, int, int]]:
    """(name, start, end) in ns of the recorded kernels (kineto's raw events: building the Python function events
    of a long run would take longer than the run). On a CPU: the operators."""
    out = []
    for e in prof.profiler.kineto_results.events():
        if e.duration_ns() <= 0:
            continue
        if cuda:
            if e.device_type().name == "CUDA" and "Memcpy" not in e.name() and "Memset" not in e.name():
                out.append((e.name(), e.start_ns(), e.start_ns() + e.duration_ns()))
        elif e.device_type().name == "CPU":
            out.append((e.name(), e.start_ns(), e.start_ns() + e.duration_ns()))
    return out


class DeviceProfile:
    """One recording at a time: `start()`, then `stop()` -> its summary (`summarize`). CUDA kernels where CUDA is
    available, else the CPU operators (nested ones overlap their parents: the union counts each moment once)."""

    def __init__(self) -> None:
        self._prof = None
        self._cuda = False
        self._breakdown = False

    @property
    def running(self) -> bool:
        return self._prof is not None

    def start(self, breakdown: bool = False) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        if self._prof is not None:
            raise ValueError("a profile is already being recorded: stop it first")
        self._cuda = torch.cuda.is_available()
        self._breakdown = breakdown
        prof = profile(activities=[ProfilerActivity.CUDA if self._cuda else ProfilerActivity.CPU])
        prof.__enter__()
        self._prof = prof

    def stop(self) -> dict:
        if self._prof is None:
            raise ValueError("no profile is being recorded: start one first")
        prof, self._prof = self._prof, None
        if self._cuda:
            import torch

            torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        events = _events(prof, self._cuda)
        return {"device": "cuda" if self._cuda else "cpu"} | summarize(events, self._breakdown)
