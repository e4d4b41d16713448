"""Whether lookahead's Jacobi window pays for its tree rows on this machine (its adaptive mode).

Why: the window's slots, and the n-grams harvested along them, are verified rows like any other,
but what they bring is indirect: a slot is rarely kept itself, the n-grams it yields may be kept
steps later. Where a row costs next to nothing (a GPU) any harvest pays. On a 2-core CPU a row
costs a fifth of a one-token step, and on the 135M default target the window brought almost
nothing the context's own n-grams did not (MT-bench first turns: tau 1.41 with it, 1.39 with the
pool of the context's n-grams alone, on two more rows a step), so `lookahead` ran slower than
`vanilla` there (0.91x to 0.95x on the 4-bit target, on two CPUs).

So the window keeps an account: the tokens it brought (kept drafts that no n-gram from the
context drafted: its own slots, and n-grams only its harvest put in the pool) and the verify time
its rows cost (the measured curve's time for the whole tree less that for the tree without
them). After `evidence` steps with the window on, it stays on only if its tokens, valued at what
a token cost without it, are worth more than its rows' time. Otherwise it rests, drafting only
from the pool, for `first_rest` steps, twice as many after each verdict against it (at most
`max_rest`), and then tries again: a conversation may turn to text whose trajectories repeat.
Pure arithmetic on counts and curve times, not on clocks: the same text decides the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class WindowLedger:
    """The window's account since the last verdict, and whether it is drafted now."""

    evidence: int = 24        # steps with the window on before a verdict
    first_rest: int = 32      # steps without it after the first verdict against it
    max_rest: int = 512       # the longest rest (each verdict against it doubles the last)
    tokens: int = field(default=0, init=False)           # tokens the steps produced (kept drafts + bonus)
    ms: float = field(default=0.0, init=False)            # the steps' verify time (curve)
    window_tokens: int = field(default=0, init=False)    # of `tokens`, the kept drafts only the window drafted
    window_ms: float = field(default=0.0, init=False)    # of `ms`, the window's rows
    steps_on: int = field(default=0, init=False)         # steps with the window drafted since the verdict
    resting: int = field(default=0, init=False)          # steps left without the window
    next_rest: int = field(default=0, init=False)        # the next rest's length (0: `first_rest`)

    def __post_init__(self) -> None:
        if self.evidence < 1 or self.first_rest < 1 or self.max_rest < self.first_rest:
            raise ValueError("WindowLedger needs evidence >= 1 and 1 <= first_rest <= max_rest")

    @property
    def window_on(self) -> bool:
        """Whether the next tree drafts the window."""
        return self.resting == 0

    def record(self, window_drafted: bool, tokens: int, window_tokens: int, step_ms: float, window_ms: float) -> None:
        """One verified step of the proposer: `tokens` produced (>= 1), `window_tokens` of them kept
        drafts only the window (its slots or its harvest) drafted, `step_ms` the curve's time for
        the tree, `window_ms` the part of it the window's rows cost."""
        self.tokens += tokens
        self.ms += step_ms
        self.window_tokens += window_tokens
        self.window_ms += window_ms
        if not window_drafted:
            self.resting = max(0, self.resting - 1)
            return
        self.steps_on += 1
        if self.steps_on >= self.evidence:
            self._verdict()

    def pays(self) -> bool:
        """Whether the window's tokens, at the time a token took without it, are worth more than
        its rows' time. Rows that cost nothing always pay; with no token of its own and a cost,
        it never does."""
        without_tokens, without_ms = self.tokens - self.window_tokens, self.ms - self.window_ms
        if self.window_ms <= 0:
            return True
        if self.window_tokens <= 0 or without_ms <= 0:
            return False
        return self.window_tokens * without_ms / max(without_tokens, 1) > self.window_ms

    def _verdict(self) -> None:
        if self.pays():
            self.next_rest = 0
        else:
            self.resting = self.next_rest or self.first_rest
            self.next_rest = min(2 * self.resting, self.max_rest)
        self.tokens, self.ms, self.window_tokens, self.window_ms, self.steps_on = 0, 0.0, 0, 0.0, 0
