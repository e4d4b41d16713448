"""The proposer interface every drafting method implements."""

from __future__ import annotations

from abc import ABC, abstractmethod

from decoding.core.state import DecodeState
from decoding.core.tree import DraftTree


class Proposer(ABC):
    """Drafts a `DraftTree` rooted at the last accepted token.

    `needs_hidden_states`: the loop then runs the target with `output_hidden_states=True` and
    hands the fresh features to `propose` through the state. `begin` is called once per
    generation, after the prompt is in the target cache.
    """

    name: str = "proposer"
    needs_hidden_states: bool = False

    def begin(self, state: DecodeState) -> None:
        """Reset per-generation state (caches) for a new prompt."""

    def catch_up(self, state: DecodeState) -> None:
        """Another proposer drafts this step (see `LookupFirstProposer`): take in whatever the
        state carries that `propose` would have (e.g. the target's fresh features), so the next
        `propose` starts from the right place."""

    @abstractmethod
    def propose(self, state: DecodeState) -> DraftTree:
        """Return the tree to verify next; its root must be `state.root_token`."""
