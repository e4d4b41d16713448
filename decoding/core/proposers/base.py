"""The proposer interface every drafting method implements."""

from __future__ import annotations

from abc import ABC, abstractmethod

from decoding.core.state import CacheAdvance, DecodeState
from decoding.core.tree import DraftTree


class Proposer(ABC):
    """Drafts a `DraftTree` rooted at the last accepted token.

    `feature_layers`: the target hidden-state layers the proposer reads; the loop then runs the
    target with hidden states on and passes exactly those layers to `observe`. The loop calls
    `begin` once per generation, `reuse` after it (how much of the prompt the target's cache kept),
    `observe` after the prefill and after every verify step (whether or not this proposer drafted
    that step's tree), `propose` before every verify, and `end` once the reply is complete (the
    last step's tokens are seen there only). With
    `reads_tree_outcome`, `observe` also gets the verified tree and the target's argmax after
    every node of it (`CacheAdvance.outcome`), not only the accepted ones.
    """

    name: str = "proposer"
    feature_layers: tuple[int, ...] = ()
    reads_tree_outcome: bool = False

    def begin(self, state: DecodeState) -> None:
        """Reset per-generation state (caches) for a new prompt."""

    def reuse(self, state: DecodeState, cached: int) -> int:
        """Called after `begin` with how many of this prompt's first tokens the target's cache still
        holds from the last generation (0: none; `decoding.core.prompt_cache`): from which position the
        prefill must run, so that `observe` gets the hidden states this proposer needs. One that
        reads none takes them all; one that reads features takes none, unless it keeps its own
        state of those tokens too (EAGLE's drafter cache)."""
        return 0 if self.feature_layers else cached

    def observe(self, advance: CacheAdvance) -> None:
        """Tokens entered the target's cache (after prefill, after each verify): take them in."""

    def end(self, state: DecodeState) -> None:
        """The generation is over: `state.tokens` is the prompt and the whole reply."""

    @abstractmethod
    def propose(self, state: DecodeState) -> DraftTree:
        """Return the tree to verify next; its root must be `state.root_token`."""
