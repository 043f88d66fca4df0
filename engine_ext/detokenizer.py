"""A request's text as its tokens arrive: incremental decoding, stop strings, and the part of the text that can be
handed out. The engine runs it in its step loop (LLMEngine's output processor) or leaves it to its client
(AsyncLLMEngine over an engine core): the same code either way, so both give the same text.

Text is decoded incrementally where the tokenizer allows it (a `tokenizers` backend, as every fast tokenizer has,
with no clean-up of spaces): each token's text comes from the `tokenizers` library's DecodeStream, which decodes a
short window of the latest tokens, so a token costs the host the same at the thousandth token as at the first.
Decoding a sequence's whole output again at every step cost 0.5 ms a sequence at 256 tokens (SmolLM2's tokenizer),
several times a 128-sequence step's device time. Other tokenizers decode the whole output each time."""

from __future__ import annotations

__all__ = ["Detokenizer", "TextState", "stream_backend"]


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


class Detokenizer:
    """One tokenizer's decoding, shared by the requests' TextStates."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.stream = stream_backend(tokenizer)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def text_state(self, stop: list[str]) -> TextState:
        return TextState(self, stop)


class TextState:
    """The text of one request's output tokens, and how much of it was handed out. `add` each token after it was
    appended to the output; `emit` gives the text that cannot change any more: no partial UTF-8 character, no tail
    that might still turn out to be the start of a stop string, so handed-out deltas concatenate to the final
    text."""

    def __init__(self, detokenizer: Detokenizer, stop: list[str]):
        self._detok = detokenizer
        self._stop = stop
        self._longest_stop = max((len(s) for s in stop), default=0)
        self._decoder = None  # its DecodeStream (incremental decoding)
        self.text = ""
        self.final = False  # a stop string cut the text: it never changes again
        self._checked = 0  # characters already searched for stop strings (incremental decoding)
        self.emitted = 0  # characters handed out

    def add(self, output_token_ids: list[int]) -> bool:
        """Take the last of `output_token_ids`; True when a stop string ended the text on it (the text is cut
        before the stop string)."""
        stream = self._detok.stream
        if stream is not None:
            if self._decoder is None:
                from tokenizers.decoders import DecodeStream

                self._decoder = DecodeStream(skip_special_tokens=True)
            piece = self._decoder.step(stream, output_token_ids[-1])
            if piece:
                self.text += piece
        if not self._stop:
            return False
        if stream is None:
            prev = len(self.text)
            self.text = self._detok.decode(output_token_ids)
        else:  # decoded above; the stop may span the text before it
            prev, self._checked = self._checked, len(self.text)
        tail_from = max(0, prev - self._longest_stop)
        hits = [i for i in (self.text.find(s, tail_from) for s in self._stop) if i >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        self.final = True
        return True

    def emit(self, output_token_ids: list[int], finished: bool) -> tuple[str, str]:
        """(the text handed out so far, what of it is new since the last call)."""
        if finished:
            self.text = self._final_text(output_token_ids)
            stable = len(self.text)
        else:
            if self._detok.stream is None:
                self.text = self._detok.decode(output_token_ids)
            stable = len(self.text.rstrip("\ufffd"))
            if self._stop:
                stable = max(0, min(stable, len(self.text) - self._longest_stop + 1))
        stable = max(stable, self.emitted)
        delta = self.text[self.emitted : stable]
        self.emitted = stable
        return self.text[:stable], delta

    def _final_text(self, output_token_ids: list[int]) -> str:
        if self.final:
            return self.text  # already cut before the stop string
        full = self._detok.decode(output_token_ids)
        # The whole output decoded once (it shows a partial character the stream held back); where that is not an
        # extension of the text streamed so far, the streamed text stands (what was handed out cannot change)
        return full if full.startswith(self.text) else self.text
