"""Acceptance of base-model drafts on real fine-tuned adapters: SmolLM2-135M-Instruct and its committed adapters,
on the CPU, through the engine, with the hybrid-KV ablation through transformers + peft.

    python bench/acceptance.py                          # every adapter, greedy and T = 0.7, k = 1..6 (~25 min)
    python bench/acceptance.py --ks 4 --temperatures 0 --prompts 4 --max-tokens 16   # a quick look
    python bench/acceptance.py --table results.json     # the markdown table of bench/RESULTS.md from its JSON

Engine (forced speculation: every step drafts k tokens, no gate, no riders; float32): per adapter,
  acceptance       accepted over judged drafts (a draft after a cycle's first rejection is not judged): the
                   per-position acceptance rate alpha of the speculative-decoding literature
  accepted/drafted the share of drafted tokens accepted
  per verify       accepted drafts per verify pass; tokens per cycle = that + the verify's own token
  equal            greedy: requests whose tokens equal plain multi-LoRA decoding's (lossless), of all
Ablation (greedy, k = --ablation-k, transformers + peft, one request at a time): the same drafting loop with the
  drafter reading the committed prefix's KV as the adapter-on target wrote it (hybrid: what the engine does), or
  its own KV of the prefix computed with adapters off (separate: a base model drafting on its own cache).
Prompts: held-out questions of each adapter's own behaviour (demo/smollm2/data.py), in the chat template.
Prints one JSON object.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import commit, machine  # noqa: E402
from demo import ensure_smollm2  # noqa: E402
from demo.smollm2.data import conversations  # noqa: E402
from demo.smollm2.samples import chat_ids  # noqa: E402
from engine_ext import EngineConfig, LLMEngine, SamplingParams, SpecConfig  # noqa: E402


def prompts_by_adapter(tok, adapters: list[str], n: int) -> dict[str, list[list[int]]]:
    return {a: [chat_ids(tok, user) for user, _ in conversations(a, "heldout", seed=1234)[:n]] for a in adapters}


def run_engine(paths: dict, prompts: dict[str, list[list[int]]], k: int | None, temperature: float,
               max_tokens: int) -> tuple[dict[str, list[list[int]]], dict, float]:
    """Every adapter's prompts in one batch; k None = plain multi-LoRA decoding. Returns (tokens by adapter,
    engine stats, seconds)."""
    spec = None if k is None else SpecConfig(num_draft_tokens=k, gate=False, min_acceptance=0.0)
    engine = LLMEngine(EngineConfig(model=paths["model"], device="cpu", dtype="float32", max_loras=len(prompts),
                                    max_lora_rank=16, speculative=spec))
    for name in prompts:
        engine.add_adapter(name, paths["adapters"][name])
    order = [(a, i) for a in prompts for i in range(len(prompts[a]))]
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=1000 + j)
              for j in range(len(order))]
    t0 = time.perf_counter()
    outs = engine.generate(prompt_token_ids=[prompts[a][i] for a, i in order], sampling_params=params,
                           adapter_names=[a for a, _ in order])
    seconds = time.perf_counter() - t0
    tokens: dict[str, list[list[int]]] = {a: [] for a in prompts}
    for (a, _), out in zip(order, outs):
        tokens[a].append(list(out.token_ids))
    return tokens, engine.stats(), seconds


def spec_summary(stats: dict, name: str) -> dict:
    a = stats["adapters"][name]
    per_verify = a["mean_accepted_length"]
    return {"acceptance": a["acceptance_rate"], "accepted_per_drafted": a["draft_efficiency"],
            "accepted_per_verify": per_verify, "tokens_per_cycle": None if per_verify is None else per_verify + 1,
            "drafted": a["drafted_tokens"], "verifies": a["verifies"]}


@torch.no_grad()
def hf_spec_greedy(model, adapter: str, prompt: list[int], k: int, max_tokens: int, eos: int, hybrid: bool) -> dict:
    """Greedy speculative decoding with transformers + peft, one request: k drafts with adapters off, one
    adapter-on verify. hybrid: the drafter starts from the target's cache (the prefix's KV written adapter-on);
    otherwise from its own cache of the prefix, computed adapter-off. Returns tokens and per-position counts."""
    from transformers import DynamicCache

    def forward(ids: list[int], cache, adapter_on: bool):
        x = torch.tensor([ids])
        if adapter_on:
            model.set_adapter(adapter)
            return model(input_ids=x, past_key_values=cache, use_cache=True).logits[0]
        with model.disable_adapter():
            return model(input_ids=x, past_key_values=cache, use_cache=True).logits[0]

    target = DynamicCache()
    tokens = [int(forward(prompt, target, True)[-1].argmax())]
    drafter_own = None
    if not hybrid:
        drafter_own = DynamicCache()
        forward(prompt, drafter_own, False)
    judged, accepted = [0] * k, [0] * k
    while len(tokens) < max_tokens and tokens[-1] != eos:
        committed = len(prompt) + len(tokens) - 1          # positions whose KV the target has written
        if hybrid:
            cache = copy.deepcopy(target)
        else:
            cache = drafter_own
            seen = cache.get_seq_length()
            if seen < committed:                            # the drafter computes what it has not seen
                forward((prompt + tokens)[seen:committed], cache, False)
        drafts, last = [], tokens[-1]
        for _ in range(min(k, max_tokens - len(tokens))):
            last = int(forward([last], cache, False)[-1].argmax())
            drafts.append(last)
        if not hybrid:
            _crop(cache, committed)
        logits = forward([tokens[-1], *drafts], target, True)   # row j predicts the token after drafts[:j]
        want = logits.argmax(-1).tolist()
        n = 0
        while n < len(drafts) and drafts[n] == want[n]:
            n += 1
        for j in range(min(n + 1, len(drafts))):
            judged[j] += 1
            accepted[j] += j < n
        new = drafts[:n] + [want[n]]
        _crop(target, committed + 1 + n)                   # keep the KV of the verified tokens only
        tokens += new
        if eos in new:
            tokens = tokens[: tokens.index(eos) + 1]
    return {"tokens": tokens[:max_tokens], "judged": judged, "accepted": accepted}


def _crop(cache, length: int) -> None:
    """Keep the first `length` positions (a negative argument to `crop` removes that many in every version)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def ablation(paths: dict, tok, prompts: dict[str, list[list[int]]], k: int, max_tokens: int,
             plain: dict[str, list[list[int]]]) -> dict:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(paths["model"], dtype=torch.float32).eval()
    names = list(prompts)
    model = PeftModel.from_pretrained(base, paths["adapters"][names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(paths["adapters"][name], adapter_name=name)
    model.eval()
    out = {}
    for name in names:
        out[name] = {}
        for mode, hybrid in (("hybrid", True), ("separate", False)):
            runs = [hf_spec_greedy(model, name, p, k, max_tokens, tok.eos_token_id, hybrid) for p in prompts[name]]
            judged = [sum(r["judged"][j] for r in runs) for j in range(k)]
            acc = [sum(r["accepted"][j] for r in runs) for j in range(k)]
            cycles = judged[0]
            out[name][mode] = {
                "acceptance": sum(acc) / max(1, sum(judged)),
                "by_position": [round(a / j, 3) if j else None for a, j in zip(acc, judged)],
                "tokens_per_cycle": (sum(acc) + cycles) / max(1, cycles),
                "equal_to_engine_plain": sum(_strip(r["tokens"], tok.eos_token_id) == _strip(p, tok.eos_token_id)
                                             for r, p in zip(runs, plain[name])),
            }
    return out


def _strip(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos)] if eos in ids else ids


def markdown(result: dict) -> str:
    """RESULTS.md's table: per adapter and temperature, acceptance / tokens per cycle at each k, then greedy
    equality with plain decoding and the ablation (hybrid vs separate KV) at its k."""
    from demo.smollm2.recipe import DEFAULT_ADAPTERS

    specs = {s.name: s for s in DEFAULT_ADAPTERS.adapters}
    temps = list(result["engine"])
    ks = list(next(iter(result["engine"].values()))["by_k"])   # JSON keys: "1", "2", ...
    k_mid = "4" if "4" in ks else ks[-1]
    ab = result["ablation"]
    head = ["adapter (rank, targets)", "T"] + [f"k={k}" for k in ks] + [f"accepted/drafted k={k_mid}", "equal to plain"]
    if ab:
        head += [f"hybrid KV k={ab['k']}", f"separate KV k={ab['k']}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in specs:
        s = specs[name]
        targets = "all 7" if len(s.target_modules) == 7 else "/".join(m.split("_")[0] for m in s.target_modules)
        for temp in temps:
            by_k = result["engine"][temp]["by_k"]
            cells = [f"{by_k[k][name]['acceptance']:.2f} / {by_k[k][name]['tokens_per_cycle']:.2f}" for k in ks]
            mid = by_k[k_mid][name]
            equal = [by_k[k][name].get("equal") for k in ks]
            same = (f"{sum(int(e.split('/')[0]) for e in equal)}/{sum(int(e.split('/')[1]) for e in equal)}"
                    if all(equal) else "-")
            row = [f"{name} ({s.rank}, {targets})" if temp == temps[0] else "", temp.removeprefix("T=")] + cells
            row += [f"{mid['accepted_per_drafted']:.2f}", same]
            if ab:
                kv = ab["adapters"][name]
                row += [f"{kv[m]['acceptance']:.2f} / {kv[m]['tokens_per_cycle']:.2f}" if temp == temps[0] else ""
                        for m in ("hybrid", "separate")]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=12, help="held-out prompts per adapter")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--ablation-k", type=int, default=4, help="0: no ablation")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--table", type=Path, help="print the markdown table of this JSON result and exit")
    args = ap.parse_args(argv)
    if args.table:
        print(markdown(json.loads(args.table.read_text())))
        return 0
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    paths = ensure_smollm2()
    tok = AutoTokenizer.from_pretrained(paths["model"])
    prompts = prompts_by_adapter(tok, list(paths["adapters"]), args.prompts)
    result = {"bench": "acceptance", "commit": commit(), "machine": machine(), "threads": args.threads,
              "prompts_per_adapter": args.prompts,
              "max_tokens": args.max_tokens, "engine": {}, "ablation": None}
    plain = {}
    for temp in args.temperatures:
        key = f"T={temp:g}"
        entry = result["engine"][key] = {"by_k": {}}
        if temp == 0:
            plain, _, secs = run_engine(paths, prompts, None, temp, args.max_tokens)
            entry["plain_seconds"] = round(secs, 1)
        for k in args.ks:
            tokens, stats, secs = run_engine(paths, prompts, k, temp, args.max_tokens)
            row = {name: spec_summary(stats, name) for name in prompts}
            if temp == 0:
                for name in prompts:
                    row[name]["equal"] = f"{sum(a == b for a, b in zip(tokens[name], plain[name]))}/{len(plain[name])}"
            entry["by_k"][k] = row | {"seconds": round(secs, 1)}
            print(f"[acceptance] {key} k={k} {secs:.0f}s", file=sys.stderr, flush=True)
    if args.ablation_k and plain:
        result["ablation"] = {"k": args.ablation_k,
                              "adapters": ablation(paths, tok, prompts, args.ablation_k, args.max_tokens, plain)}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
