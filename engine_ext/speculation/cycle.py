"""One step of speculative LoRA-off drafting, as planner rows: what the gate's plan (gate.Plan) makes of each
sequence of the batch. The executor (engine_ext/executor.py) runs the rows' plan (plan.py) like any step.

The base model (every adapter switched off) drafts up to m tokens for each adapter sequence in up to
M = max m batched passes, writing its KV into the sequence's own paged cache; then one adapter-on pass over
[last, d1..dm] verifies them, overwriting the drafted positions' KV with the adapter-conditioned values before
anything reads them, and the target's tokens are committed up to the first that differs from its draft
(verify.py: exactly plain decoding's tokens, greedy or sampled). Rejected positions are released by truncating
the block table. A rider needs no verification: each drafting pass is an exact decoding step for it. Riders are
the base-only sequences and the adapter sequences the gate lets ride (`Gate.rides`), whose rows in the drafting
passes run with their adapter on.

Prompts do not wait for the verify pass: a prompt in the batch (a new request, or a preempted one computing its
tokens again), and one that arrives while the cycle drafts (`join`), runs in the first drafting pass with room
for it, with its adapter on, and its first token is handed out as soon as the device has run that pass. In the
passes after it, it drafts like any adapter sequence (from its first token, verified in the verify pass), or rides
when it is base-only or its adapter rides (`Gate.prompt_drafts`). Requests whose tokens need the host's copy of
their history to be drawn (penalties, logit bias) neither draft nor ride: their tokens come from the verify pass,
one per step, and their prompts run there too."""

from __future__ import annotations

from ..sequence import Sequence
from .gate import Plan
from .plan import Kind, Row

_PLAIN = Row(Kind.PLAIN)


def decoding_row(s: Sequence, length: int, ride: bool, speculate: bool, max_model_len: int) -> Row:
    """A decoding sequence's row: it drafts `length`, rides, or (a plain step, or a request that cannot ride) takes
    one token from the verify pass."""
    if length > 0:
        return Row(Kind.DRAFT, drafts=length, left=s.tokens_left(max_model_len))
    if speculate and ride and not s.params.adjusts_logits:
        return Row(Kind.RIDE, left=s.tokens_left(max_model_len))
    return _PLAIN  # (one token from the verify pass: its tokens left bound nothing)


def prompt_row(plan: Plan, s: Sequence, max_model_len: int) -> Row:
    """A prompt's row: the drafts it may make after its first token (`Gate.prompt_drafts`, or none in a plain
    step); one whose tokens are drawn from the host's history (penalties, logit bias) runs in the verify pass only."""
    return Row(Kind.PROMPT, drafts=plan.prompt_drafts(s) if plan.speculate else 0, left=s.tokens_left(max_model_len),
               need=s.num_tokens - s.num_computed, late=s.params.adjusts_logits)


def rows_for(plan: Plan, max_model_len: int) -> list[Row]:
    """Every sequence of the plan's batch, in batch order."""
    return [prompt_row(plan, s, max_model_len) if s.is_prefill
            else decoding_row(s, m, r, plan.speculate, max_model_len)
            for s, m, r in zip(plan.seqs, plan.lengths, plan.ride)]
