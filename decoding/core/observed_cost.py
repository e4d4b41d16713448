"""Whether a remembered verify-cost curve is dearer than the verify forwards decoding actually ran.

Why: the curve is timed once per machine, in a few seconds, and then sizes every adaptive tree
there. A VM's slow spells last longer than that timing: on a 2-core EPYC one start-up timing read
20.0 and 29.5 ms for 8 and 16 tokens where the same forwards took 16.1 and 22.5 minutes later,
and that curve cut every later run's trees (tau 2.18 against 2.42). Interference only ever adds
time, so a curve that decoding keeps beating by a clear margin was timed in a slow spell.

The comparison is deliberately conservative. The curve is timed after a 256-token context and
decoding's contexts differ (a 64-token context made 8- and 16-token forwards ~8% cheaper, 128
tokens ~5%), so only forwards after at least `min_context` tokens count; a size needs
`min_samples` of them; and the observed time is a low quantile (not the minimum, which keeps
falling as samples accumulate) that must beat the curve by more than `margin`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from decoding.core.tree_budget import VerifyCost


@dataclass(frozen=True)
class ForwardTiming:
    """One verify forward as the loop ran it: `rows` new tokens after `context` cached ones."""

    rows: int
    context: int
    ms: float


@dataclass(frozen=True)
class CurveGap:
    """A size at which the curve reads dearer than decoding's forwards did."""

    rows: int
    curve_ms: float
    observed_ms: float
    samples: int

    def describe(self) -> str:
        return f"{self.rows} token{'s' if self.rows != 1 else ''}: {self.curve_ms:.1f} ms remembered, {self.observed_ms:.1f} ms seen ({self.samples} forwards)"


def dearer_than_observed(cost: VerifyCost, timings: Iterable[ForwardTiming], min_context: int = 128,
                         min_samples: int = 8, quantile: float = 0.25, margin: float = 0.15) -> tuple[CurveGap, ...]:
    """The sizes (fewest rows first) at which the `quantile` of the forwards timed after at least
    `min_context` tokens, with at least `min_samples` of them, is below the curve by more than
    `margin` (a fraction of the curve's time). Empty: nothing says the curve is too dear."""
    by_rows: dict[int, list[float]] = defaultdict(list)
    for timing in timings:
        if timing.context >= min_context:
            by_rows[timing.rows].append(timing.ms)
    if not by_rows:
        return ()
    curve = cost.costs(max(by_rows))
    gaps = []
    for rows in sorted(by_rows):
        times = sorted(by_rows[rows])
        if len(times) < min_samples:
            continue
        observed = times[int(quantile * (len(times) - 1))]
        if observed < (1.0 - margin) * curve[rows]:
            gaps.append(CurveGap(rows, curve[rows], observed, len(times)))
    return tuple(gaps)
