"""Speculative LoRA-off drafting: the base model drafts, one adapter-on pass verifies.

- `gate.py`: the per-step plan (plain step or cycle, draft lengths): the shell the engine calls, over
  `policy.py` (the decision, a pure function of named states) and `estimator.py` (pass costs as the overlapped
  loop spends them, and acceptance), with `pricing.py`'s arithmetic;
- `plan.py`: a step as data (which rows run in which forward, where each input comes from), pure;
- `cycle.py`: what a cycle makes of each sequence of the batch (the planner's rows);
- `verify.py`: acceptance of drafts;
- `acceptance.py`, `cost.py`: per-adapter acceptance estimates and measured pass times (the estimator's records).
The executor that runs every step's plan, plain or speculative, is engine_ext/executor.py."""

from .gate import Decision, Gate, NoSpeculation, Plan, StepResult

__all__ = ["Decision", "Gate", "NoSpeculation", "Plan", "StepResult"]
