"""What the ingress sends an LLM replica, and the chunks a replica streams back.

Chunks are plain dicts (cheap to pickle through Ray), in this order:
  {"type": "start", "replica", "adapter_hit", "load_s", "started_at", "prompt_tokens", "num_running"}
  {"type": "delta", "index", "text", "num_tokens", "logprobs"}      zero or more, any choice's
      logprobs: None, or one [token text, logprob, [[text, logprob], ...top]] per token of the delta
  {"type": "end", "finish_reason" (choice 0's), "completion_tokens" (all choices'), "finish_reasons": {index: reason},
   "choice_tokens": {index: n}, "prompt_tokens", "snapshot"}
or at any point {"type": "error", "status", "code", "message"[, "param"][, "retry_after_s"]} as the last chunk.
A request has `len(inputs()) * n` choices; choice `i * n + j` is sample j of prompt i.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from router.prefixes import prefix_fingerprint

__all__ = ["CHARS", "TOKENS", "GenerateRequest", "PromptBound", "ReplicaUnavailable", "error_chunk"]


class ReplicaUnavailable(Exception):
    """The replica, or the transport to it, failed (not the request): it may be retried on another replica."""


@dataclass
class GenerateRequest:
    request_id: str
    adapter_key: Optional[str]  # "name@version" (router.AdapterKey) as resolved by the ingress; None: base model
    sampling: dict[str, Any]  # engine SamplingParams fields
    prompt: Optional[str] = None
    prompt_token_ids: Optional[list[int]] = None
    messages: Optional[list[dict[str, str]]] = None  # chat: the replica applies the chat template
    prompts: Optional[list[Union[str, list[int]]]] = None  # several prompts (completions), each text or ids
    n: int = 1  # samples per prompt
    max_tokens_explicit: bool = True  # False: a default, cut to the room the context leaves instead of a 400
    submitted_at: float = 0.0  # ingress wall clock, for queue time
    labels: dict[str, str] = field(default_factory=dict)
    adapter_record: Any = None  # the registry's AdapterRecord the ingress resolved: the replica loads from it
    # router.prefixes.prefix_fingerprint of the prompt (None: too short): the router prefers the replica that was last
    # sent the same prefix for this adapter version, whose prefix cache likely holds it
    prefix_fingerprint: Optional[str] = None

    def __post_init__(self) -> None:
        given = sum(x is not None for x in (self.prompt, self.prompt_token_ids, self.messages, self.prompts))
        if given != 1:
            raise ValueError("exactly one of prompt, prompt_token_ids, messages, prompts")
        if self.n < 1 or (self.prompts is not None and not self.prompts):
            raise ValueError("n >= 1 and at least one prompt")
        if self.prefix_fingerprint is None:
            head = self.messages if self.messages is not None else self.inputs()[0]
            self.prefix_fingerprint = prefix_fingerprint(head)

    def inputs(self) -> list[Union[str, list[int]]]:
        """The completion prompts (text or token ids); chat requests have none (see `messages`)."""
        if self.prompts is not None:
            return list(self.prompts)
        return [self.prompt if self.prompt is not None else self.prompt_token_ids] if self.messages is None else []

    @property
    def num_choices(self) -> int:
        return max(1, len(self.inputs())) * self.n


CHARS, TOKENS = "chars", "tokens"  # the units a prompt's length is counted in (PromptBound.excess)


@dataclass(frozen=True)
class PromptBound:
    """The longest prompt a replica could take, as the ingress can check it without a tokenizer: no token of the
    replica's tokenizer stands for more than `chars_per_token` characters of text, so a prompt of more than
    `max_model_len * chars_per_token` characters needs more tokens than the context holds. The replica measures
    it from its tokenizer (`deployments.replica.prompts.measure_bound`); the ingress asks a replica for it once."""

    max_model_len: int  # tokens of context: the prompt's and the completion's
    chars_per_token: int  # the most characters of text one token stands for

    @property
    def max_chars(self) -> int:
        return self.max_model_len * self.chars_per_token

    def refusal(self, req: GenerateRequest) -> Optional[str]:
        """Why `req`'s prompt cannot fit, or None when its length alone does not show it."""
        return self.refusal_of(messages=req.messages, prompts=req.inputs())

    def refusal_of(self, messages: Optional[list[dict]] = None, prompt: Optional[str] = None,
                   prompt_token_ids: Optional[list[int]] = None, prompts: Optional[list] = None) -> Optional[str]:
        """`refusal` of a request's prompt fields (GenerateRequest's names)."""
        over = self.excess(messages, prompt, prompt_token_ids, prompts)
        return None if over is None else self.refusal_for(*over)

    def excess(self, messages: Optional[list[dict]] = None, prompt: Optional[str] = None,
               prompt_token_ids: Optional[list[int]] = None, prompts: Optional[list] = None
               ) -> Optional[tuple[str, int]]:
        """(unit, count) of the first prompt whose length alone shows it cannot fit: `CHARS` of text or `TOKENS`
        (token ids); None when none does."""
        if messages is not None:
            counts = [(CHARS, sum(len(m.get("content") or "") for m in messages))]
        else:
            counts = [(CHARS if isinstance(one, str) else TOKENS, len(one))
                      for one in prompts or [prompt if prompt is not None else prompt_token_ids]]
        return next(((unit, n) for unit, n in counts if not self.fits(unit, n)), None)

    def fits(self, unit: str, count: int) -> bool:
        """Whether a prompt of `count` `unit`s may fit (the replica's tokenizer decides)."""
        if unit == TOKENS:
            return count < self.max_model_len  # the engine needs room for one completion token
        return count <= self.max_chars

    def refusal_for(self, unit: str, count: int) -> Optional[str]:
        """Why a prompt of `count` `unit`s cannot fit, or None when that count alone does not show it."""
        if self.fits(unit, count):
            return None
        if unit == TOKENS:
            return f"the prompt has {count} tokens: this model's maximum context length is {self.max_model_len} tokens"
        return (f"the prompt has {count} characters: more than this model's maximum context length of "
                f"{self.max_model_len} tokens can hold (at most {self.chars_per_token} characters a token)")


def error_chunk(status: int, code: str, message: str, param: Optional[str] = None,
                retry_after_s: Optional[float] = None) -> dict[str, Any]:
    chunk = {"type": "error", "status": status, "code": code, "message": message}
    if param is not None:
        chunk["param"] = param
    if retry_after_s is not None:
        chunk["retry_after_s"] = retry_after_s
    return chunk
