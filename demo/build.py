"""Build the whole demo (tokenizer, base model, adapters, metrics) into one directory.

Layout:  out/model/{config.json, model.safetensors, tokenizer.json, tokenizer_config.json, ...}
         out/adapters/<name>/{adapter_config.json, adapter_model.safetensors}
         out/metrics.json   (held-out loss, agreement; the RESULTS.md table)
         out/manifest.json  (recipe, key, sha256 of every file above; written last = build complete)
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from .recipe import Recipe, recipe_key, recipe_to_dict

MANIFEST = "manifest.json"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_hashes(root: Path) -> dict[str, str]:
    """sha256 of every file under model/ and adapters/, keyed by relative posix path."""
    return {p.relative_to(root).as_posix(): sha256_file(p)
            for sub in ("model", "adapters") for p in sorted((root / sub).rglob("*")) if p.is_file()}


def demo_paths(root: Path, recipe: Recipe) -> dict:
    return {"model": str(root / "model"), "adapters": {a.name: str(root / "adapters" / a.name) for a in recipe.adapters}}


def build_demo(out: Path, recipe: Recipe, log=print) -> dict:
    """Train everything into `out` (an empty or new directory). Returns demo_paths(out)."""
    import torch

    from . import adapters as lora
    from .corpus import build_domains, stdlib_root, tokenizer_texts
    from .evaluate import compare, heldout_loss
    from .tokenizer import encode_documents, save_tokenizer, train_tokenizer
    from .train import new_base_model, pack, train_lm

    t0 = time.time()
    torch.set_num_threads(recipe.threads)   # matmul reduction order depends on it: fixed for reproducible bytes
    torch.use_deterministic_algorithms(True)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = out / "model"

    domains = build_domains(stdlib_root(), recipe.corpus)
    tok = train_tokenizer(tokenizer_texts(domains, recipe.corpus.tokenizer_chars), recipe.model.vocab_size)
    save_tokenizer(tok, model_dir)
    log(f"[demo] corpus + tokenizer ({len(tok)} tokens) in {time.time() - t0:.1f}s")

    def blocks(domain: str, split: str, seq_len: int):
        return pack(encode_documents(tok, getattr(domains[domain], split)), seq_len)

    model = new_base_model(recipe.model, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, recipe.seed)
    losses = train_lm(model, blocks("base", "train", recipe.base_train.seq_len), recipe.base_train, recipe.seed)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(str(model_dir), safe_serialization=True)
    log(f"[demo] base model: loss {losses[0]:.2f} -> {losses[-1]:.2f} in {time.time() - t0:.1f}s")

    def heldout(domain: str):
        return blocks(domain, "heldout", recipe.eval_seq_len)[: recipe.eval_blocks]

    base_eval = heldout("base")
    base_heldout_loss = heldout_loss(model, base_eval)
    metrics = {"base": {"params": sum(p.numel() for p in model.parameters()), "final_train_loss": losses[-1],
                        "heldout_loss": base_heldout_loss}, "adapters": {}}

    for i, spec in enumerate(recipe.adapters):
        seed = recipe.seed + 1 + i
        peft_model, a_losses = lora.train_adapter(model, spec, blocks(spec.domain, "train", spec.train.seq_len), seed)
        lora.save_adapter(peft_model, out / "adapters" / spec.name)
        metrics["adapters"][spec.name] = {
            "domain": spec.domain, "rank": spec.rank, "description": spec.description,
            "targets": "attention" if len(spec.target_modules) == 4 else "all projections",
            "train_loss": [a_losses[0], a_losses[-1]],
            "own": compare(peft_model, heldout(spec.domain)), "base_text": compare(peft_model, base_eval),
        }
        model = lora.unwrap(peft_model)
        m = metrics["adapters"][spec.name]
        log(f"[demo] adapter {spec.name}: agreement {m['own']['agreement']:.2f} "
            f"(base text {m['base_text']['agreement']:.2f}) in {time.time() - t0:.1f}s")

    metrics["build_seconds"] = time.time() - t0
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    manifest = {"key": recipe_key(recipe), "recipe": recipe_to_dict(recipe), "sha256": file_hashes(out)}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return demo_paths(out, recipe)
