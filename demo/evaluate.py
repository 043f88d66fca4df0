"""Held-out loss and base/adapter greedy agreement: a first estimate of LoRA-off draft acceptance."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from peft import PeftModel


@torch.no_grad()
def _logits(model: torch.nn.Module, blocks: torch.Tensor, batch: int = 4) -> torch.Tensor:
    return torch.cat([model(input_ids=blocks[i:i + batch]).logits for i in range(0, len(blocks), batch)])


def _loss(logits: torch.Tensor, blocks: torch.Tensor) -> float:
    # logits (N, T, V) predict blocks[:, 1:]
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), blocks[:, 1:].reshape(-1)).item()


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, blocks: torch.Tensor) -> float:
    model.eval()
    return _loss(_logits(model, blocks), blocks)


@torch.no_grad()
def compare(model: PeftModel, blocks: torch.Tensor) -> dict[str, float]:
    """Base (adapter disabled) vs adapter on the same held-out blocks (N, T).

    agreement = fraction of positions where argmax(base logits) == argmax(adapter logits): with greedy
    decoding this is the chance a LoRA-off draft token is accepted, position by position.
    """
    model.eval()
    with model.disable_adapter():
        base = _logits(model, blocks)
    tuned = _logits(model, blocks)
    agree = (base[:, :-1].argmax(-1) == tuned[:, :-1].argmax(-1)).float().mean().item()
    return {"base_loss": _loss(base, blocks), "adapter_loss": _loss(tuned, blocks), "agreement": agree,
            "positions": int(blocks.shape[0] * (blocks.shape[1] - 1))}


def results_table(metrics: dict, command: str) -> str:
    """Markdown for bench/RESULTS.md from the build's metrics.json."""
    lines = [
        "| adapter | rank | targets | eval text (held-out) | base loss | adapter loss | agreement (own text) "
        "| agreement (base text) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, m in metrics["adapters"].items():
        own, gen = m["own"], m["base_text"]
        lines.append(
            f"| {name} | {m['rank']} | {m['targets']} | {m['domain']} ({own['positions']} tokens) "
            f"| {own['base_loss']:.3f} | {own['adapter_loss']:.3f} | {own['agreement']:.1%} | {gen['agreement']:.1%} |"
        )
    b = metrics["base"]
    lines.append("")
    lines.append(f"Base model: {b['params'] / 1e6:.2f} M parameters, held-out loss on its own text "
                 f"{b['heldout_loss']:.3f} (train loss at the end {b['final_train_loss']:.3f}); "
                 f"build took {metrics['build_seconds']:.0f} s. Produced by `{command}`.")
    return "\n".join(lines)
