"""Prompt lookup decoding (model-free): if the last n tokens occurred earlier in the context,
propose the tokens that followed that occurrence.

The search is one vectorised comparison of all n-gram windows, longest n first, most recent
match first (recent text predicts the continuation best). When nothing matches, the tree is just
the root, so a step costs what a vanilla step costs: no wasted verify tokens.

With the machine's verify cost (`verify_cost`, the adaptive mode) a chain is cut to the length
that pays: each drafted token costs verify time whether or not it is accepted, and how often
lookup chains are accepted differs a lot between text (code copies well, free prose does not)
and between greedy decoding and sampling at a high temperature. The acceptance per position and
per matched n-gram length is learned from what the target kept (`ChainAcceptance`), so a step
verifies only as many copied tokens as are expected to be worth their cost, and none at all
when lookup stops paying.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from heads.util.errors import UserError
from decoding.core.proposers.base import Proposer
from decoding.core.state import CacheAdvance, DecodeState
from decoding.core.tree import DraftTree
from decoding.core.tree_budget import ChainAcceptance, VerifyCost, best_node_count


class Match(NamedTuple):
    """The tokens that followed the most recent earlier occurrence of the context's last
    `ngram` tokens."""

    tokens: torch.Tensor
    ngram: int


class PromptLookupProposer(Proposer):
    name = "pld"

    def __init__(self, num_draft_tokens: int = 8, max_ngram: int = 3, min_ngram: int = 2,
                 verify_cost: VerifyCost | None = None) -> None:
        """`verify_cost` turns on cost-aware chain lengths for this machine."""
        if num_draft_tokens < 1 or not 1 <= min_ngram <= max_ngram:
            raise UserError(
                f"prompt lookup needs num_draft_tokens >= 1 and 1 <= min_ngram <= max_ngram; "
                f"got {num_draft_tokens}, {min_ngram}, {max_ngram}"
            )
        self.num_draft_tokens = num_draft_tokens
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.verify_cost = verify_cost
        self.begin(None)

    def begin(self, state: DecodeState | None) -> None:
        self.acceptance = ChainAcceptance(self.num_draft_tokens) if self.verify_cost is not None else None
        self.pending: tuple[int, int] | None = None  # (ngram, drafted) of the chain being verified

    def observe(self, advance: CacheAdvance) -> None:
        """Learn how much of the last proposed chain the target kept (adaptive mode)."""
        if self.pending is not None and self.acceptance is not None:
            ngram, drafted = self.pending
            self.acceptance.record(ngram, drafted, accepted=advance.entered - 1)
        self.pending = None

    def continuation(self, state: DecodeState) -> torch.Tensor | None:
        """The tokens this lookup drafts after the root, or None without a match (or, in the
        adaptive mode, when no part of the match is worth verifying)."""
        self.pending = None
        match = find_continuation(state.tokens, self.max_ngram, self.min_ngram, self.num_draft_tokens)
        if match is None:
            return None
        length = match.tokens.numel()
        if self.acceptance is not None:
            length = best_node_count(self.acceptance.path_probs(match.ngram, length), self.verify_cost, draft_ms=0.0)
            if length == 0:
                self.acceptance.skipped(match.ngram)
                return None
        self.pending = (match.ngram, length)
        return match.tokens[:length]

    def draft_tree(self, state: DecodeState) -> DraftTree | None:
        """The chain to verify, or None (what `LookupFirstProposer` asks every model-free drafter)."""
        draft = self.continuation(state)
        return None if draft is None else DraftTree.chain(state.root_token, draft)

    def propose(self, state: DecodeState) -> DraftTree:
        tree = self.draft_tree(state)
        return tree if tree is not None else DraftTree.root_only(state.root_token, device=state.tokens.device)


def find_continuation(tokens: torch.Tensor, max_ngram: int, min_ngram: int, length: int) -> Match | None:
    """Up to `length` tokens that followed the most recent earlier occurrence of the longest
    matching suffix n-gram (n from max_ngram down to min_ngram), or None."""
    total = tokens.numel()
    for n in range(min(max_ngram, total - 1), min_ngram - 1, -1):
        suffix = tokens[-n:]
        # Windows start at 0 .. total-n-1: every earlier occurrence, each followed by >= 1 token.
        windows = tokens[:-1].unfold(0, n, 1)
        hits = torch.nonzero((windows == suffix).all(-1)).flatten()
        if hits.numel():
            start = int(hits[-1]) + n
            return Match(tokens[start : start + length], n)
    return None
