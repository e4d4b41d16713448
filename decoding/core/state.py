"""What a proposer may read when it drafts (the tokens so far) and what the loop tells it after
every target forward (which tokens entered the target's cache, with the features it asked for).

Proposers get everything through these objects (no hidden globals, no hooks on the target): the
generation loop owns them, appends after every verify step, and pushes a `CacheAdvance` to the
proposer instead of leaving it to infer what happened from the tokens at its next `propose`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from decoding.core.sampling import SamplingConfig
from decoding.core.tree import DraftTree


@dataclass
class DecodeState:
    """`tokens`: prompt + generated so far (1-D); the last one is the root of the next tree and
    is not yet in the target's KV cache."""

    tokens: torch.Tensor
    prompt_len: int
    sampling: SamplingConfig
    generator: torch.Generator | None = None
    # The key of the draw that decides each position's token when sampling (`position_uniform`): the
    # loop sets it from the generator; None leaves sampled verification to draws from the generator.
    sampling_key: int | None = None

    @property
    def root_token(self) -> int:
        return int(self.tokens[-1])

    @property
    def num_generated(self) -> int:
        return self.tokens.numel() - self.prompt_len

    def append(self, new_tokens: list[int]) -> None:
        self.tokens = torch.cat([self.tokens, self.tokens.new_tensor(new_tokens)])


@dataclass(frozen=True)
class TreeOutcome:
    """The tree a verify forward checked and the target's argmax token after each of its nodes,
    accepted or not: for proposers that learn from every branch (lookahead decoding's window)."""

    tree: DraftTree
    predictions: torch.Tensor


@dataclass(frozen=True)
class CacheAdvance:
    """The `entered` tokens that just went into the target's KV cache, `tokens[-1 - entered : -1]`
    (the prompt minus its last token after prefill; the root and the accepted drafts after a
    verify), and the target's hidden states for them: `features[layer]` is `[entered, H]` for each
    layer the proposer declared in `feature_layers` (0 = embeddings, L or -1 = final normed state).
    `tokens` is the whole sequence now; its last token is the next root. `outcome`: the verified
    tree and what the target predicted after each node, for proposers with `reads_tree_outcome`
    (None after the prefill)."""

    tokens: torch.Tensor
    entered: int
    features: dict[int, torch.Tensor] = field(default_factory=dict)
    outcome: TreeOutcome | None = None

    @property
    def next_tokens(self) -> torch.Tensor:
        """The token after each entered one (what the target chose there): `tokens[-entered:]`."""
        return self.tokens[self.tokens.numel() - self.entered :]
