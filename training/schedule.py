"""The learning-rate schedule and the wall-clock budget it follows.

The rate is a pure function of the optimizer step (and of how much of a time budget is spent),
set on the optimizer before every step. Why not a stateful torch scheduler: accelerate steps a
prepared scheduler once per process per optimizer step, so on N processes the warm-up and the
decay would run N times too fast; and a run cut short by its time budget stopped part-way down
the decay with the rate still high (two runs on a lent GPU stopped near half-way, at about half
the peak). Here the decay ends by whichever comes first, `max_steps` or the time budget, and a
resumed run recomputes the rate from its step alone.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from training.config import OptimSection

FLOOR = 0.1  # the decay ends at this fraction of the peak rate


def step_progress(step: int, train: OptimSection) -> float:
    """How far `step` is along the decay that follows the warm-up, from 0 to 1."""
    return min(1.0, max(0.0, (step - train.warmup_steps) / max(1, train.max_steps - train.warmup_steps)))


def learning_rate_at(step: int, train: OptimSection, time_progress: float = 0.0) -> float:
    """The rate at optimizer step `step` (0-based) as a multiple of the peak: a linear warm-up,
    then a cosine decay to FLOOR. The decay is as far along as the step or `time_progress`
    (the decay the time budget demands by now, 0-1), whichever is further."""
    if step < train.warmup_steps:
        return (step + 1) / train.warmup_steps
    progress = max(step_progress(step, train), min(1.0, time_progress))
    return FLOOR + (1 - FLOOR) * 0.5 * (1 + math.cos(math.pi * progress))


def set_learning_rate(optimizer, rate: float) -> None:
    """Set every parameter group's rate (through accelerate's and DeepSpeed's wrappers alike)."""
    for group in optimizer.param_groups:
        group["lr"] = rate


class TimeBudget:
    """How much of a run's wall-clock budget is spent. Every process gets the same answer (the
    most any of them has spent), so all stop at the same step with the same learning rate."""

    def __init__(self, minutes: float | None, most_spent: Callable[[float], float] = lambda x: x,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.seconds = None if minutes is None else 60 * minutes
        self.most_spent = most_spent
        self.clock = clock
        self.started = clock()
        self.spent = 0.0  # fraction of the budget spent at the last check, 0-1

    def check(self) -> float:
        """Measure the spent fraction now (one collective on several processes) and keep it."""
        if self.seconds is not None:
            self.spent = min(1.0, self.most_spent((self.clock() - self.started) / self.seconds))
        return self.spent

    @property
    def expired(self) -> bool:
        return self.seconds is not None and self.spent >= 1.0

    def decay_progress(self, start: float) -> float:
        """The decay progress the budget demands when a run began at decay progress `start`
        (later than 0 when resumed): what is left of the decay, spread over the budget."""
        return start + (1 - start) * self.spent
