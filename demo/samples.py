"""Greedy samples from the demo base model and each adapter, via transformers + peft (for the README)."""
from __future__ import annotations

import torch

# One prompt per adapter that shows what it was trained to do; the base gets the same prompt for contrast.
PROMPTS = {
    None: "def __init__(self",
    "dquote": "parser.add_argument(",
    "tests": "class Test(unittest.TestCase):\n\n    def test_",
    "docs": "def read(self, size):\n",
    "changelog": "Library\n-------\n\n- gh-",
    "quoted": "> import os\n> ",
    "upper": "def __init__(self",
}


def greedy_samples(paths: dict, max_new_tokens: int = 40) -> list[tuple[str | None, str, str, str]]:
    """[(adapter or None, prompt, base completion, adapter completion)] for the base and every adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(paths["model"])
    model = AutoModelForCausalLM.from_pretrained(paths["model"], dtype=torch.float32).eval()

    def complete(m, prompt: str) -> str:
        ids = torch.tensor([tok(prompt).input_ids])
        with torch.no_grad():
            out = m.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    rows = [(None, PROMPTS[None], complete(model, PROMPTS[None]), "")]
    for name, adapter_dir in paths["adapters"].items():
        prompt = PROMPTS.get(name, PROMPTS[None])
        base_text = complete(model, prompt)
        peft_model = PeftModel.from_pretrained(model, adapter_dir)
        rows.append((name, prompt, base_text, complete(peft_model, prompt)))
        model = peft_model.unload()
    return rows


def samples_markdown(rows: list[tuple[str | None, str, str, str]]) -> str:
    out = []
    for name, prompt, base_text, tuned in rows:
        if name is None:
            out.append(f"Base model, prompt `{prompt!r}`, greedy:\n\n```python\n{prompt}{base_text}\n```\n")
        else:
            out.append(f"**{name}**, prompt `{prompt!r}`:\n\n- base: `{base_text!r}`\n- {name}: `{tuned!r}`\n")
    return "\n".join(out)
