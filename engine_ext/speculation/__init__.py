"""Speculative LoRA-off drafting: the base model drafts, one adapter-on pass verifies.

- `gate.py`: the per-step plan (plain step or cycle, draft lengths) and its cost model;
- `cycle.py`: the drafting passes, the verify pass and settling the tokens;
- `verify.py`: acceptance of drafts, greedy and by rejection sampling (pure functions);
- `acceptance.py`, `cost.py`: per-adapter acceptance estimates and measured pass times."""

from .cycle import DraftCycle
from .gate import Decision, Gate, NoSpeculation, Plan, StepResult

__all__ = ["Decision", "DraftCycle", "Gate", "NoSpeculation", "Plan", "StepResult"]
