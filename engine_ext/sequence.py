"""One request's state as the scheduler and engine see it."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from typing import Any

import torch

from .batch import SeqWork
from .block_manager import BlockTable
from .sampling_params import SamplingParams

_arrival = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's log-probability and the `params.logprobs` most likely tokens' (raw logits)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    block_table: list[int] = field(default_factory=BlockTable)  # (block_manager.py: mirrored for the packer)
    num_computed: int = 0  # positions whose KV is in the cache and final (written by the adapter-on model)
    finish_reason: str | None = None  # set when it ends (it may still be in a step queued on the device)
    seed: int = 0  # the key of its sampling noise: params.seed, or drawn by the engine when it arrived
    text: Any = field(default=None, repr=False)  # its detokenizer.TextState, where the engine detokenizes
    num_emitted_tokens: int = 0  # tokens already handed to the caller
    logits: list[torch.Tensor] = field(default_factory=list)  # only with params.return_logits
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # only with params.logprobs
    arrival: int = field(default_factory=lambda: next(_arrival))
    # A sequence with the same prompt and adapter (another sample of one request) whose prompt KV blocks this
    # one takes over at admission instead of computing them again (Scheduler._share_prompt).
    prompt_source: Sequence | None = field(default=None, repr=False)
    # Prefix caching (prefix_cache.py): the chain root of its adapter version (None: caching off), the chain hashes
    # of its first full blocks (tokens only: they outlive a preemption), and how many leading blocks of its table
    # are filed in the cache or were found there
    cache_root: bytes | None = field(default=None, repr=False)
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    num_cached_blocks: int = 0
    # The step queued on the device that holds it and has not been read (engine_ext.flight.Flight), its row there,
    # and (at least, at most) the tokens that step commits for it once read ((0, 0): none queued)
    flight: Any = field(default=None, repr=False)
    flight_row: int = -1
    pending: tuple[int, int] = (0, 0)

    def __post_init__(self) -> None:
        # Its parameters' per-row needs, read by every step (params do not change once a request is in)
        p = self.params
        self.adjusts_logits = p.adjusts_logits
        self.plain_row = p.temperature == 0 and not p.needs_rows and not self.adjusts_logits  # argmax, nothing kept

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def ended(self) -> bool:
        """It ended (finished, or ended on a token read while a step queued after it still writes its blocks)."""
        return self.finish_reason is not None

    @property
    def last_token(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_prefill(self) -> bool:
        return self.num_tokens - self.num_computed > 1

    def tokens_left(self, max_model_len: int) -> int:
        """Tokens it may still generate before max_tokens or the context limit ends it, beyond those a queued step
        commits at least."""
        lo = self.pending[0]
        return min(self.params.max_tokens - len(self.output_token_ids), max_model_len - self.num_tokens) - lo

    def work(self, lora_slot: int, extra: list[int] = (), num_logits: int = 1) -> SeqWork:
        """Its share of a forward: every position not yet in the cache, plus `extra` tokens after them."""
        return SeqWork(token_ids=self.token_ids[self.num_computed :] + list(extra), start=self.num_computed,
                       block_table=self.block_table, lora_slot=lora_slot, num_logits=num_logits)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    # The sequence's own list of generated tokens (it only grows), read up to num_token_ids: `token_ids` is every
    # token generated up to this output, without a copy per output
    output_token_ids: list[int] = field(repr=False)
    num_token_ids: int
    text: str
    new_token_ids: list[int]  # generated since the previous output of this request
    delta_text: str
    finished: bool
    finish_reason: str | None
    adapter: str | None = None
    logits: torch.Tensor | None = None  # [len(token_ids), vocab] with params.return_logits
    new_logprobs: list[TokenLogprobs] | None = None  # with params.logprobs: one per new_token_ids entry
    logprobs: list[TokenLogprobs] | None = None  # with params.logprobs, on the finished output: one per token_ids

    @property
    def token_ids(self) -> list[int]:
        """Every token generated up to this output."""
        return self.output_token_ids[: self.num_token_ids]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
