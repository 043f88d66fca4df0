"""What an automatic rollout is told: its traffic steps, its analysis window, the thresholds a canary version is
held to against the stable version of the same adapter, and the golden prompts registered with a version.

Every field has a default and every threshold is settable; a policy that no version could pass (a latency ratio
below 1 fails a canary identical to its stable version, a rate outside [0, 1], steps that do not rise) is refused
when it is built, so a bad policy is a 422 before anything changes.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal, Optional

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator,
                      model_validator)

__all__ = ["Thresholds", "RolloutPolicy", "GoldenPrompt", "GoldenMessage", "golden_failure", "MAX_GOLDEN"]

MAX_GOLDEN = 32  # golden prompts per version: each is run before the first step and at every step
Number = StrictFloat | StrictInt


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Thresholds(_Strict):
    """How far a canary may be from the stable version over the same window before it is rolled back.
    Rates are absolute differences (canary - stable); latencies and output length are ratios to the stable
    version's value plus an absolute allowance, so that a few milliseconds or tokens of noise never decide."""

    max_error_rate_increase: Number = Field(0.02, ge=0, le=1, description="errors per request (replica faults)")
    max_refusal_rate_increase: Number = Field(0.05, ge=0, le=1, description="requests the engine refused")
    ttft_p50_ratio: Number = Field(1.5, ge=1, description="canary TTFT p50 <= ratio x stable's + latency_slack_s")
    ttft_p99_ratio: Number = Field(2.0, ge=1)
    tpot_p50_ratio: Number = Field(1.5, ge=1, description="time per output token after the first")
    tpot_p99_ratio: Number = Field(2.0, ge=1)
    latency_slack_s: Number = Field(0.05, ge=0, description="absolute allowance on every latency comparison")
    output_length_ratio: Number = Field(1.5, ge=1, description="mean completion tokens within stable's / ratio .. "
                                        "x ratio, give or take output_length_slack")
    output_length_slack: Number = Field(2.0, ge=0, description="tokens")
    max_finish_reason_shift: Number = Field(0.2, ge=0, le=1, description="total variation distance between the "
                                            "versions' shares of finish reasons (stop, length, ...)")
    max_acceptance_drop: Number = Field(0.15, ge=0, le=1, description="stable's draft acceptance - canary's: the "
                                        "base model's drafts are a fingerprint of how a version answers")
    max_acceptance_rise: Number = Field(0.15, ge=0, le=1, description="canary's draft acceptance - stable's: the "
                                        "fingerprint moves either way when a version answers differently (one that "
                                        "repeats itself is drafted almost perfectly); 1: a rise never fails")
    min_drafted_tokens: StrictInt = Field(32, ge=1, description="drafted tokens each version needs in the window "
                                          "before acceptance is compared (speculation may be gated off)")
    require_draft_acceptance: StrictBool = Field(False, description="true: a window stays open until each version "
                                                 "has min_drafted_tokens drafts, so the acceptance is always compared "
                                                 "(one that cannot get them by step_timeout_s rolls back); false: a "
                                                 "window without them is judged on the other checks")


class RolloutPolicy(_Strict):
    """Traffic steps, the analysis window of each, and the thresholds. After the last step passes, the canary is
    promoted; a step that fails (or golden prompts that fail) rolls it back."""

    steps: list[Number] = Field(default_factory=lambda: [0.05, 0.25, 0.5], min_length=1, max_length=20,
                                description="canary weights, rising, each in (0, 1)")
    window_requests: StrictInt = Field(100, ge=0, description="canary requests a step's window needs (0: no bound)")
    window_s: Number = Field(60.0, ge=0, description="seconds a step's window lasts at least (0: no bound)")
    min_stable_requests: StrictInt = Field(10, ge=1, description="stable requests in the window to compare with")
    step_timeout_s: Number = Field(3600.0, gt=0, description="a window that has not filled by then rolls back: "
                                   "the canary could not be judged")
    thresholds: Thresholds = Field(default_factory=Thresholds)

    @field_validator("steps")
    @classmethod
    def _rising(cls, steps: list[float]) -> list[float]:
        if any(not (0.0 < w < 1.0) for w in steps):
            raise ValueError(f"every step is a canary weight in (0, 1), got {steps}")
        if any(b <= a for a, b in zip(steps, steps[1:])):
            raise ValueError(f"steps must rise strictly, got {steps}")
        return [float(w) for w in steps]

    @model_validator(mode="after")
    def _closable(self) -> "RolloutPolicy":
        if self.window_requests == 0 and self.window_s == 0:
            raise ValueError("a window needs window_requests or window_s (or both) above 0")
        if self.window_s >= self.step_timeout_s:
            raise ValueError(f"window_s ({self.window_s}) must be below step_timeout_s ({self.step_timeout_s}): "
                             f"every step would time out")
        return self


class GoldenMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: StrictStr = Field(max_length=20_000)


class GoldenPrompt(_Strict):
    """A prompt (completion text, or chat messages) and what its greedy answer must be: exactly `exact`, a match
    of the regular expression `regex` (searched, anchor it with ^...$ for the whole answer), or a JSON document
    valid against `json_schema`."""

    prompt: Optional[StrictStr] = Field(None, max_length=20_000)
    messages: Optional[list[GoldenMessage]] = Field(None, min_length=1, max_length=32)
    max_tokens: StrictInt = Field(32, ge=1, le=1024)
    exact: Optional[StrictStr] = None
    regex: Optional[StrictStr] = Field(None, max_length=2000)
    json_schema: Optional[dict[str, Any]] = None

    @model_validator(mode="after")
    def _one_each(self) -> "GoldenPrompt":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("a golden prompt has exactly one of prompt, messages")
        if sum(x is not None for x in (self.exact, self.regex, self.json_schema)) != 1:
            raise ValueError("a golden prompt expects exactly one of exact, regex, json_schema")
        if self.regex is not None:
            try:
                re.compile(self.regex)
            except re.error as e:
                raise ValueError(f"regex {self.regex!r} does not compile: {e}") from None
        if self.json_schema is not None:
            from jsonschema import Draft202012Validator, SchemaError

            try:
                Draft202012Validator.check_schema(self.json_schema)
            except SchemaError as e:
                raise ValueError(f"json_schema is not a valid JSON schema: {e.message}") from None
        return self

    def shown(self) -> str:
        """The prompt in a few words, for reasons in the audit log."""
        text = self.prompt if self.prompt is not None else self.messages[-1].content
        return text if len(text) <= 60 else text[:57] + "..."


def golden_failure(golden: GoldenPrompt, answer: str) -> Optional[str]:
    """Why `answer` fails `golden`, or None when it passes."""
    if golden.exact is not None:
        return None if answer == golden.exact else f"expected exactly {golden.exact[:80]!r}, got {answer[:80]!r}"
    if golden.regex is not None:
        return None if re.search(golden.regex, answer) else f"no match of /{golden.regex[:80]}/ in {answer[:80]!r}"
    from jsonschema import Draft202012Validator

    try:
        doc = json.loads(answer)
    except ValueError:
        return f"not JSON: {answer[:80]!r}"
    error = next(iter(Draft202012Validator(golden.json_schema).iter_errors(doc)), None)
    return None if error is None else f"JSON not valid against the schema: {error.message[:120]}"
