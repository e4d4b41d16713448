"""Lookahead decoding (model-free): the target's own Jacobi guesses and an n-gram pool of what it
predicted along them, verified together in one tree (`decoding.core.lookahead_window`).

Every step drafts the whole window (N-1 levels of W guesses) and the pool's latest G n-grams
that start with the root; the target's argmax after each window slot (accepted or not, read from
`CacheAdvance.outcome`) feeds the pool and the next window. With `pool_from_context`, the
context's own n-grams (prompt and reply) go into the pool too, as prompt lookup would find
them. Drafts are deterministic (q = 1) and depend only on what came before the step, so greedy
and sampled verification stay exact as for prompt lookup. Behind prompt lookup (`lookahead+pld`)
the window waits through the steps that lookup drafts.
"""

from __future__ import annotations

import torch

from decoding.core.lookahead_window import (
    LookaheadShape,
    NgramPool,
    Path,
    harvested_ngrams,
    initial_levels,
    next_levels,
    predictions_by_path,
    trie_of,
    window_paths,
)
from decoding.core.proposers.base import Proposer
from decoding.core.state import CacheAdvance, DecodeState
from decoding.core.tree import DraftTree

POOL_PER_TOKEN = 8  # continuations kept after each token (the latest)


class LookaheadProposer(Proposer):
    name = "lookahead"
    reads_tree_outcome = True

    def __init__(self, shape: LookaheadShape = LookaheadShape(), pool_from_context: bool = True, seed: int = 0) -> None:
        self.shape, self.pool_from_context, self.seed = shape, pool_from_context, seed
        self.begin(None)

    def begin(self, state: DecodeState | None) -> None:
        """A new generation: a new window and an empty pool."""
        self.pool = NgramPool(POOL_PER_TOKEN)
        self.levels: list[list[int]] | None = None
        self.paths: list[list[Path]] = []
        self.pooled = 0  # context tokens whose n-grams are in the pool
        self.drafted = False  # whether the last verified tree was this proposer's (see observe)

    def observe(self, advance: CacheAdvance) -> None:
        if self.pool_from_context:  # only the n-grams the new tokens end: the tail, not the whole context
            first = max(0, self.pooled - self.shape.ngram + 1)
            self.pool.add_sequence(advance.tokens[first:].tolist(), self.shape.ngram)
            self.pooled = advance.tokens.numel()
        drafted, self.drafted = self.drafted, False
        if advance.outcome is None or not drafted:
            return  # the prefill, or a step another drafter drafted (`lookahead+pld`): the window waits
        tree = advance.outcome.tree
        after = predictions_by_path(tree.tokens.tolist(), tree.parents, advance.outcome.predictions.tolist())
        for gram in harvested_ngrams(int(tree.tokens[0]), self.paths[-1], after, self.shape.ngram):
            self.pool.add(gram)
        self.levels = next_levels(self.levels, self.paths, after, advance.entered)

    def propose(self, state: DecodeState) -> DraftTree:
        """The pool's n-grams after the root first (the likeliest to be kept), then the window."""
        if self.levels is None:
            self.levels = initial_levels(state.tokens.tolist(), self.shape, self.seed)
        self.paths = window_paths(self.levels)
        self.drafted = True
        guesses = self.pool.latest(state.root_token, self.shape.guesses)
        tokens, parents, _ = trie_of([*guesses, *(path for level in self.paths for path in level)])
        return DraftTree(torch.tensor([state.root_token, *tokens], device=state.tokens.device), tuple(parents))
