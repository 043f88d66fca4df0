"""Turning next-token logits into tokens: logit bias and penalties, greedy, temperature, top-k, top-p, min-p,
per-request seeds."""

from __future__ import annotations

import math
from typing import Protocol, Sequence as Seq

import torch

from .sampling_params import SamplingParams


class History(Protocol):
    prompt_token_ids: list[int]
    output_token_ids: list[int]


def _param_tensors(params: list[SamplingParams], device: torch.device):
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=device)
    top_k = torch.tensor([p.top_k for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    return temps, top_k, top_p


def adjust_logits(logits: torch.Tensor, params: list[SamplingParams], history: Seq[History] | None) -> torch.Tensor:
    """Rows whose params adjust logits, in this order (the other rows unchanged, no copy when none does):
        l[t] += logit_bias[t]
        l[t] = l[t] / rp if l[t] > 0 else l[t] * rp      for t in prompt + output     (repetition_penalty rp)
        l[t] -= frequency_penalty * count_out(t) + presence_penalty * (count_out(t) > 0)
    history[i]: row i's sequence so far (prompt and output token ids). [N, V] -> [N, V] float32."""
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    if history is None:
        raise ValueError("penalties and logit_bias need each row's tokens so far")
    out = logits.float().clone()
    vocab, dev = out.shape[-1], out.device
    for i in rows:
        p, h, row = params[i], history[i], out[i]
        if p.logit_bias:
            row[torch.tensor(list(p.logit_bias), device=dev)] += torch.tensor(list(p.logit_bias.values()), device=dev)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(h.prompt_token_ids) | set(h.output_token_ids)), dtype=torch.long,
                                device=dev)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if h.output_token_ids and (p.frequency_penalty or p.presence_penalty):
            counts = torch.bincount(torch.tensor(h.output_token_ids, device=dev), minlength=vocab)[:vocab].float()
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return out


def probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from: softmax(logits / T) restricted to top-k, then to the
    smallest top-p nucleus, then to tokens with at least min_p times the top token's probability,
    renormalised. [N, V] float32. (Greedy rows get temperature 1.) min_p compares with the top token,
    which top-k and top-p always keep, so its place in the order changes nothing."""
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
    if any(p.min_p > 0 for p in params):
        # p(t) < min_p * p(top)  <=>  logit(t) < logit(top) + log(min_p)
        floor = torch.tensor([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params], device=logits.device)
        logits = logits.masked_fill(logits < logits.max(dim=-1, keepdim=True).values + floor[:, None], float("-inf"))
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
           default: torch.Generator, history: Seq[History] | None = None) -> torch.Tensor:
    """[N, V] logits -> [N] tokens. history: each row's sequence, needed when a row has penalties or logit_bias."""
    logits = adjust_logits(logits, params, history)
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if p.temperature > 0]
    if random_rows:
        idx = torch.tensor(random_rows, device=logits.device)
        probs = probabilities(logits[idx], [params[i] for i in random_rows])
        tokens[idx] = draw(probs, [generators[i] for i in random_rows], default)
    return tokens
