"""Per-request sampling parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .errors import InvalidParameterError

MAX_LOGPROBS = 20  # most alternatives a request may ask for per token


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0  # drop tokens below min_p * the most likely token's probability; 0: off
    # Logit adjustments, applied in this order before temperature (sampler.adjust_logits):
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    repetition_penalty: float = 1.0  # tokens of prompt or output: logit / rp if > 0 else logit * rp; 1: off
    frequency_penalty: float = 0.0  # logit -= frequency_penalty * count in the output
    presence_penalty: float = 0.0  # logit -= presence_penalty if in the output
    # None: off; k >= 0: each generated token's log-probability under the model (log_softmax of the raw
    # adapter-on logits, before any adjustment or temperature) and the k most likely tokens'.
    logprobs: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Debug/oracle aid: keep the next-token logits of every generated position on the output.
    return_logits: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if any(k < 0 for k in self.logit_bias) or any(not -100.0 <= v <= 100.0 for v in self.logit_bias.values()):
            raise ValueError("logit_bias maps token ids >= 0 to values in [-100, 100]")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def adjusts_logits(self) -> bool:
        """Logits depend on the tokens so far (penalties) or are shifted (bias) before sampling."""
        return bool(self.logit_bias) or self.repetition_penalty != 1.0 or bool(self.frequency_penalty) \
            or bool(self.presence_penalty)

    @property
    def can_draft(self) -> bool:
        """Speculative drafting applies: the target distribution is a function of the raw logits alone and no
        per-token row is returned. Other requests draft nothing and take their token from the verify pass, whose
        logits are plain decoding's."""
        return not self.adjusts_logits and self.logprobs is None

    @property
    def needs_rows(self) -> bool:
        """The output processor needs each generated position's logits row."""
        return self.return_logits or self.logprobs is not None

    @property
    def greedy(self) -> bool:
        """The token is the argmax of the raw logits and nothing else of the row is needed: the paths that keep
        only a device-side argmax (the greedy speculative cycle, greedy verification) rely on exactly this."""
        return self.temperature == 0.0 and self.can_draft

    def check_vocab(self, vocab_size: int) -> None:
        if self.logit_bias and max(self.logit_bias) >= vocab_size:
            raise InvalidParameterError("logit_bias", f"logit_bias token ids must be in [0, {vocab_size})")
