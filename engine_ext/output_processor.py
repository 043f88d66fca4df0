"""After a token is sampled: append it, detokenize, check stops, build the caller's incremental output."""

from __future__ import annotations

import torch

from .sequence import RequestOutput, Sequence, TokenLogprobs


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
        self.tokenizer = tokenizer
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
        if p.stop and self.tokenizer is not None:
            prev = len(seq.text)
            seq.text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
            tail_from = max(0, prev - max(len(s) for s in p.stop))
            hits = [i for i in (seq.text.find(s, tail_from) for s in p.stop) if i >= 0]
            if hits:
                seq.text = seq.text[: min(hits)]
                seq.text_is_final = True
                seq.finish_reason = "stop"
                return True
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            seq.finish_reason = "stop"
        elif len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        return seq.finish_reason is not None

    def _final_text(self, seq: Sequence) -> str:
        if self.tokenizer is None:
            return ""
        if seq.text_is_final:
            return seq.text  # already cut before the stop string
        return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)

    def output(self, seq: Sequence, finished: bool) -> RequestOutput:
        """The caller's view; text is emitted only once it cannot change (no partial UTF-8, no text that
        might turn out to be the start of a stop string), so streamed deltas concatenate to the final text."""
        if finished:
            seq.text = self._final_text(seq)
            stable = len(seq.text)
        elif self.tokenizer is not None:
            seq.text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
            stable = len(seq.text.rstrip("\ufffd"))
            if seq.params.stop:
                stable = max(0, min(stable, len(seq.text) - max(len(s) for s in seq.params.stop) + 1))
        else:
            stable = 0
        stable = max(stable, seq.num_emitted_chars)
        new_tokens = seq.output_token_ids[seq.num_emitted_tokens :]
        new_logprobs = seq.logprobs[seq.num_emitted_tokens :] if seq.params.logprobs is not None else None
        delta = seq.text[seq.num_emitted_chars : stable]
        seq.num_emitted_tokens = len(seq.output_token_ids)
        seq.num_emitted_chars = stable
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids),
            text=seq.text[:stable],
            new_token_ids=new_tokens,
            delta_text=delta,
            finished=finished,
            finish_reason=seq.finish_reason,
            adapter=seq.adapter,
            logits=torch.stack(seq.logits) if finished and seq.logits else None,
            new_logprobs=new_logprobs,
            logprobs=list(seq.logprobs) if finished and seq.params.logprobs is not None else None,
        )
