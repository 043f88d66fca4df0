"""After a token is sampled: append it, check stops, build the caller's incremental output.

The text (incremental decoding, stop strings) is a TextState per sequence (detokenizer.py), kept here when the
engine detokenizes; an engine core leaves it to its client and hands out token-level deltas instead (`delta`)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .detokenizer import Detokenizer
from .sequence import RequestOutput, Sequence, TokenLogprobs


class TokenDelta(NamedTuple):
    """What one step gave a request, without text: an engine core's output (cheaper to build than a RequestOutput)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None  # set once it finished
    new_logprobs: list[TokenLogprobs] | None  # with params.logprobs: one per new token
    logits: torch.Tensor | None  # [len(output), vocab] on the finished delta, with params.return_logits

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def token_logprobs(token: int, logits: torch.Tensor | None, k: int) -> TokenLogprobs:
    """log_softmax of the raw logits row: the token's value and the top k."""
    if logits is None:  # a decoding path that dropped the row: a bug, never a silent empty answer
        raise RuntimeError("logprobs were requested but this decoding path kept no logits row")
    lp = torch.log_softmax(logits.detach().float(), dim=-1)
    top = lp.topk(k) if k > 0 else None
    pairs = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
    return TokenLogprobs(int(token), float(lp[token]), pairs)


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int):
        """tokenizer: None leaves text out (every output's text is empty; stop strings need a client that
        detokenizes)."""
        self.detokenizer = Detokenizer(tokenizer) if tokenizer is not None else None
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def append(self, seq: Sequence, token: int, logits: torch.Tensor | None = None) -> bool:
        """Append one token; returns True when the sequence finished on it (exactly where plain
        decoding would stop, also when it sits inside a longer accepted speculative run)."""
        p = seq.params
        seq.output_token_ids.append(token)
        if p.return_logits and logits is not None:
            seq.logits.append(logits.detach().float().cpu())
        if p.logprobs is not None:
            seq.logprobs.append(token_logprobs(token, logits, p.logprobs))
        if self.detokenizer is not None:
            if seq.text is None:
                seq.text = self.detokenizer.text_state(p.stop)
            if seq.text.add(seq.output_token_ids):
                seq.finish_reason = "stop"
                return True
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            seq.finish_reason = "stop"
        elif len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        return seq.finish_reason is not None

    def output(self, seq: Sequence, finished: bool) -> RequestOutput:
        """The caller's view, its text only what cannot change any more (TextState.emit)."""
        text, delta = "", ""
        if self.detokenizer is not None:
            if seq.text is None:
                seq.text = self.detokenizer.text_state(seq.params.stop)
            text, delta = seq.text.emit(seq.output_token_ids, finished)
        new_tokens = seq.output_token_ids[seq.num_emitted_tokens :]
        new_logprobs = seq.logprobs[seq.num_emitted_tokens :] if seq.params.logprobs is not None else None
        seq.num_emitted_tokens = len(seq.output_token_ids)
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=seq.output_token_ids,
            num_token_ids=len(seq.output_token_ids),
            text=text,
            new_token_ids=new_tokens,
            delta_text=delta,
            finished=finished,
            finish_reason=seq.finish_reason,
            adapter=seq.adapter,
            logits=torch.stack(seq.logits) if finished and seq.logits else None,
            new_logprobs=new_logprobs,
            logprobs=list(seq.logprobs) if finished and seq.params.logprobs is not None else None,
        )

    def delta(self, seq: Sequence, finished: bool) -> TokenDelta:
        """What `output` would give, less the text: the tokens (and log-probabilities) since the last one."""
        start, seq.num_emitted_tokens = seq.num_emitted_tokens, len(seq.output_token_ids)
        return TokenDelta(seq.request_id, seq.output_token_ids[start:], seq.finish_reason if finished else None,
                          seq.logprobs[start:] if seq.params.logprobs is not None else None,
                          torch.stack(seq.logits) if finished and seq.logits else None)
