"""Open-loop traffic as users send it: arrival times, adapter popularity, prompt and output lengths.

Pure and seeded: the same `TrafficConfig` gives the same requests, so two engine modes (plain, speculative)
or two runs (cold, warm) see identical traffic. `bench/serve_load.py` replays it against the engine in wall
time; the engine stress tests replay it on a step clock.

Arrivals: Poisson at `rate` (exponential gaps), Gamma with coefficient of variation `cv` (bursty when cv > 1),
or a burst (everything at t = 0). Popularity: Zipf with exponent s (P(i) ~ 1 / (i + 1)^s) or the power law
used in the S-LoRA evaluation, adapter index = floor(n * X) with X ~ power(alpha) (P(X <= x) = x^alpha, so a
small alpha crowds the requests onto the first adapters).
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    request_id: str
    arrival: float  # seconds after the start
    prompt: list[int]
    max_tokens: int
    adapter: str | None  # None: the base model
    abort_after: int | None = None  # abort once this many tokens came back (None: never)


@dataclass
class TrafficConfig:
    num_requests: int = 300
    arrival: str = "poisson"  # poisson | gamma | burst
    rate: float = 10.0  # requests per second (poisson, gamma)
    cv: float = 1.0  # gamma's coefficient of variation
    adapters: tuple[str, ...] = ()
    popularity: str = "zipf:1.0"  # zipf:S | powerlaw:ALPHA | uniform
    base_share: float = 0.2  # requests on the base model alone
    prompt_len: tuple[int, int] = (64, 512)  # inclusive range, uniform
    output_len: tuple[int, int] = (32, 256)
    vocab: int = 32000  # prompt ids are drawn from [1, vocab)
    abort_share: float = 0.0  # requests aborted part-way through their output
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arrival not in ("poisson", "gamma", "burst"):
            raise ValueError(f"arrival must be poisson, gamma or burst, got {self.arrival!r}")
        if self.arrival != "burst" and self.rate <= 0:
            raise ValueError("rate must be > 0")
        if not 0.0 <= self.base_share <= 1.0 or not 0.0 <= self.abort_share <= 1.0:
            raise ValueError("base_share and abort_share must be in [0, 1]")
        if not self.adapters and self.base_share < 1.0:
            raise ValueError("give adapters, or base_share=1.0")
        popularity_weights(self.popularity, max(1, len(self.adapters)))  # validates the spec


def popularity_weights(spec: str, n: int) -> list[float]:
    """Probability of each of n adapters (index 0 the most popular) under `spec`."""
    kind, _, arg = spec.partition(":")
    if kind == "uniform":
        return [1.0 / n] * n
    value = float(arg) if arg else 1.0
    if kind == "zipf":
        w = [1.0 / (i + 1) ** value for i in range(n)]
    elif kind == "powerlaw":
        if value <= 0:
            raise ValueError("powerlaw alpha must be > 0")
        # P(index = i) = P(i/n <= X < (i+1)/n) = ((i+1)/n)^alpha - (i/n)^alpha
        w = [((i + 1) / n) ** value - (i / n) ** value for i in range(n)]
    else:
        raise ValueError(f"popularity must be zipf:S, powerlaw:ALPHA or uniform, got {spec!r}")
    total = sum(w)
    return [x / total for x in w]


def generate(cfg: TrafficConfig) -> list[Request]:
    """The requests, in arrival order."""
    rng = random.Random(cfg.seed)
    weights = popularity_weights(cfg.popularity, max(1, len(cfg.adapters)))
    t, out = 0.0, []
    for i in range(cfg.num_requests):
        if cfg.arrival == "poisson":
            t += rng.expovariate(cfg.rate)
        elif cfg.arrival == "gamma":  # mean 1/rate, cv = std / mean: shape 1/cv^2, scale cv^2/rate
            t += rng.gammavariate(1.0 / cfg.cv**2, cfg.cv**2 / cfg.rate)
        adapter = None
        if rng.random() >= cfg.base_share:
            adapter = rng.choices(cfg.adapters, weights)[0]
        prompt = [rng.randrange(1, cfg.vocab) for _ in range(rng.randint(*cfg.prompt_len))]
        max_tokens = rng.randint(*cfg.output_len)
        abort = rng.randint(0, max_tokens - 1) if rng.random() < cfg.abort_share else None
        out.append(Request(f"r{i:05d}", t, prompt, max_tokens, adapter, abort))
    return out
