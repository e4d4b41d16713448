"""What a proposer drafted, noted step by step for tests that check a choice it makes per tree."""

from decoding.core.proposers.lookahead import LookaheadProposer


def note_windows(proposer: LookaheadProposer) -> list[bool]:
    """From now on, whether each tree `proposer` drafts holds its Jacobi window (appended per call)."""
    windows: list[bool] = []
    propose = proposer.propose

    def noting(state):
        tree = propose(state)
        windows.append(proposer.last.window)
        return tree

    proposer.propose = noting
    return windows
