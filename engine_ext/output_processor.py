"""After a token is sampled: append it, detokenize, check stops, build the caller's incremental output.

Text is decoded incrementally where the tokenizer allows it (a `tokenizers` backend, as every fast tokenizer has,
with no clean-up of spaces): each token's text comes from the `tokenizers` library's DecodeStream, which decodes a
short window of the latest tokens, so a step costs the host the same at the thousandth token as at the first.
Decoding a sequence's whole output again at every step cost 0.5 ms a sequence at 256 tokens (SmolLM2's tokenizer),
several times a 128-sequence step's device time. Other tokenizers decode the whole output each time."""

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


def stream_backend(tokenizer):
    """The `tokenizers.Tokenizer` that streams `tokenizer`'s text exactly as its decode(skip_special_tokens=True)
    would give it, or None (decode the whole output instead)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None  # clean-up rewrites spaces around punctuation over the whole text: a window cannot
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:  # tokenizers < 0.21
        return None
    return backend if hasattr(DecodeStream(skip_special_tokens=True), "step") else None


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._stream = stream_backend(tokenizer) if tokenizer is not None else None

    def _decode_new(self, seq: Sequence, token: int) -> None:
        """Extend seq.text with `token`'s text, once it is final (a partial UTF-8 character waits for its rest)."""
        if seq.decoder is None:
            from tokenizers.decoders import DecodeStream

            seq.decoder = DecodeStream(skip_special_tokens=True)
        piece = seq.decoder.step(self._stream, token)
        if piece:
            seq.text += piece

    def append(self, seq: Sequence, token: int, logits: torch.Tensor | None = None) -> bool:
        """Append one token; returns True when the sequence finished on it (exactly where plain
        decoding would stop, also when it sits inside a longer accepted speculative run)."""
        p = seq.params
        seq.output_token_ids.append(token)
        if self._stream is not None:
            self._decode_new(seq, token)
        if p.return_logits and logits is not None:
            seq.logits.append(logits.detach().float().cpu())
        if p.logprobs is not None:
            seq.logprobs.append(token_logprobs(token, logits, p.logprobs))
        if p.stop and self.tokenizer is not None:
            prev = len(seq.text)
            if self._stream is None:
                seq.text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
            else:  # appended above; the stop may span the text before it
                prev = seq.num_stop_checked
                seq.num_stop_checked = len(seq.text)
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
        full = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        # The whole output decoded once (it shows a partial character the stream held back); where that is not an
        # extension of the text streamed so far, the streamed text stands (what was handed out cannot change)
        return full if full.startswith(seq.text) else seq.text

    def output(self, seq: Sequence, finished: bool) -> RequestOutput:
        """The caller's view; text is emitted only once it cannot change (no partial UTF-8, no text that
        might turn out to be the start of a stop string), so streamed deltas concatenate to the final text."""
        if finished:
            seq.text = self._final_text(seq)
            stable = len(seq.text)
        elif self.tokenizer is not None:
            if self._stream is None:
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
            output_token_ids=seq.output_token_ids,
            num_token_ids=len(seq.output_token_ids),
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
