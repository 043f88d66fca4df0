"""What each pass costs in the overlapped loop, and how well each adapter's drafts are accepted: the estimates the
gate's policy (policy.py) reads, fed by every step's measurements (gate.StepResult).

The loop launches a step while the device runs the one before it, so a step costs about the larger of its device
time and the host work the device does not hide, plus what a run of such steps loses beyond both (its gap):
    plain step  max(plain device, plain host) + plain gap
    cycle       max(M x base + verify, cycle host) + cycle gap     (M drafting passes; host at most M + 1 plain steps')
Device times are the passes' own spans on the device timeline (a plain step's from its packed forward: runs of plain
steps hide their packing, cycles do not), kept per pass kind and size (cost.StepTimes); host times are the steps' own
host work (`StepResult.host_s`), kept per batch size. A gap is a step's period (`StepResult.period_s`: from the end of
the step before it to its own end on the device timeline) beyond the larger of the two, measured on a step read right
after one of its own kind (a run's steady cost; a switch between kinds is not what either kind costs in a run), per
batch size: the device's idle time between a run's steps and its work outside the forwards' spans (on the H200, 1B,
8 sequences: cycles took 6.6 ms launch to launch against 5.9 ms of spans and 4.8 ms of host work). Launch-to-launch
`seconds` would not do: a step's next launch follows the read of the step before it, so in a device-bound run it holds
that step's device time, not its own. A step measured without them (a plain step with no "plain" pass,
or host_s = 0) is priced by its launch-to-launch `seconds`: a plain step at that whole time, and the rest of a cycle's
`seconds` beyond its passes as an overhead added to its device time."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .acceptance import AdapterAcceptance
from .cost import StepTimes

if TYPE_CHECKING:
    from .gate import Plan, StepResult


class Estimator:
    """Pass costs (`plain`, `cycle`, `verify_slope`) and per-adapter acceptance (`acceptance`, `idle_steps`,
    `batch_acceptance`) from measurements (`observe`). Its queries change nothing: the policy reads them as data."""

    SHRINK_DRAFTS = 16.0  # judged drafts of the batch's pooled acceptance added to each estimate (closed batches)
    EVIDENCE = 8.0  # judged drafts every adapter of a closed batch needs before its slowest sequence prices it
    LAGGARD = 0.1  # how far below the pooled acceptance an estimate must be for its sequence to price the batch

    def __init__(self, initial_acceptance: float = 0.8, acceptance_ema: float = 0.1):
        self.times = StepTimes()
        self.initial_acceptance = initial_acceptance
        self.acceptance_ema = acceptance_ema
        self.adapters: dict[str, AdapterAcceptance] = {}
        self._cycles: dict[tuple[int, int, int, int, int], tuple[float, float] | None] = {}  # `cycle`'s answers
        self._cycles_at = 0  # ... as of this many StepTimes records
        self._last_kind: str | None = None  # the step read before: "cycle", "plain" (all decoding) or None

    # ------------------------------------------------------------ measurements
    def adapter(self, name: str) -> AdapterAcceptance:
        """Its acceptance record, made at the prior on first use."""
        if name not in self.adapters:
            self.adapters[name] = AdapterAcceptance(ema=self.initial_acceptance)
        return self.adapters[name]

    def observe(self, plan: Plan, result: StepResult, seconds: float, timed: bool = True) -> bool:
        """A step read: acceptance from its verifies, and (when `timed`) its pass and host times. A plain step is
        timed only when every sequence in it decoded (prompts price no plain decoding), a pass that ran prompts
        ("prompted") never, and a cycle's host time only when none of its passes did. True when the step's times
        were recorded."""
        for name, drafted, accepted in result.verifies:
            self.adapter(name).observe(drafted, accepted, self.acceptance_ema)
        after, self._last_kind = self._last_kind, self._kind(plan, result)
        if not timed:
            return False
        if plan.speculate:
            self._observe_cycle(len(plan.seqs), result, seconds, after == "cycle")
            return True
        if not plan.decoding or plan.decoding != len(plan.seqs):
            return False
        self._observe_plain(plan, result, seconds, after == "plain")
        return True

    @staticmethod
    def _kind(plan: Plan, result: StepResult) -> str | None:
        """What a step was, for the gap of the one read after it: a cycle or a plain step of decoding rows with no
        prompt in its passes (None: any other)."""
        if any(p[0] == "prompted" for p in result.passes):
            return None
        if plan.speculate:
            return "cycle"
        return "plain" if plan.decoding and plan.decoding == len(plan.seqs) else None

    def _gap(self, kind: str, n: int, device: float, host: float, period: float) -> None:
        """A step's period beyond the larger of its device and host time, within half of it either way (a one-off
        stall, a collection, is not what the next steps lose). Kept signed (a host-bound step's period is about its
        host time, give or take): `gap` clips the estimate, not each sample, so noise does not add up to a cost."""
        busy = max(device, host)
        self.times.record(kind, n, 0, min(max(period - busy, -0.5 * busy), 0.5 * busy))

    def gap(self, kind: str, n: int) -> float:
        """The loop's gap for a step of this kind ("plain_gap", "cycle_gap") and size: 0 until measured, never
        below it."""
        return max(0.0, self.times.get(kind, n, 0) or 0.0)

    def _observe_cycle(self, n: int, result: StepResult, seconds: float, in_run: bool) -> None:
        for kind, tokens, adapters, spent in result.passes:
            if kind in ("base", "lora"):
                self.times.record(kind, tokens, adapters, spent)
        if any(p[0] == "prompted" for p in result.passes):
            return  # the host work of its prompts (and their first tokens) prices no decoding, as in a plain step
        if result.host_s > 0:
            self.times.record("cycle_host", n, 0, result.host_s)
            if in_run and result.period_s > 0:
                self._gap("cycle_gap", n, sum(p[3] for p in result.passes), result.host_s, result.period_s)
        else:  # measured without host time: the rest of the step beyond its passes, paid on top of them
            self.times.record("overhead", n, 0, max(0.0, seconds - sum(p[3] for p in result.passes)))

    def _observe_plain(self, plan: Plan, result: StepResult, seconds: float, in_run: bool) -> None:
        device = [p[3] for p in result.passes if p[0] == "plain"]
        spent = sum(device) if device else seconds  # no device span: the whole step, launch to launch
        self.times.record("plain", plan.decoding, plan.distinct, spent, replace=plan.remeasure)
        if result.host_s > 0:
            self.times.record("plain_host", plan.decoding, 0, result.host_s)
            if in_run and device and result.period_s > 0:
                self._gap("plain_gap", plan.decoding, spent, result.host_s, result.period_s)

    def note_idle(self, adapters: list[str], lengths: list[int] | None) -> None:
        """After a step is planned: the adapters that draft nothing in it (every one, in a plain step; in a cycle,
        one whose sequences are a token from their end) count it towards their re-measure (`idle_steps`)."""
        drafting = set() if lengths is None else {n for n, m in zip(adapters, lengths) if m}
        for name in set(adapters) - drafting:
            self.adapter(name).idle_steps += 1

    # ------------------------------------------------------------ pass costs in the loop
    def plain(self, n: int, distinct: int, exact: bool = False) -> float | None:
        """Seconds of a plain step of n sequences reading `distinct` adapters: max(device, host) + gap. `exact`: None
        unless plain steps of this size were measured (StepTimes.get)."""
        device = self.times.get("plain", n, distinct, exact=exact)
        if device is None:
            return None
        return max(device, self.times.get("plain_host", n, 0) or 0.0) + self.gap("plain_gap", n)

    def cycle(self, n: int, passes: int, tokens: int, distinct: int, riding: int) -> tuple[float, float] | None:
        """(device, host) seconds of a cycle of n sequences, each with the loop's gap: `passes` drafting passes
        (reading `riding` adapters) and a verify pass of `tokens` tokens over `distinct` adapters; None while a pass
        kind is unmeasured. Its host time, before a cycle's is measured, is at least a plain step's."""
        if self._cycles_at != self.times.records:
            self._cycles.clear()
            self._cycles_at = self.times.records
        key = (n, passes, tokens, distinct, riding)
        if key not in self._cycles:
            self._cycles[key] = self._cycle(n, passes, tokens, distinct, riding)
        return self._cycles[key]

    def _cycle(self, n: int, passes: int, tokens: int, distinct: int, riding: int) -> tuple[float, float] | None:
        t_base, t_verify = self.times.get("base", n, riding), self.verify(tokens, distinct)
        if t_base is None or t_verify is None:
            return None
        # the loop's gap is paid whichever of the two bounds the cycle: it is added to both
        gap = self.gap("cycle_gap", n)
        device = (self.times.get("overhead", n, 0) or 0.0) + passes * t_base + t_verify + gap
        host, plain_host = self.times.get("cycle_host", n, 0), self.times.get("plain_host", n, 0)
        if host is None:
            return device, (plain_host or 0.0) + gap
        # A cycle's host work is at most a plain step's per forward (a drafting pass is packed, or relaunched, and
        # sampled like one; the scheduling and reading happen once): a bucket measured once, high by a one-off
        # stall (a collection, a first compile), would otherwise price every cycle of that size at it, and cycles
        # there would never run again to re-measure it.
        return device, (min(host, (passes + 1) * plain_host) if plain_host else host) + gap

    def verify(self, tokens: int, distinct: int) -> float | None:
        """An adapter-on pass of `tokens` tokens: from the verify passes measured, else, before any cycle, the
        nearest plain step (optimistic for a larger pass: a decision it drives measures the size)."""
        t = self.times.get("lora", tokens, distinct)
        return t if t is not None else self.times.get("plain", tokens, distinct)

    def verify_slope(self, tokens: int, distinct: int) -> float:
        """Device seconds per verify token near `tokens` (0.0 until two sizes are measured)."""
        return self.times.slope("lora", tokens, distinct)

    # ------------------------------------------------------------ acceptance
    def _record(self, name: str) -> AdapterAcceptance:
        return self.adapters.get(name) or AdapterAcceptance(ema=self.initial_acceptance)

    def acceptance(self, name: str) -> float:
        return self._record(name).ema

    def idle_steps(self, name: str) -> int:
        return self._record(name).idle_steps

    def batch_acceptance(self, adapters: tuple[str, ...], left: tuple[int, ...] | None
                         ) -> tuple[list[float], tuple[int, ...] | None]:
        """Each sequence's acceptance (its adapter's estimate), and `left` again if the closed batch is priced by
        its slowest sequence (`pricing.cycle_rate`), else None. That takes a laggard: an estimate, pulled towards the
        batch's pooled one by SHRINK_DRAFTS judged drafts, still LAGGARD below it, once every adapter has EVIDENCE
        judged drafts. Without the shrinkage the slowest of many estimates of one acceptance is low by chance, and
        without the evidence bar one unlucky first draft prices the batch."""
        accs = [self._record(n) for n in adapters]
        if not left or min(a.judged_weight for a in accs) < self.EVIDENCE:
            return [a.ema for a in accs], None
        pooled = sum(a.accepted_weight for a in accs) / sum(a.judged_weight for a in accs)
        k = self.SHRINK_DRAFTS
        shrunk = [(a.accepted_weight + k * pooled) / (a.judged_weight + k) for a in accs]
        if min(shrunk) > pooled - self.LAGGARD:
            return [a.ema for a in accs], None
        return shrunk, left
