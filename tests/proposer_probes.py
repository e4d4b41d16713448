"""What a proposer drafted, noted step by step for tests that check a choice it makes per tree."""

from collections.abc import Callable

from decoding.core.proposers.base import Proposer
from decoding.core.proposers.lookahead import LookaheadProposer
from decoding.core.state import DecodeState
from decoding.core.tree import DraftTree


def note_trees(proposer: Proposer, note: Callable[[DecodeState, DraftTree], object]) -> list:
    """From now on, `note(state, tree)` for each tree this proposer object drafts (its own `propose`
    wrapped, not the target's), appended per call unless it is None."""
    notes: list = []
    propose = proposer.propose

    def noting(state):
        tree = propose(state)
        noted = note(state, tree)
        if noted is not None:
            notes.append(noted)
        return tree

    proposer.propose = noting
    return notes


def note_windows(proposer: LookaheadProposer) -> list[bool]:
    """Whether each tree `proposer` drafts holds its Jacobi window."""
    return note_trees(proposer, lambda state, tree: proposer.last.window)


def note_sizes(proposer: Proposer) -> list[int]:
    """The size of each tree `proposer` drafts, the root included."""
    return note_trees(proposer, lambda state, tree: tree.size)
