"""The verify pass against the plain step, from bench/decode.py's forward JSON (one file per tree or shape):
per (file, shape, rank, batch) the base-only and plain step and each verify pass's GPU ms, and verify / plain.
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
        pick = {r["mode"]: r for r in fwd if (r["shape"], r["batch"]) == (shape, batch)
                and (r["rank"] == rank or r["mode"] == "base")}
        plain = pick.get("plain")
        verify = [pick.get(f"verify_k{k}") for k in range(1, 5)]
        if plain is None or None in verify:
            continue
        row = {"file": os.path.basename(path), "shape": shape, "rank": rank, "batch": batch,
               "base_ms": pick["base"]["gpu_ms"] if "base" in pick else None, "plain_ms": plain["gpu_ms"],
               "verify_ms": [v["gpu_ms"] for v in verify],
               "verify_over_plain": [round(v["gpu_ms"] / plain["gpu_ms"], 3) for v in verify]}
        out.append(row)
    return out


def main() -> None:
    table = [r for path in sys.argv[1:] for r in rows(path)]
    for r in table:
        print(json.dumps(r))
    print("| tree | shape | rank | batch | base ms | plain ms | verify k=1..4 ms | verify / plain |")
    print("|---|---|---|---|---|---|---|---|")
    for r in table:
        base = "-" if r["base_ms"] is None else f"{r['base_ms']:.3f}"
        print(f"| {r['file']} | {r['shape']} | {r['rank']} | {r['batch']} | {base} | {r['plain_ms']:.3f} | "
              + " / ".join(f"{v:.3f}" for v in r["verify_ms"]) + " | "
              + " / ".join(f"{v:.2f}" for v in r["verify_over_plain"]) + " |")


if __name__ == "__main__":
    main()
