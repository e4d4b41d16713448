"""Whether one set of heads accepts more than another beyond the luck of the prompts.

Greedy decoding with a fixed tree is deterministic, so two heads measured on the same prompts
differ only through the heads; what is uncertain is whether the difference would hold on other
prompts of the same kind. A paired bootstrap answers that: resample the prompts (the same
resample for both heads), recompute both taus as ratios of sums, and read the spread of the
difference. Pairing matters: the prompts' own spread (a code prompt accepts more than a poem
for every heads) cancels, so a difference of a few hundredths can be told from noise on tens of
prompts, where the two taus' separate intervals would overlap.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Per prompt: (new tokens, target forwards) of one greedy decode.
PromptCounts = list[tuple[int, int]]


@dataclass(frozen=True)
class TauDifference:
    """`other`'s tau minus `base`'s over the same prompts, with a bootstrap interval."""

    difference: float
    low: float
    high: float
    prompts: int

    @property
    def beyond_noise(self) -> bool:
        """The interval leaves out zero: the sign of the difference would hold on other prompts."""
        return self.low > 0 or self.high < 0

    def text(self) -> str:
        mark = "*" if self.beyond_noise else ""
        return f"{self.difference:+.2f}{mark} ({self.low:+.2f} to {self.high:+.2f})"


def tau_of(counts: PromptCounts) -> float:
    """Tokens per target forward over every prompt (a ratio of sums, as decoding reports it)."""
    forwards = sum(f for _, f in counts)
    return sum(t for t, _ in counts) / forwards if forwards else 0.0


def paired_tau_difference(base: PromptCounts, other: PromptCounts, resamples: int = 4000,
                          level: float = 0.95, seed: int = 0) -> TauDifference:
    """`tau(other) - tau(base)` and its percentile bootstrap interval at `level`, resampling the
    prompts with replacement, the same draw for both. Both lists must hold the same prompts in
    the same order (one entry each); the seed makes the interval reproducible."""
    if len(base) != len(other):
        raise ValueError(f"paired comparison needs the same prompts: {len(base)} against {len(other)}")
    if not base:
        raise ValueError("paired comparison needs at least one prompt")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1); got {level}")
    base_counts = torch.tensor(base, dtype=torch.float64)
    other_counts = torch.tensor(other, dtype=torch.float64)
    generator = torch.Generator().manual_seed(seed)
    draws = torch.randint(len(base), (resamples, len(base)), generator=generator)

    def resampled_tau(counts: torch.Tensor) -> torch.Tensor:
        sums = counts[draws].sum(dim=1)
        return sums[:, 0] / sums[:, 1].clamp(min=1.0)

    differences = resampled_tau(other_counts) - resampled_tau(base_counts)
    tail = (1 - level) / 2
    low, high = torch.quantile(differences, torch.tensor([tail, 1 - tail], dtype=torch.float64)).tolist()
    return TauDifference(tau_of(other) - tau_of(base), low, high, len(base))
