"""Turning next-token logits into tokens on the device: logit bias and penalties, greedy, temperature, top-k,
top-p, min-p, per-request seeds. Nothing here reads a device value on the host, so a step's tokens can feed the
next step's inputs while the host is still busy with the step before.

Sampling is Gumbel-max: a row's token is

    argmax_t ( logits[t] / T + g[t] )   over the tokens top-k, top-p and min-p keep,   g[t] = -log(-log u[t])

which draws t with probability softmax(logits / T) restricted and renormalised. The uniforms u come from a hash of
(the request's seed, the position of the token drawn, t): they depend on nothing else, so a request's tokens are
the same whatever else is in the batch, and a token drafted at position p from the draft logits with p's noise
equals the target's own draw at p exactly when plain decoding would also have drawn it (speculation/verify.py).
A request without a seed gets one from the engine's generator when it arrives."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Sequence as Seq

import numpy as np
import torch

from .sampling_params import SamplingParams

_M32 = 0xFFFFFFFF


class History(Protocol):
    prompt_token_ids: list[int]
    output_token_ids: list[int]


@dataclass
class SamplingRows:
    """The sampling parameters of N logits rows, as device tensors (`pack`), for rows that are not all greedy."""

    greedy: torch.Tensor  # [N] bool: argmax of the (adjusted) logits
    temperature: torch.Tensor  # [N] float32 (1 on greedy rows)
    top_k: torch.Tensor  # [N] long, -1: off
    top_p: torch.Tensor  # [N] float32
    min_p: torch.Tensor  # [N] float32
    seed: torch.Tensor  # [N] long
    restricts: bool  # some row has top-k or top-p
    floors: bool  # some row has min-p

    @classmethod
    def pack(cls, params: Seq[SamplingParams], seeds: Seq[int], device: torch.device,
             always: bool = False) -> SamplingRows | None:
        """None when every row is greedy (sampling is then an argmax), unless `always`. One host-to-device copy
        (pinned on a GPU)."""
        if not always and all(p.temperature == 0 for p in params):
            return None
        n = len(params)
        table = np.empty((6, n), dtype=np.float64)
        table[0] = [p.temperature == 0 for p in params]
        table[1] = [p.temperature if p.temperature > 0 else 1.0 for p in params]
        table[2] = [p.top_k for p in params]
        table[3] = [p.top_p for p in params]
        table[4] = [p.min_p for p in params]
        host = torch.from_numpy(table)
        ids = torch.tensor(seeds, dtype=torch.long)
        if device.type == "cuda":
            host, ids = host.pin_memory(), ids.pin_memory()
        t = host.to(device, non_blocking=True)
        return cls(greedy=t[0] > 0, temperature=t[1].float(), top_k=t[2].long(), top_p=t[3].float(),
                   min_p=t[4].float(), seed=ids.to(device, non_blocking=True),
                   restricts=any(p.top_k > 0 or p.top_p < 1.0 for p in params), floors=any(p.min_p > 0 for p in params))


def adjust_logits(logits: torch.Tensor, params: list[SamplingParams], history: Seq[History] | None) -> torch.Tensor:
    """Rows whose params adjust logits, in this order (the other rows unchanged, no copy when none does):
        l[t] += logit_bias[t]
        l[t] = l[t] / rp if l[t] > 0 else l[t] * rp      for t in prompt + output     (repetition_penalty rp)
        l[t] -= frequency_penalty * count_out(t) + presence_penalty * (count_out(t) > 0)
    history[i]: row i's sequence so far (prompt and output token ids), complete on the host: the engine runs a
    step with such rows only once the step before it has been read. [N, V] -> [N, V] float32."""
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


def restricted_logits(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """logits / T with every token top-k, then the smallest top-p nucleus, then min-p (at least min_p times the top
    token's probability) drop set to -inf. [N, V] float32. min_p compares with the top token, which top-k and top-p
    always keep, so its place in the order changes nothing."""
    logits = logits.float() / rows.temperature[:, None]
    if rows.restricts:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
        top_k = rows.top_k[:, None]
        drop = (top_k > 0) & (rank >= top_k)
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Keep a token while the mass strictly before it is below top_p (the first token always stays).
        drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= rows.top_p[:, None]
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    if rows.floors:
        # p(t) < min_p * p(top)  <=>  logit(t) < logit(top) + log(min_p)
        floor = torch.where(rows.min_p > 0, rows.min_p.clamp_min(1e-30).log(), -math.inf)
        logits = logits.masked_fill(logits < logits.max(dim=-1, keepdim=True).values + floor[:, None], float("-inf"))
    return logits


def probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from, softmax(restricted_logits), [N, V] float32 (greedy rows get
    temperature 1): the reference the tests hold sampled tokens to."""
    rows = SamplingRows.pack(params, [0] * len(params), logits.device, always=True)
    return restricted_logits(logits, rows).softmax(dim=-1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply rounds) on int64 tensors holding values below 2^32; the
    multipliers are below 2^31, so no product reaches 2^63."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M32
    x = x ^ (x >> 16)
    x = (x * 0x297A2D39) & _M32
    return x ^ (x >> 15)


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """u[i, t] in (0, 1), a function of (seeds[i], positions[i], t) alone. [N], [N] long -> [N, vocab] float32."""
    key = _mix(_mix(seeds & _M32) ^ _mix((seeds >> 32) & _M32) ^ _mix(positions & _M32) * 3 & _M32)
    token = _mix(torch.arange(vocab, device=seeds.device) + 0x9E3779B9 & _M32)
    h = _mix(key[:, None] ^ token[None, :])
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def gumbel(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise -log(-log u), keyed like `uniforms`. [N, vocab] float32."""
    return -torch.log(-torch.log(uniforms(seeds, positions, vocab)))


def sample(logits: torch.Tensor, rows: SamplingRows | None, positions: torch.Tensor | None) -> torch.Tensor:
    """[N, V] logits (already adjusted, `adjust_logits`) -> [N] long tokens on the device. `positions` ([N] long):
    the position in its sequence of the token each row draws (its noise key). rows None: every row greedy."""
    tokens = logits.argmax(dim=-1)
    if rows is None:
        return tokens
    noisy = restricted_logits(logits, rows) + gumbel(rows.seed, positions, logits.shape[-1])
    return torch.where(rows.greedy, tokens, noisy.argmax(dim=-1))
