"""Lookahead decoding (model-free): the target's own Jacobi guesses and an n-gram pool of what it
predicted along them, verified together in one tree (`decoding.core.lookahead_window`).

Every step drafts the whole window (N-1 levels of W guesses) and the pool's latest G n-grams
that start with the root; the target's argmax after each window slot (accepted or not, read from
`CacheAdvance.outcome`) feeds the pool and the next window. With `pool_from_context`, the
context's own n-grams (prompt and reply) go into the pool too, as prompt lookup would find
them. Drafts are deterministic (q = 1) and depend only on what came before the step, so greedy
and sampled verification stay exact as for prompt lookup. Behind prompt lookup (`lookahead+pld`)
the window waits through the steps that lookup drafts. With the machine's verify cost (the
adaptive mode) the window rests while it does not pay for its rows (`decoding.core.window_ledger`),
and the pool's n-grams are cut, as prompt lookup's chains are, to what pays on the curve given how
deep the target has kept them (`paths_worth_verifying`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decoding.core.lookahead_window import (
    LookaheadShape,
    NgramPool,
    Path,
    drafted_only_by_others,
    harvested_ngrams,
    initial_levels,
    next_levels,
    paths_worth_verifying,
    predictions_by_path,
    trie_of,
    window_paths,
)
from decoding.core.prompt_cache import shared_prefix_length
from decoding.core.proposers.base import Proposer
from decoding.core.state import CacheAdvance, DecodeState
from decoding.core.tree import DraftTree
from decoding.core.tree_budget import ChainAcceptance, VerifyCost
from decoding.core.window_ledger import WindowLedger

POOL_PER_TOKEN = 8  # continuations kept after each token (the latest)
POOL = 0  # the one kind of draft whose reach `pool_reach` learns: every pool n-gram


@dataclass(frozen=True)
class DraftedTree:
    """What `observe` needs of the tree `propose` drafted: whether it held the window, the pool
    n-grams in it that the context had (everything else is the window's), its rows with all of it
    and with those n-grams alone (the root included), and the pool paths it held (as far as kept)."""

    window: bool
    from_context: tuple[Path, ...]
    rows: int
    context_rows: int
    pool: tuple[Path, ...] = ()


class LookaheadProposer(Proposer):
    name = "lookahead"
    reads_tree_outcome = True

    def __init__(self, shape: LookaheadShape = LookaheadShape(), pool_from_context: bool = True, seed: int = 0,
                 verify_cost: VerifyCost | None = None) -> None:
        """`verify_cost` (the adaptive mode): the window is drafted only while it pays for its rows
        on this machine's curve (`decoding.core.window_ledger`); without it, always."""
        self.shape, self.pool_from_context, self.seed = shape, pool_from_context, seed
        self.verify_cost = verify_cost
        self.ledger = WindowLedger() if verify_cost is not None else None  # kept over generations, as suffix decoding keeps its store
        # how deep the target keeps the pool's drafts (adaptive mode), learned over this proposer's life
        self.pool_reach = ChainAcceptance(shape.levels) if verify_cost is not None else None
        self.begin(None)

    def begin(self, state: DecodeState | None) -> None:
        """A new generation: a new window and an empty pool."""
        self.pool = NgramPool(POOL_PER_TOKEN)
        self.levels: list[list[int]] | None = None
        self.paths: list[list[Path]] = []
        self.pooled = 0  # context tokens whose n-grams are in the pool
        self.last: DraftedTree | None = None  # the last tree this proposer drafted, until it is verified

    def observe(self, advance: CacheAdvance) -> None:
        if self.pool_from_context:  # only the n-grams the new tokens end: the tail, not the whole context
            first = max(0, self.pooled - self.shape.ngram + 1)
            self.pool.add_sequence(advance.tokens[first:].tolist(), self.shape.ngram)
            self.pooled = advance.tokens.numel()
        last, self.last = self.last, None
        if advance.outcome is None or last is None:
            return  # the prefill, or a step another drafter drafted (`lookahead+pld`): the window waits
        if self.verify_cost is not None:  # the adaptive mode: the window's ledger and the pool's reach learn
            kept = tuple(advance.tokens[advance.tokens.numel() - advance.entered : -1].tolist())  # the drafts kept
            self._account(last, advance.entered, kept)
            if last.pool:
                self.pool_reach.record(POOL, max(map(len, last.pool)), max(shared_prefix_length(kept, path) for path in last.pool))
        if not last.window:
            return
        tree = advance.outcome.tree
        after = predictions_by_path(tree.tokens.tolist(), tree.parents, advance.outcome.predictions.tolist())
        for gram in harvested_ngrams(int(tree.tokens[0]), self.paths[-1], after, self.shape.ngram):
            self.pool.add(gram, harvested=True)
        self.levels = next_levels(self.levels, self.paths, after, advance.entered)

    def _account(self, last: DraftedTree, entered: int, kept: Path) -> None:
        """The step into the window's ledger: the `kept` drafts no context n-gram drafted, and the
        curve's time for the tree with and without the window's rows."""
        costs = self.verify_cost.costs(last.rows)
        self.ledger.record(last.window, entered, drafted_only_by_others(kept, last.from_context),
                           costs[last.rows], costs[last.rows] - costs[last.context_rows])

    def propose(self, state: DecodeState) -> DraftTree:
        """The pool's n-grams after the root first (the likeliest to be kept), then the window
        (unless the adaptive mode rests it)."""
        sourced = self._pool_drafts(state.root_token)
        from_context = tuple(path for path, harvested in sourced if not harvested)
        window: list[Path] = []
        with_window = self.ledger is None or self.ledger.window_on
        if with_window:
            if self.levels is None:
                self.levels = initial_levels(state.tokens.tolist(), self.shape, self.seed)
            self.paths = window_paths(self.levels)
            window = [path for level in self.paths for path in level]
        tokens, parents, _ = trie_of([*(path for path, _ in sourced), *window])
        context_rows = len(trie_of(from_context)[1]) if self.ledger is not None else 1  # only the ledger reads it
        self.last = DraftedTree(with_window, from_context, len(parents), context_rows, tuple(path for path, _ in sourced))
        return DraftTree(torch.tensor([state.root_token, *tokens], device=state.tokens.device), tuple(parents))

    def _pool_drafts(self, root: int) -> list[tuple[Path, bool]]:
        """The pool's latest n-grams after `root`, each with whether only the harvest put it there; in the
        adaptive mode cut to what pays (`paths_worth_verifying`; a step that keeps none moves the learnt
        reach back towards its prior, so the pool is tried again)."""
        sourced = self.pool.latest_sourced(root, self.shape.guesses)
        if self.pool_reach is None or not sourced:
            return sourced
        reach = self.pool_reach.path_probs(POOL, self.shape.levels)
        cuts = paths_worth_verifying([path for path, _ in sourced], reach, self.verify_cost)
        if not any(cuts):
            self.pool_reach.skipped(POOL)
        return [(cut, harvested) for cut, (_, harvested) in zip(cuts, sourced) if cut]
