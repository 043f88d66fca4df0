"""A/B of the Triton kernels' launch settings judged in the whole decode forward (bench/decode.py's forward
section: CUDA-graph replays of the real model, so weights, adapters and KV caches stream from HBM as they do
in serving, unlike the kernel sweeps, whose working sets can sit in L2). Each variant is a JSON object of
engine_ext.KernelSettings fields that differ from the defaults, run in its own process
(`decode.py --kernel-settings`). Prints one JSON line per variant and the winner: the variant with the
lowest plain step (batch 32, 32 rank-16 adapters) if it beats the default by more than `--margin`; with
two or more such variants, their combination is tried too. Writes the winner's settings to `--settings-out`
as JSON, for the steps after it.

    python bench/forward_ab.py --out-dir /tmp/ab --settings-out /tmp/ab/best.json \\
        '{}' '{"shrink_warps": 4}' '{"silu_lora_warps": 4, "norm_chunk": 256}'
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from engine_ext import KernelSettings  # noqa: E402


def parse(variant: str) -> dict:
    try:
        settings = json.loads(variant or "{}")
        KernelSettings.from_dict(settings)  # refused here rather than in the subprocess
    except (ValueError, TypeError) as e:
        raise SystemExit(f"a variant is a JSON object of KernelSettings fields, got {variant!r}: {e}") from None
    return settings


def run(settings: dict, out_dir: str, timeout: int) -> dict | None:
    tag = "_".join(f"{k}-{v}" for k, v in sorted(settings.items())) or "default"
    out = os.path.join(out_dir, f"ab_{tag}.json")
    cmd = [sys.executable, os.path.join(HERE, "decode.py"), "--ranks", "16", "--batches", "32", "--adapters", "32",
           "--sections", "forward", "--kernel-settings", json.dumps(settings), "--out", out]
    try:
        subprocess.run(cmd, timeout=timeout, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        forward = json.load(open(out))["forward"]
    except (subprocess.SubprocessError, OSError, ValueError, KeyError) as e:
        print(json.dumps({"variant": settings, "error": repr(e)}), flush=True)
        return None
    row = {"variant": settings} | {r["mode"]: round(r["gpu_ms"], 4) for r in forward}
    print(json.dumps(row), flush=True)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", nargs="+", help="JSON objects of KernelSettings fields; '{}' is the default")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--settings-out", required=True)
    ap.add_argument("--margin", type=float, default=0.01, help="fraction a variant must beat the default by")
    ap.add_argument("--timeout", type=int, default=90)
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    variants = [parse(v) for v in args.variants]
    if {} not in variants:
        variants.insert(0, {})
    rows = [r for r in (run(v, args.out_dir, args.timeout) for v in variants) if r is not None and "plain" in r]
    default = next((r["plain"] for r in rows if not r["variant"]), None)
    best = None
    if default is not None:
        better = sorted((r for r in rows if r["variant"] and r["plain"] < (1 - args.margin) * default),
                        key=lambda r: r["plain"])
        if len(better) >= 2 and not set(better[0]["variant"]) & set(better[1]["variant"]):
            combined = run(better[0]["variant"] | better[1]["variant"], args.out_dir, args.timeout)
            if combined is not None and combined.get("plain", default) < better[0]["plain"]:
                better.insert(0, combined)
        best = better[0] if better else None
    winner = best["variant"] if best else {}
    print(json.dumps({"default_plain_ms": default, "best": winner,
                      "best_plain_ms": best["plain"] if best else default}), flush=True)
    with open(args.settings_out, "w") as f:
        json.dump(winner, f)


if __name__ == "__main__":
    main()
