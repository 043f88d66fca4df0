"""Issue 41's open-loop bars from bench/serve_load.py's JSON (runs of base-only, plain and gated on one traffic):
per run gated TPOT p50 over base-only's (bar 1.15), gated TPOT p99 and TTFT p50 over plain's (bars 1.1), the share of
decode steps that were cycles, and on bursts gated over plain throughput (bar 1.0) and gated over base-only's within
10% of the bound (k+1)B/(kB+V) over base-only ("missed" names the bars a run misses): B the base-only pass and V the
verify pass over k+1 tokens a sequence, from the gated run's own pass times at its largest batch. Prints one JSON
line per run and a markdown table; a file named NAME-ab-TREE.json beside NAME.json (gpu_run.sh's AB_TREE) gives the
earlier tree's TPOT p50s in the last column.

    python bench/load_table.py results/*-lightload-*.json
"""

from __future__ import annotations

import json
import os
import re
import sys

BARS = {"gated_over_base_tpot_p50": 1.15, "gated_over_plain_tpot_p99": 1.1, "gated_over_plain_ttft_p50": 1.1}


def _times(table: dict[str, float]) -> dict[tuple[int, int], float]:
    """pass_times_ms' 'tokens/adapters' keys -> {(tokens, adapters): ms}."""
    return {tuple(int(v) for v in key.split("/")): ms for key, ms in table.items()}


def burst_bound(pass_times: dict, k: int) -> dict | None:
    """(k+1)B / (kB + V) at the largest batch with a base-only pass time: V the slowest verify pass measured at
    (k+1) x that batch's tokens, interpolated linearly between the sizes measured (None: too few passes)."""
    base = {n: ms for (n, adapters), ms in _times(pass_times.get("base", {})).items() if adapters == 0}
    verify: dict[int, float] = {}
    for (tokens, _), ms in _times(pass_times.get("lora", {})).items():
        verify[tokens] = max(ms, verify.get(tokens, 0.0))
    if not base or not verify:
        return None
    n, sizes = max(base), sorted(verify)
    want = (k + 1) * n
    lo = max((t for t in sizes if t <= want), default=sizes[0])
    hi = min((t for t in sizes if t >= want), default=sizes[-1])
    v = verify[lo] if hi == lo else verify[lo] + (verify[hi] - verify[lo]) * (want - lo) / (hi - lo)
    b = base[n]
    return {"batch": n, "base_ms": b, "verify_ms": round(v, 3), "bound": round((k + 1) * b / (k * b + v), 3)}


def rows(data: dict, name: str, earlier: dict | None = None) -> list[dict]:
    """One row per run that has base-only, plain and gated on it."""
    by = {(r["run"], r["mode"]): r for r in data["runs"]}
    old = {(r["run"], r["mode"]): r for r in earlier["runs"]} if earlier else {}
    out = []
    for run in dict.fromkeys(r["run"] for r in data["runs"]):
        base, plain, gated = (by.get((run, m)) for m in ("base", "plain", "gated"))
        if not (base and plain and gated):
            continue
        cycles = gated.get("cycles") or 0
        steps = cycles + (gated.get("plain_steps") or 0)
        row = {"file": name, "run": run, "tpot_p50_ms": [m["tpot_ms"]["p50"] for m in (base, plain, gated)],
               "gated_over_base_tpot_p50": round(gated["tpot_ms"]["p50"] / base["tpot_ms"]["p50"], 3),
               "gated_over_plain_tpot_p99": round(gated["tpot_ms"]["p99"] / plain["tpot_ms"]["p99"], 3),
               "gated_over_plain_ttft_p50": round(gated["ttft_ms"]["p50"] / plain["ttft_ms"]["p50"], 3),
               "cycle_share": round(cycles / steps, 3) if steps else None,
               "gated_over_plain_tput": round(gated["tokens_per_s"] / plain["tokens_per_s"], 3)}
        if run == "burst":  # point 3: at least plain's throughput, within 10% of the bound
            bound = burst_bound(gated.get("pass_times_ms") or {}, data.get("spec") or 4)
            row["gated_over_base_tput"] = round(gated["tokens_per_s"] / base["tokens_per_s"], 3)
            row["plain_over_base_tput"] = round(plain["tokens_per_s"] / base["tokens_per_s"], 3)
            row["bound"] = bound
            row["missed"] = ["gated_over_plain_tput"] if row["gated_over_plain_tput"] < 1.0 else []
            if bound and row["gated_over_base_tput"] < 0.9 * bound["bound"]:
                row["missed"].append("bound")
        else:  # point 2
            row["missed"] = [key for key, bar in BARS.items() if row[key] > bar]
        if old:
            row["earlier_tpot_p50_ms"] = [old[(run, m)]["tpot_ms"]["p50"] if (run, m) in old else None
                                          for m in ("base", "plain", "gated")]
        out.append(row)
    return out


def table(paths: list[str]) -> list[dict]:
    out = []
    for path in paths:
        if re.search(r"-ab-[^/]*\.json$", path):
            continue  # read beside its pair
        pairs = [p for p in paths if re.fullmatch(re.escape(path[:-5]) + r"-ab-[^/]+\.json", p)]
        earlier = json.load(open(pairs[0])) if pairs else None
        out += rows(json.load(open(path)), os.path.basename(path), earlier)
    return out


def _ms(values: list) -> str:
    return " / ".join("-" if v is None else f"{v:.2f}" for v in values)


def main() -> None:
    found = table(sys.argv[1:])
    for r in found:
        print(json.dumps(r))
    print("| file | run | TPOT p50 base / plain / gated | gated / base | gated / plain: TPOT p99, TTFT p50, tok/s | "
          "cycles / decode steps | burst: gated, bound over base-only | earlier tree |")
    print("|---|---|---|---|---|---|---|---|")
    for r in found:
        bound = r.get("bound")
        burst = "-" if "gated_over_base_tput" not in r else (
            f"{r['gated_over_base_tput']:.3f} of {bound['bound']:.3f}" if bound else f"{r['gated_over_base_tput']:.3f}")
        print(f"| {r['file']} | {r['run']} | {_ms(r['tpot_p50_ms'])} | {r['gated_over_base_tpot_p50']:.2f} | "
              f"{r['gated_over_plain_tpot_p99']:.2f}, {r['gated_over_plain_ttft_p50']:.2f}, "
              f"{r['gated_over_plain_tput']:.2f} | {r['cycle_share'] if r['cycle_share'] is not None else '-'} | "
              f"{burst} | {_ms(r['earlier_tpot_p50_ms']) if 'earlier_tpot_p50_ms' in r else '-'} |")


if __name__ == "__main__":
    main()
