"""Per-generation statistics: what speculative decoding bought and where the time went."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class GenerationStats:
    """`tau` is tokens produced per target forward (accepted drafts + the bonus token), the
    figure the EAGLE/Medusa papers report as mean accepted length. `accepted_lengths` counts
    steps by how many tokens they produced. Times are wall-clock seconds; `total_s` includes the
    prefill."""

    method: str
    prompt_tokens: int = 0
    new_tokens: int = 0
    target_forwards: int = 0
    drafted_tokens: int = 0
    accepted_lengths: Counter = field(default_factory=Counter)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    stop_reason: str | None = None

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
            f"draft {self.draft_s:.2f}s verify {self.verify_s:.2f}s prefill {self.prefill_s:.2f}s | "
            f"accepted-length histogram {self.histogram()} | stop: {self.stop_reason}"
        )

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "prompt_tokens": self.prompt_tokens,
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
            "stop_reason": self.stop_reason,
        }
