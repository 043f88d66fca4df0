"""The verify pass against the plain step, from bench/decode.py's forward JSON (one file per tree or shape):
per (file, shape, rank, batch) the base-only and plain step (over the verify passes' adapters), the base model alone
over each verify pass's tokens (the floor) and each verify pass's GPU ms, and verify / plain.
Prints one JSON line per row and a markdown table.

    python bench/verify_table.py new.json old.json
"""

from __future__ import annotations

import json
import os
import sys


def rows(path: str) -> list[dict]:
    data = json.load(open(path))
    fwd = data.get("forward", [])
    out = []
    keys = sorted({(r["shape"], r["rank"], r["batch"]) for r in fwd if r["mode"].startswith("verify")})
    for shape, rank, batch in keys:
        same = [r for r in fwd if (r["shape"], r["batch"]) == (shape, batch)]
        verify = {r["mode"]: r for r in same if r["rank"] == rank and r["mode"].startswith("verify")}
        verify = [verify.get(f"verify_k{k}") for k in range(1, 5)]
        if None in verify:
            continue
        # the plain step of the verify passes' adapters (a run may hold plain steps over fewer adapters too)
        plain = next((r for r in same if r["mode"] == "plain" and r["rank"] == rank
                      and r["adapters"] == verify[0]["adapters"]), None)
        if plain is None:
            continue
        base = next((r for r in same if r["mode"] == "base"), None)
        # the floor: the same tokens through the base model alone (base_verify_k rows, bench/decode.py since c0ca05b)
        floor = {r["mode"]: r["gpu_ms"] for r in same if r["mode"].startswith("base_verify")}
        floor = [floor.get(f"base_verify_k{k}") for k in range(1, 5)]
        row = {"file": os.path.basename(path), "shape": shape, "rank": rank, "batch": batch,
               "base_ms": base["gpu_ms"] if base else None, "plain_ms": plain["gpu_ms"],
               "verify_ms": [v["gpu_ms"] for v in verify],
               "verify_over_plain": [round(v["gpu_ms"] / plain["gpu_ms"], 3) for v in verify],
               "floor_ms": None if None in floor else floor}
        out.append(row)
    return out


def main() -> None:
    table = [r for path in sys.argv[1:] for r in rows(path)]
    for r in table:
        print(json.dumps(r))
    print("| tree | shape | rank | batch | base ms | plain ms | base model over the verify tokens, k=1..4 | "
          "verify k=1..4 ms | verify / plain |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in table:
        base = "-" if r["base_ms"] is None else f"{r['base_ms']:.3f}"
        floor = "-" if r["floor_ms"] is None else " / ".join(f"{v:.3f}" for v in r["floor_ms"])
        print(f"| {r['file']} | {r['shape']} | {r['rank']} | {r['batch']} | {base} | {r['plain_ms']:.3f} | {floor} | "
              + " / ".join(f"{v:.3f}" for v in r["verify_ms"]) + " | "
              + " / ".join(f"{v:.2f}" for v in r["verify_over_plain"]) + " |")


if __name__ == "__main__":
    main()
