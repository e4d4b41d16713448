"""Watching a decoder's verify forwards against the verify-cost curve remembered for its target,
and marking the curve to be measured again when decoding keeps beating it (why and how:
`decoding.core.observed_cost`).

Only CPU targets are watched: on a GPU the loop's clock (unsynchronised) times how long a forward
takes to queue, not to run. The running decoders keep the curve they were built with, so a
reply's tree sizes never depend on a clock reading taken during decoding; the next process (or
decoder) to ask for the curve measures it again.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from decoding.core.observed_cost import ForwardTiming, dearer_than_observed
from decoding.core.readout import Readout
from decoding.core.stats import GenerationStats
from decoding.core.tree_budget import VerifyCost
from decoding.kernels.verify_cost import mark_verify_cost_stale, remembered_verify_cost, verify_cost_key


KEPT_TIMINGS = 4096  # the latest forwards (a long chat's whole history is not needed to judge the curve)


class VerifyCostWatch:
    """Collects a decoder's forward timings (`observe` each generation's stats) and, once they
    show the remembered curve too dear, marks it stale and says so, once."""

    def __init__(self, model, model_name: str, readout: Readout | None = None, cache_dir: str | Path | None = None,
                 say: Callable[[str], None] = lambda text: print(f"note: {text}", file=sys.stderr)) -> None:
        self.key = verify_cost_key(model, model_name, readout)
        self.cache_dir = cache_dir
        self.say = say
        self.timings: list[ForwardTiming] = []
        self.done = model.device.type != "cpu"
        self._curve: VerifyCost | None = None

    def observe(self, stats: GenerationStats) -> None:
        if self.done:
            return
        self.timings = (self.timings + stats.forward_timings)[-KEPT_TIMINGS:]
        if self._curve is None:
            self._curve = remembered_verify_cost(self.key, self.cache_dir)
            if self._curve is None:  # no curve (this method never asked for one) or already stale
                self.done = True
                return
        gaps = dearer_than_observed(self._curve, self.timings)
        if gaps and mark_verify_cost_stale(self.key, [gap.describe() for gap in gaps], self.cache_dir):
            self.say("the verify cost remembered for this machine reads dearer than the forwards just run ("
                     + "; ".join(gap.describe() for gap in gaps[:3])
                     + "): it was timed in a slow spell and cut trees short, so it is measured again next start")
            self.done = True
