"""A request's prompts and sampling parameters on the replica: limits checked before work, tokenizing, and
one `SamplingParams` per choice; plus the logprob entries of an output as the protocol carries them.

`Refused` is a 400 the replica answers before the engine sees the request. The `param` of a prompt that does
not fit is `messages` on chat and `prompt` on completions, as OpenAI names it.
"""

from __future__ import annotations

from typing import Any, Optional

from deployments.data_plane.protocol import GenerateRequest, PromptBound

__all__ = ["Refused", "PromptShaper", "too_long", "measure_bound"]

# A tokenizer with a normalizer may merge characters before it splits text into tokens (NFC composes a letter and
# its accents): its bound allows this many characters of input for each character a token stands for.
NORMALIZER_SLACK = 4


class Refused(Exception):
    """A request the replica refuses before any work: (code, message, param) of a 400."""

    def __init__(self, code: str, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.code, self.param = code, param


def prompt_param(req: GenerateRequest) -> str:
    return "messages" if req.messages is not None else "prompt"


def too_long(req: GenerateRequest, max_len: int, prompt_len: int, wanted: int, param: Optional[str] = None) -> Refused:
    """vLLM's context_length_exceeded refusal."""
    return Refused("context_length_exceeded",
                   f"This model's maximum context length is {max_len} tokens. However, you requested "
                   f"{prompt_len + wanted} tokens ({prompt_len} in the messages, {wanted} in the completion). "
                   f"Please reduce the length of the messages or completion.", param or prompt_param(req))


def measure_bound(tokenizer: Any, max_model_len: int) -> PromptBound:
    """The bound of `tokenizer`: its longest token in characters (a byte-level token's string has one character
    a byte, never fewer than the text it stands for), times NORMALIZER_SLACK when a normalizer runs first."""
    if tokenizer is None:  # token ids only: one id a token
        return PromptBound(max_model_len, 1)
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    slack = 1 if backend is not None and backend.normalizer is None else NORMALIZER_SLACK
    return PromptBound(max_model_len, max(1, longest) * slack)


class PromptShaper:
    """Turns a `GenerateRequest` into (token ids, SamplingParams) per choice for an engine with this tokenizer
    and context length."""

    def __init__(self, tokenizer: Any, max_model_len: int):
        self.tokenizer, self.max_len = tokenizer, max_model_len
        self.bound = measure_bound(tokenizer, max_model_len)

    @property
    def max_chars(self) -> int:
        return self.bound.max_chars

    def tokenize(self, req: GenerateRequest) -> list[list[int]]:
        """Each prompt's token ids; run it off the event loop. Raises Refused before tokenizing a prompt whose
        length alone shows it cannot fit (the ingress checks the same bound first)."""
        tok = self.tokenizer
        why = self.bound.refusal(req)
        if why is not None:
            raise Refused("context_length_exceeded", why, prompt_param(req))
        if req.messages is not None:
            ids = tok.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):  # transformers may return a BatchEncoding
                ids = ids["input_ids"]
            return [[int(t) for t in ids]]
        out = []
        for prompt in req.inputs():
            if isinstance(prompt, str):
                if tok is None:
                    raise Refused("invalid_request", "this model has no tokenizer: send token ids", "prompt")
                out.append([int(t) for t in tok(prompt)["input_ids"]])
            else:
                out.append([int(t) for t in prompt])
        return out

    def params(self, req: GenerateRequest, prompt_len: int, sample: int):
        """SamplingParams of one choice; max_tokens beyond the remaining context is a 400 (like vLLM's) when the
        client asked for it, and cut to the room left when it is the default."""
        from engine_ext import SamplingParams

        sampling = dict(req.sampling)
        wanted = int(sampling["max_tokens"])
        room = self.max_len - prompt_len
        if room < 1 or (wanted > room and req.max_tokens_explicit):
            raise too_long(req, self.max_len, prompt_len, wanted, "max_tokens" if room >= 1 else None)
        sampling["max_tokens"] = min(wanted, room)
        if sampling.get("seed") is not None and sample:  # n > 1: distinct, reproducible samples
            sampling["seed"] = (sampling["seed"] + sample) % 2**64
        return SamplingParams(**sampling)

    def logprob_entries(self, out) -> Optional[list]:
        """[token text, logprob, [[text, logprob], ...]] per new token of `out` (deployments.data_plane.protocol)."""
        if out.new_logprobs is None:
            return None
        tok = self.tokenizer
        text = (lambda t: tok.decode([t])) if tok is not None else str  # noqa: E731
        clamp = lambda v: max(v, -9999.0)  # noqa: E731 - JSON has no -inf
        return [[text(e.token_id), clamp(e.logprob), [[text(t), clamp(v)] for t, v in e.top]]
                for e in out.new_logprobs]
