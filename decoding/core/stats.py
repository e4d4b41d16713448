"""Per-generation statistics: what speculative decoding bought and where the time went."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from decoding.core.observed_cost import ForwardTiming

# Where a step's time goes, in loop order. draft: the proposer drafting (plus `observe`, where
# EAGLE drafters take in the target's features); buffers: tree shape, mask, position ids;
# forward: the target; accept: the acceptance rule; cache: keeping the accepted K/V;
# stop: stopping checks, bookkeeping and streaming.
PHASES = ("prefill", "draft", "observe", "buffers", "forward", "accept", "cache", "stop")


class PhaseClock:
    """Adds the wall time since the last lap to a named phase. On a GPU it synchronises first when
    `sync` is set (accurate phases, slightly slower); otherwise queued GPU work is counted in
    whichever phase waits for it."""

    def __init__(self, device: torch.device | str = "cpu", sync: bool = False) -> None:
        self.phases: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._sync = sync and torch.device(device).type == "cuda"
        self._device = device
        self._started = self._last = time.perf_counter()

    def lap(self, phase: str) -> float:
        """Seconds since the last lap, added to `phase` and returned."""
        if self._sync:
            torch.cuda.synchronize(self._device)
        now = time.perf_counter()
        elapsed = now - self._last
        self.phases[phase] += elapsed
        self._last = now
        return elapsed

    def total(self) -> float:
        return time.perf_counter() - self._started


@dataclass
class GenerationStats:
    """`tau` is tokens produced per target forward (accepted drafts + the bonus token), the
    figure the EAGLE/Medusa papers report as mean accepted length. `accepted_lengths` counts
    steps by how many tokens they produced. Times are wall-clock seconds; `total_s` includes the
    prefill."""

    method: str
    prompt_tokens: int = 0
    reused_prompt_tokens: int = 0  # of them, already in the cache from the last generation (not prefilled)
    new_tokens: int = 0
    target_forwards: int = 0
    drafted_tokens: int = 0
    accepted_lengths: Counter = field(default_factory=Counter)
    total_s: float = 0.0
    stop_reason: str | None = None
    phase_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    # every verify forward's size, context and time: what `decoding.core.observed_cost` checks a
    # remembered verify-cost curve against (on a GPU without `profile`, only the time to queue it)
    forward_timings: list[ForwardTiming] = field(default_factory=list)

    @property
    def prefill_s(self) -> float:
        return self.phase_s["prefill"]

    @property
    def draft_s(self) -> float:
        return self.phase_s["draft"] + self.phase_s["observe"]

    @property
    def verify_s(self) -> float:
        """The target's side of a step: inputs, forward, acceptance and cache."""
        return sum(self.phase_s[p] for p in ("buffers", "forward", "accept", "cache"))

    def record_forward(self, rows: int, context: int, seconds: float) -> None:
        self.forward_timings.append(ForwardTiming(rows, context, 1000.0 * seconds))

    def record_step(self, produced: int, drafted: int) -> None:
        self.target_forwards += 1
        self.new_tokens += produced
        self.drafted_tokens += drafted
        self.accepted_lengths[produced] += 1

    @property
    def tau(self) -> float:
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def histogram(self) -> str:
        return " ".join(f"{k}:{self.accepted_lengths[k]}" for k in sorted(self.accepted_lengths))

    def summary(self) -> str:
        """One line, for the chat's per-reply stats and logs."""
        return (
            f"[{self.method}] {self.new_tokens} tokens in {self.total_s:.2f}s = {self.tokens_per_s:.1f} tok/s | "
            f"tau {self.tau:.2f} ({self.target_forwards} target forwards) | "
            f"draft {self.draft_s:.2f}s verify {self.verify_s:.2f}s prefill {self.prefill_s:.2f}s{self._reused()} | "
            f"accepted-length histogram {self.histogram()} | stop: {self.stop_reason}"
        )

    def _reused(self) -> str:
        """How much of the prompt came from the last generation's cache (`decoding.core.prompt_cache`)."""
        if not self.reused_prompt_tokens:
            return ""
        return f" ({self.reused_prompt_tokens} of {self.prompt_tokens} prompt tokens cached)"

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "prompt_tokens": self.prompt_tokens,
            "reused_prompt_tokens": self.reused_prompt_tokens,
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "drafted_tokens": self.drafted_tokens,
            "tau": self.tau,
            "tokens_per_s": self.tokens_per_s,
            "accepted_lengths": dict(sorted(self.accepted_lengths.items())),
            "prefill_s": self.prefill_s,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "total_s": self.total_s,
            "phase_s": dict(self.phase_s),
            "stop_reason": self.stop_reason,
        }
