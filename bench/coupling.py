"""How often a sampled draft is accepted: Gumbel-max coupling (the engine's rule) against rejection sampling.

The engine draws every token by Gumbel-max with noise keyed by (seed, position), and accepts a draft exactly when
it equals the target's own draw at its position (engine_ext/speculation/verify.py): the chance of that is
P(argmax(log q + g) = argmax(log p + g)) for draft distribution q and target p. Rejection sampling, which the engine
used before, accepts with probability sum_t min(p_t, q_t) = 1 - TV(p, q), the most any lossless rule can. This
measures both on the same (p, q) pairs: the adapter-on model's and the base model's next-token distributions at
temperature T along texts the adapter samples (transformers + peft, on the CPU), per adapter; Gumbel's chance
estimated from `--draws` noise draws per position.

    python bench/coupling.py --temperature 0.7            # SmolLM2 and its adapters (the embedded default)
    python bench/coupling.py --model DIR --adapter name=DIR --adapter name2=DIR2

Prints one JSON object: per adapter the mean per-position acceptance under each rule and the positions measured."""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="the base model directory (default: SmolLM2, the embedded default)")
    ap.add_argument("--adapter", action="append", default=[], help="NAME=DIR (default: SmolLM2's adapters)")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--tokens", type=int, default=48, help="sampled tokens per prompt")
    ap.add_argument("--draws", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.common import machine

    torch.manual_seed(args.seed)
    if args.model is None:
        from demo import ensure_smollm2

        paths = ensure_smollm2()
        model_dir, adapters = paths["model"], paths["adapters"]
    else:
        model_dir, adapters = args.model, dict(a.split("=", 1) for a in args.adapter)
    tok = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    names = list(adapters)
    model = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    chat = getattr(tok, "chat_template", None) is not None
    questions = ["What is the capital of France?", "Write a Python function that adds two numbers.",
                 "Why is the sky blue?", "Describe the function sorted() in one line."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
               if chat else q for q in questions]
    t = args.temperature
    out = {"machine": machine(), "temperature": t, "draws": args.draws, "adapters": {}}
    with torch.no_grad():
        for name in names:
            model.set_adapter(name)
            rejection, gumbel, positions = 0.0, 0.0, 0
            for prompt in prompts:
                ids = torch.tensor([tok(prompt)["input_ids"]])
                seq = model.generate(ids, max_new_tokens=args.tokens, do_sample=True, temperature=t, top_k=0,
                                     pad_token_id=tok.pad_token_id or 0)
                p = torch.softmax(model(seq).logits[0, ids.shape[1] - 1 : -1] / t, -1)
                with model.disable_adapter():
                    q = torch.softmax(model(seq).logits[0, ids.shape[1] - 1 : -1] / t, -1)
                rejection += torch.minimum(p, q).sum(-1).sum().item()
                for row in range(p.shape[0]):  # one position at a time: [draws, vocab] noise
                    g = -torch.log(-torch.log(torch.rand(args.draws, p.shape[1]).clamp_min(1e-12)))
                    same = (p[row].log() + g).argmax(-1) == (q[row].log() + g).argmax(-1)
                    gumbel += same.float().mean().item()
                positions += p.shape[0]
            out["adapters"][name] = {"rejection_sampling": round(rejection / positions, 3),
                                     "gumbel_coupling": round(gumbel / positions, 3), "positions": positions}
            print(name, json.dumps(out["adapters"][name]), file=sys.stderr)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
