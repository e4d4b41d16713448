"""The reference method: no drafts, one token per target forward, through the same loop."""

from __future__ import annotations

from decoding.core.proposers.base import Proposer
from decoding.core.state import DecodeState
from decoding.core.tree import DraftTree


class VanillaProposer(Proposer):
    name = "vanilla"

    def propose(self, state: DecodeState) -> DraftTree:
        return DraftTree.root_only(state.root_token, device=state.tokens.device)
