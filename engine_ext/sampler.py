"""Turning next-token logits into tokens: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import torch

from .sampling_params import SamplingParams


def _param_tensors(params: list[SamplingParams], device: torch.device):
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=device)
    top_k = torch.tensor([p.top_k for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    return temps, top_k, top_p


def probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from: softmax(logits / T) restricted to top-k, then to the
    smallest top-p nucleus, renormalised. [N, V] float32. (Greedy rows get temperature 1.)"""
    temps, top_k, top_p = _param_tensors(params, logits.device)
    logits = logits.float() / temps[:, None]
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
        drop = (top_k[:, None] > 0) & (rank >= top_k[:, None])
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Keep a token while the mass strictly before it is below top_p (the first token always stays).
        drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits.softmax(dim=-1)


def draw(probs: torch.Tensor, generators: list[torch.Generator | None], default: torch.Generator) -> torch.Tensor:
    """One sample per row via the exponential race argmax(p / E), E ~ Exp(1) drawn from the row's own
    generator when it has a seed (so a seeded request is reproducible whatever else is in the batch)."""
    noise = torch.empty_like(probs)
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if len(seeded) < len(generators):
        noise.exponential_(generator=default)
    for i in seeded:
        noise[i].exponential_(generator=generators[i])
    return (probs / noise).argmax(dim=-1)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           default: torch.Generator) -> torch.Tensor:
    """[N, V] logits -> [N] tokens."""
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        idx = torch.tensor(random_rows, device=logits.device)
        probs = probabilities(logits[idx], [params[i] for i in random_rows])
        tokens[idx] = draw(probs, [generators[i] for i in random_rows], default)
    return tokens
