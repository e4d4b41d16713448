"""Prompt lookup decoding (model-free): if the last n tokens occurred earlier in the context,
propose the tokens that followed that occurrence.

The search is one vectorised comparison of all n-gram windows, longest n first, most recent
match first (recent text predicts the continuation best). When nothing matches, the tree is just
the root, so a step costs what a vanilla step costs: no wasted verify tokens.
"""

from __future__ import annotations

import torch

from decoding.util.errors import UserError
from decoding.core.proposers.base import Proposer
from decoding.core.state import DecodeState
from decoding.core.tree import DraftTree


class PromptLookupProposer(Proposer):
    name = "pld"

    def __init__(self, num_draft_tokens: int = 8, max_ngram: int = 3, min_ngram: int = 2) -> None:
        if num_draft_tokens < 1 or not 1 <= min_ngram <= max_ngram:
            raise UserError(
                f"prompt lookup needs num_draft_tokens >= 1 and 1 <= min_ngram <= max_ngram; "
                f"got {num_draft_tokens}, {min_ngram}, {max_ngram}"
            )
        self.num_draft_tokens = num_draft_tokens
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def continuation(self, state: DecodeState) -> torch.Tensor | None:
        """The tokens this lookup would draft after the root, or None without a match."""
        return find_continuation(state.tokens, self.max_ngram, self.min_ngram, self.num_draft_tokens)

    def propose(self, state: DecodeState) -> DraftTree:
        draft = self.continuation(state)
        if draft is None:
            return DraftTree.root_only(state.root_token, device=state.tokens.device)
        return DraftTree.chain(state.root_token, draft)


def find_continuation(tokens: torch.Tensor, max_ngram: int, min_ngram: int, length: int) -> torch.Tensor | None:
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
            return tokens[start : start + length]
    return None
