"""Measured pass times, the inputs of the gate's cost model (kept by estimator.Estimator).

Kinds: "plain" (a plain step's forward on the device, or, measured without its span, the whole step launch to
launch), "base" (one LoRA-off drafting pass), "lora" (one adapter-on verify pass), "plain_host" and "cycle_host"
(a step's own host work, by batch size), "plain_gap" and "cycle_gap" (a step's period in a run of its kind beyond the
larger of its device and host time, by batch size; signed) and "overhead" (a cycle measured without host
time: the rest of its step beyond its passes). A pass that also ran prompts ("prompted") is not recorded."""

from __future__ import annotations

from collections import Counter


def bucket(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class StepTimes:
    """EMA of measured seconds per pass kind and (token bucket, distinct-adapter bucket), with the mean token
    count of the passes each bucket measured (to interpolate between buckets)."""

    def __init__(self, weight: float = 0.2):
        self.weight = weight
        self._t: dict[tuple[str, int, int], float] = {}
        self._tokens: dict[tuple[str, int, int], float] = {}
        self._n: Counter[tuple[str, int, int]] = Counter()
        self._lines: dict[str, dict[int, list[tuple[float, float]]]] = {}  # slope's points, until the next record
        # `get`'s answers until the next record: a decision prices many cycle lengths from the same few passes, on the
        # host time of every step
        self._memo: dict[tuple[str, int, int, bool], float | None] = {}
        self.records = 0

    def record(self, kind: str, tokens: int, adapters: int, seconds: float, replace: bool = False) -> None:
        """One measured pass. `replace`: a re-measure, which takes the place of what the bucket held (measured
        long before, maybe once and high) instead of being averaged in."""
        key = (kind, bucket(tokens), bucket(adapters) if adapters else 0)
        self._n[key] += 1
        self._lines.pop(kind, None)
        self._memo.clear()
        self.records += 1  # any measurement (what estimates derived from these times are cached against)
        old = self._t.get(key)
        # The second sample at a shape replaces the first, which may carry one-off costs (kernel selection,
        # first-touch memory); later ones are averaged in.
        if old is None or self._n[key] == 2 or replace:
            self._t[key], self._tokens[key] = seconds, float(tokens)
        else:
            self._t[key] = (1 - self.weight) * old + self.weight * seconds
            self._tokens[key] = (1 - self.weight) * self._tokens[key] + self.weight * tokens

    def get(self, kind: str, tokens: int, adapters: int, exact: bool = False) -> float | None:
        """Seconds for a pass of this kind, tokens and adapters, priced from the measurements:
        - its bucket measured: that time, moved along the measured cost per token (`slope`) to this pass's own
          size (a bucket holds passes of up to twice the tokens, e.g. verify passes of different cycle lengths);
        - else (unless `exact`, which returns None) the straight line in token count between the two measured
          buckets around it, of the same kind and adapter bucket (pass time is close to affine in tokens);
        - else the nearest measured bucket of the same kind (token and adapter buckets compared on a log
          scale), unscaled: optimistic for the larger pass it usually prices, so a decision it drives runs that
          pass and measures the missing bucket, where a pessimistic guess would keep the gate from trying it.
        None if this kind was never measured."""
        memo = (kind, tokens, adapters, exact)
        if memo not in self._memo:
            self._memo[memo] = self._get(kind, tokens, adapters, exact)
        return self._memo[memo]

    def _get(self, kind: str, tokens: int, adapters: int, exact: bool) -> float | None:
        ab = bucket(adapters) if adapters else 0
        tb = bucket(tokens)
        measured = self._t.get((kind, tb, ab))
        if measured is not None:
            off = tokens - self._tokens[(kind, tb, ab)]
            return max(0.5 * measured, measured + self.slope(kind, tokens, adapters) * off) if off else measured
        if exact:
            return None
        known = [(t, a, v) for (k, t, a), v in self._t.items() if k == kind]
        if not known:
            return None
        below = max((t for t, a, _ in known if a == ab and t < tb), default=None)
        above = min((t for t, a, _ in known if a == ab and t > tb), default=None)
        if below is not None and above is not None:
            lo, hi = (kind, below, ab), (kind, above, ab)
            n_lo, n_hi = self._tokens[lo], self._tokens[hi]
            if n_hi > n_lo:
                f = min(1.0, max(0.0, (tokens - n_lo) / (n_hi - n_lo)))
                return self._t[lo] + f * (self._t[hi] - self._t[lo])
        return min(known, key=lambda e: abs(e[0].bit_length() - tb.bit_length())
                   + abs(e[1].bit_length() - ab.bit_length()))[2]

    def slope(self, kind: str, tokens: int, adapters: int) -> float:
        """Seconds per token of this kind's passes near `tokens`: the line through the two measured buckets around
        it, else through the two nearest, in this adapter bucket or else the nearest one with two sizes measured
        (the per-token work does not depend on how many adapters the pass reads). 0.0 until two sizes are."""
        ab = bucket(adapters) if adapters else 0
        lines = self._lines.get(kind)
        if lines is None:  # (token count, seconds) by adapter bucket, where two sizes or more are measured
            points: dict[int, list[tuple[float, float]]] = {}
            for key, v in self._t.items():
                if key[0] == kind:
                    points.setdefault(key[2], []).append((self._tokens[key], v))
            lines = self._lines[kind] = {a: sorted(p) for a, p in points.items() if len(p) >= 2}
        if not lines:
            return 0.0
        pts = lines[min(lines, key=lambda a: abs(a.bit_length() - ab.bit_length()))]
        i = min(max(1, sum(n < tokens for n, _ in pts)), len(pts) - 1)
        (n0, t0), (n1, t1) = pts[i - 1], pts[i]
        return max(0.0, (t1 - t0) / (n1 - n0)) if n1 > n0 else 0.0
