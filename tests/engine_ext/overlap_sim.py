"""A deterministic simulator of the engine's overlapped step loop, for the gate: it drives a plan source (Gate,
NoSpeculation) through Gate.plan / Gate.observe as LLMEngine.step does, on a simulated clock, and feeds it the
StepResults the engine measures (each pass's device span, the step's host work and period, launch-to-launch
seconds).

The loop, as the engine runs it: a step is scheduled and launched (half of its host work), then the step before it
is read (the device waited for, the other half), then the next step starts. The device runs a step's passes back
to back once it is launched and the step before it is done, so a step costs about max(device, host). Sequences move
when their step is launched (the simulator knows what it will accept); the gate reads a step's acceptance one step
late, as in the engine. Device and host costs are tables measured on the H200 (`H200_1B_R16`), interpolated in
batch size."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from engine_ext import SamplingParams
from engine_ext.scheduler import ScheduledBatch
from engine_ext.sequence import Sequence
from engine_ext.speculation import StepResult


@dataclass(frozen=True)
class LoopCosts:
    """Milliseconds. `base`, `plain`: a pass by batch size; `verify`: by batch size, the pass with k = 1, 2, ...
    drafts a sequence (k = 0 is the plain pass); host work of a plain step and of a cycle (plus per drafting pass);
    a prompt token's device time in the pass that runs it."""

    batches: tuple[int, ...]
    base: tuple[float, ...]
    plain: tuple[float, ...]
    verify: tuple[tuple[float, ...], ...]  # per batch: k = 1..4
    host_plain: float = 1.9
    host_cycle: float = 2.0
    host_per_pass: float = 0.1
    prompt_token: float = 0.004
    cycle_idle: float = 0.0  # device time a cycle loses outside its passes' spans (between passes, before the next)

    def _at(self, values, n: int) -> float:
        return float(np.interp(n, self.batches, values))

    def base_ms(self, n: int) -> float:
        return self._at(self.base, n)

    def plain_ms(self, n: int) -> float:
        return self._at(self.plain, n)

    def verify_ms(self, n: int, tokens: int) -> float:
        """A verify pass of n sequences and `tokens` tokens: interpolated in drafts per sequence (0: plain)."""
        per_batch = [float(np.interp(tokens / n - 1, range(5), (p, *v))) for p, v in zip(self.plain, self.verify)]
        return self._at(per_batch, n)


# Device passes at 1B, rank 16 (bench/decode.py --sections forward on the H200; base at batch 1 and 8 assumed from
# plain's share), host work per step ~1.9 ms (plain and base-only), a little more for a cycle.
H200_1B_R16 = LoopCosts(batches=(1, 8, 32), base=(1.12, 1.18, 1.31), plain=(1.23, 1.37, 1.71),
                        verify=((1.25, 1.26, 1.28, 1.29), (1.44, 1.51, 1.52, 1.63), (1.88, 2.04, 2.22, 2.56)))
# The same device, with host work the device hides (a device-bound loop)
H200_1B_R16_FAST_HOST = LoopCosts(batches=H200_1B_R16.batches, base=H200_1B_R16.base, plain=H200_1B_R16.plain,
                                  verify=H200_1B_R16.verify, host_plain=0.6, host_cycle=0.7, host_per_pass=0.05)
# 1B rank 64 at batch 32, k = 2..4 as measured; k = 1 measured 4.69 ms (a kernel path slower than k = 2's), here
# between plain's and k = 2's: priced from the nearest size measured, a cold gate that measured it first would
# price every longer cycle as dear and not try one
H200_1B_R64 = LoopCosts(batches=(1, 32), base=(1.12, 1.31), plain=(1.3, 2.88),
                        verify=((1.35, 1.36, 1.38, 1.40), (3.4, 3.62, 3.67, 3.70)))


@dataclass
class Traffic:
    """Requests: Poisson arrivals at `rate` per simulated second (0: all at once, a closed batch of `count`),
    prompt and output lengths uniform in their ranges, adapters with their drafts' acceptance (a None adapter:
    base-only)."""

    count: int = 200
    rate: float = 30.0
    prompt: tuple[int, int] = (64, 512)
    output: tuple[int, int] = (32, 256)
    adapters: dict[str | None, float] = field(default_factory=lambda: {"near": 1.0})


@dataclass
class Run:
    decisions: Counter = field(default_factory=Counter)
    cycles: int = 0
    plain_steps: int = 0  # plain steps with an adapter sequence decoding (the gate decided)
    seconds: float = 0.0
    tokens: int = 0
    spans: dict[str, list[float]] = field(default_factory=dict)  # per request: [its first token's time, its last's]
    outputs: dict[str, int] = field(default_factory=dict)  # per request: tokens out

    @property
    def cycle_share(self) -> float:
        decided = self.cycles + self.plain_steps
        return self.cycles / decided if decided else 0.0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds

    def tpot(self, q: float = 50) -> float:
        """Milliseconds per output token after the first, the q-th percentile over requests."""
        per = [(b - a) / (self.outputs[r] - 1) for r, (a, b) in self.spans.items() if self.outputs[r] > 1]
        return float(np.percentile(per, q)) * 1e3

    def note(self, seqs: list[Sequence], done: float) -> None:
        for s in seqs:
            self.spans.setdefault(s.request_id, [done, done])[1] = done
            self.outputs[s.request_id] = len(s.output_token_ids)


class _Sim:
    def __init__(self, gate, costs: LoopCosts, traffic: Traffic, seed: int, noise: float, legacy: bool):
        self.gate, self.costs, self.traffic, self.legacy = gate, costs, traffic, legacy
        self.rnd = random.Random(seed)
        self.noise = noise
        self.accept: dict[str, float] = {}
        self.arrivals = self._arrivals()
        self.running: list[Sequence] = []
        self.run = Run()

    def _arrivals(self) -> list[tuple[float, Sequence]]:
        t, out, names = 0.0, [], list(self.traffic.adapters)
        for i in range(self.traffic.count):
            if self.traffic.rate:
                t += self.rnd.expovariate(self.traffic.rate)
            name = names[i % len(names)]
            n_out = self.rnd.randint(*self.traffic.output)
            seq = Sequence(f"r{i}", [1] * self.rnd.randint(*self.traffic.prompt),
                           SamplingParams(max_tokens=n_out, ignore_eos=True), adapter=name)
            self.accept[seq.request_id] = self.traffic.adapters[name]
            out.append((t, seq))
        return out

    def jitter(self, ms: float) -> float:
        return ms * 1e-3 * (max(0.5, self.rnd.gauss(1.0, self.noise)) if self.noise else 1.0)

    def schedule(self, now: float) -> ScheduledBatch:
        while self.arrivals and self.arrivals[0][0] <= now:
            self.running.append(self.arrivals.pop(0)[1])
        self.running = [s for s in self.running if s.tokens_left(1 << 30) > 0]
        return ScheduledBatch(list(self.running), lookahead=self.gate.lookahead, closed=True)

    def launch(self, plan) -> tuple[float, float, StepResult]:
        """Run the plan's sequences forward; -> (device seconds, host seconds, the StepResult it measures)."""
        if not plan.speculate:
            return self._plain(plan)
        return self._cycle(plan)

    def _plain(self, plan) -> tuple[float, float, StepResult]:
        n, prompt = len(plan.seqs), sum(len(s.prompt_token_ids) for s in plan.seqs if s.is_prefill)
        device = self.jitter(self.costs.plain_ms(n) + prompt * self.costs.prompt_token)
        for s in plan.seqs:
            self._advance(s, 1)
        host = self.jitter(self.costs.host_plain)
        passes = [] if self.legacy else [("plain", n + prompt, plan.distinct, device)]
        return device, host, StepResult(passes, [], 0.0 if self.legacy else host)

    def _cycle(self, plan) -> tuple[float, float, StepResult]:
        n, passes, verifies = len(plan.seqs), plan.passes, []
        prompts = [s for s in plan.seqs if s.is_prefill]
        prompt = sum(len(s.prompt_token_ids) for s in prompts)
        # adapter riders decode in the drafting passes with their adapter on: its LoRA work, by their share of rows
        riders = [s.adapter for s, r in zip(plan.seqs, plan.ride) if r and s.adapter is not None]
        base = self.costs.base_ms(n) + len(riders) / n * (self.costs.plain_ms(n) - self.costs.base_ms(n))
        kinds = [("prompted" if i == 0 and prompts else "base", n, len(set(riders)),
                  self.jitter(base + (prompt * self.costs.prompt_token if i == 0 else 0))) for i in range(passes)]
        tokens = 0
        for s, m, ride in zip(plan.seqs, plan.lengths, plan.ride):
            if s.is_prefill:
                self._advance(s, 1)
                tokens += 1
                continue
            accepted = 0
            while accepted < m and self.rnd.random() < self.accept[s.request_id]:
                accepted += 1
            if m:
                verifies.append((s.adapter, m, accepted))
            tokens += m + 1
            self._advance(s, passes + 1 if ride else accepted + 1)
        kinds.append(("lora", tokens, plan.distinct, self.jitter(self.costs.verify_ms(n, tokens))))
        device = sum(k[3] for k in kinds)
        host = self.jitter(self.costs.host_cycle + passes * self.costs.host_per_pass)
        return device, host, StepResult(kinds, verifies, 0.0 if self.legacy else host)

    def _advance(self, s: Sequence, tokens: int) -> None:
        tokens = min(tokens, s.tokens_left(1 << 30))
        s.output_token_ids.extend([0] * tokens)
        s.num_computed = s.num_tokens - 1
        self.run.tokens += tokens


def simulate(gate, costs: LoopCosts, traffic: Traffic, seed: int = 0, noise: float = 0.03,
             legacy: bool = False, periods: bool = True) -> Run:
    """Drive `gate` over `traffic` in the overlapped loop until every request is done. `legacy`: measure steps as
    the engine did before device spans and host time (no "plain" pass, host_s = 0); `periods` False: nor periods."""
    sim = _Sim(gate, costs, traffic, seed, noise, legacy)
    t, dev_free, queued = 0.0, 0.0, None  # queued: (plan, result, launched at, device done at, host to read)
    while sim.arrivals or sim.running or queued:
        if not sim.running and not queued and sim.arrivals:
            t = max(t, sim.arrivals[0][0])
        batch = sim.schedule(t)
        launched, step = t, None
        if not batch.empty:
            plan = gate.plan(batch)
            _count(sim.run, gate, plan)
            device, host, result = sim.launch(plan)
            t += host / 2
            idle = costs.cycle_idle * 1e-3 if plan.speculate else 0.0
            before, dev_free = dev_free, max(t, dev_free) + device + idle
            if queued is not None and periods and not legacy:  # the step before is still queued: a period
                result.period_s = dev_free - before
            sim.run.note(plan.seqs, dev_free)
            step = (plan, result, launched, dev_free, host / 2)
        if queued is not None:
            plan, result, at, done, read = queued
            t = max(t, done) + read
            gate.observe(plan, result, (launched if step else t) - at)
        queued = step
        if step is None and not sim.running and not sim.arrivals:
            break
    sim.run.seconds = t
    return sim.run


def _count(run: Run, gate, plan) -> None:
    decided = any(not s.is_prefill and s.adapter is not None for s in plan.seqs)
    if plan.speculate:
        run.cycles += 1
    elif decided:
        run.plain_steps += 1
    if decided and getattr(gate, "last_decision", None) is not None:
        run.decisions[gate.last_decision.value] += 1
