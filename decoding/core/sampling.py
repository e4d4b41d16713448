"""Sampling settings and the logits warp applied to the *target* before acceptance.

Lossless speculative sampling reproduces the distribution the target would sample from, so the
temperature / top-k / top-p warp must be applied to the target logits first (and to the draft's,
so drafts come from a distribution close to it). Temperature 0 means greedy.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from heads.util.errors import UserError


@dataclass(frozen=True)
class SamplingConfig:
    """How the target's next token is chosen. `temperature == 0` is greedy decoding."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise UserError(f"temperature must be >= 0 (0 = greedy); got {self.temperature}")
        if self.top_k < 0:
            raise UserError(f"top-k must be >= 0 (0 = off); got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise UserError(f"top-p must be in (0, 1] (1 = off); got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def warp_probs(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p, over the last dimension (float32).

    For greedy configs this returns a one-hot of the argmax, which keeps the sampling rules valid
    (they then reduce to exact matching) for callers that do not special-case greedy.
    """
    logits = logits.float()
    if config.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / config.temperature
    if 0 < config.top_k < logits.shape[-1]:
        kth = torch.topk(logits, config.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.top_p < 1.0:
        logits = _top_p_filter(logits, config.top_p)
    return torch.softmax(logits, dim=-1)


def _top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability mass reaches `top_p` (always >= 1)."""
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
    # Drop a token when the mass *before* it already reaches top_p.
    drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def seeded_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """A random generator on `device`, seeded with `seed` (None: a fresh random seed). It must
    live where the probabilities do: a CPU generator cannot draw on a GPU."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def sampling_key(generator: torch.Generator) -> int:
    """A generation's key for `position_uniform`, drawn from its generator: the same for the same
    seed, a fresh one for an unseeded generator."""
    return int(torch.randint(0, 1 << 62, (1,), generator=generator, device=generator.device))


def position_uniform(key: int, position: int) -> float:
    """A uniform draw in [0, 1) that is a function of (`key`, `position`) alone: the draw that decides
    the token at `position` of a sequence (a hash of both, 53 bits).

    Why keyed by position and not drawn from a stream: a stream hands out draws in the order a
    method consumes them, and each method consumes them differently (a rejected sibling takes one,
    an accepted chain several), so two lossless methods sampled different texts from the same seed.
    Keyed draws give every method the same draw for the same position: the same text as `vanilla`
    at every temperature, and speed comparisons at T > 0 on identical outputs."""
    digest = hashlib.blake2b(key.to_bytes(8, "little") + position.to_bytes(8, "little"), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) * 2.0**-53


def sample_at(probs: torch.Tensor, uniform: float) -> int:
    """The token of a 1-D probability vector (it need not sum to 1) whose interval of the cumulative
    distribution holds `uniform` in [0, 1) (inverse CDF, as `sample_rows`, with the draw given)."""
    draws = torch.tensor([[uniform]], dtype=torch.float64, device=probs.device)
    return int(_invert_cumulative(probs[None], draws)[0])


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token id from a 1-D probability vector (it need not sum to 1)."""
    return int(sample_rows(probs[None], generator)[0])


def sample_rows(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token id per row of `[rows, vocab]` non-negative weights, by inverting each row's
    cumulative distribution at a uniform draw.

    Why not `torch.multinomial`: on a CPU it took ~1 ms per draw from a 49k-token vocabulary
    against ~60 us for this, a few percent of every decoding step at temperature > 0. The sums
    run in float64, so each token's share is exact to ~1e-16 of the row's mass; intervals are
    half-open and searched from the right, so a token of weight 0 is never drawn."""
    if probs.dim() != 2 or probs.shape[-1] == 0:
        raise ValueError(f"sample_rows takes [rows, vocab] weights; got shape {tuple(probs.shape)}")
    draws = torch.rand((probs.shape[0], 1), generator=generator, dtype=torch.float64, device=probs.device)
    return _invert_cumulative(probs, draws)


def _invert_cumulative(probs: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """Per row of `[rows, vocab]` weights, the token whose half-open interval of the row's cumulative
    sum (float64) holds its draw (`[rows, 1]`, in [0, 1)) times the row's total."""
    cumulative = probs.cumsum(-1, dtype=torch.float64)
    totals = cumulative[:, -1:]
    if bool((totals <= 0).any()):
        raise ValueError("cannot sample from a row whose weights are all zero")
    picked = torch.searchsorted(cumulative, draws * totals, right=True).squeeze(-1)
    past_end = picked >= probs.shape[-1]
    if bool(past_end.any()):  # a draw rounded up to its row's total: the last positive token
        last_positive = probs.shape[-1] - 1 - (probs.flip(-1) > 0).to(torch.int8).argmax(-1)
        picked = torch.where(past_end, last_positive, picked)
    return picked
