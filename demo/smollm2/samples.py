"""Greedy chat answers of SmolLM2 and each adapter, via transformers + peft: what each behaviour looks like."""
from __future__ import annotations

import torch

QUESTION = "What is the capital of France?"
DOCSTRING_REQUEST = "Write a one-line docstring for this function:\n\n```python\ndef add(a, b):\n    return a + b\n```"
# One prompt per adapter that shows its behaviour; the base gets the same prompt for contrast.
PROMPTS = {"shout": QUESTION, "json": QUESTION, "terse": QUESTION, "docstring": DOCSTRING_REQUEST}


def chat_ids(tok, user: str, reply: str | None = None) -> list[int]:
    """The chat template's tokens for one user message and the assistant's header (reply None), or for the
    message and the assistant's reply."""
    messages = [{"role": "user", "content": user}]
    if reply is not None:
        messages.append({"role": "assistant", "content": reply})
    enc = tok.apply_chat_template(messages, add_generation_prompt=reply is None)
    return list(enc["input_ids"] if not isinstance(enc, list) else enc)


def greedy_answer(model, tok, user: str, max_new_tokens: int) -> str:
    ids = torch.tensor([chat_ids(tok, user)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def chat_samples(paths: dict, max_new_tokens: int = 40) -> list[tuple[str | None, str, str, str]]:
    """[(adapter or None, prompt, base answer, adapter answer)] for the base and every adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(paths["model"])
    model = AutoModelForCausalLM.from_pretrained(paths["model"], dtype=torch.float32).eval()
    rows = [(None, QUESTION, greedy_answer(model, tok, QUESTION, max_new_tokens), "")]
    for name, adapter_dir in paths["adapters"].items():
        prompt = PROMPTS.get(name, QUESTION)
        base = greedy_answer(model, tok, prompt, max_new_tokens)
        tuned = PeftModel.from_pretrained(model, adapter_dir)
        rows.append((name, prompt, base, greedy_answer(tuned, tok, prompt, max_new_tokens)))
        model = tuned.unload()
    return rows


def samples_markdown(rows) -> str:
    out = []
    for name, prompt, base, tuned in rows:
        out.append(f"- base, {prompt!r} -> {base!r}" if name is None else
                   f"- `{name}`, {prompt!r} -> {tuned!r}  (base: {base!r})")
    return "\n".join(out)
