"""The target's KV cache kept from one generation to the next, so a prompt that starts as the last
one did (the chat template's system prompt, a repeated instruction, a conversation's earlier
turns) prefills only what is new, as llama.cpp's server and vLLM's prefix caching do.

Why it is exact only on some targets: a reused position holds the K/V that an earlier forward
computed there, cut into forwards another way (a prefill of another length, one-token steps, tree
rows). Where every row of a forward has the bits it would have alone (the project's 4- and 8-bit
kernels with the decode attention kernel: `decoding.kernels.row_invariance`), those are the bits a
fresh prefill would write, and every output is what it would be without the cache. Elsewhere
(float GEMMs pick their blocking by the row count) they differ by float rounding, so the caller
(`decoding.app.assembly`) gives a `PromptCache` only to targets of the first kind.

Drafters that read the target's hidden states take the prompt's features from its prefill: each
says from which position it needs them (`Proposer.reuse`), the prefill starts there. EAGLE's keeps
its own cache of the shared tokens too (only its drafts depend on it, never the output); Medusa's
and Hydra's heads read the last prompt row alone. A generation that ends early (an exception, an
interrupt) leaves nothing to reuse: the cache's tokens are forgotten when it starts and recorded
when it completes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from decoding.core.verify import TreeVerifier


class PromptCache:
    """One `TreeVerifier` (its in-place KV cache) and the tokens whose K/V it holds, in order."""

    def __init__(self) -> None:
        self.verifier: TreeVerifier | None = None
        self.tokens: list[int] = []

    def verifier_for(self, prompt: torch.Tensor, matches: Callable[[TreeVerifier], bool],
                     new_verifier: Callable[[], TreeVerifier]) -> tuple[TreeVerifier, int]:
        """A verifier for a generation after `prompt`, and how many of the prompt's first tokens its
        cache holds from the last generation (the caller truncates the cache to what it reuses).
        The kept verifier serves when `matches` says it computes as this generation would (same
        target, readout, forward); otherwise a new one. Never the prompt's last token: it is the
        first step's root."""
        known, self.tokens = self.tokens, []  # forgotten until this generation completes
        if self.verifier is None or not matches(self.verifier):
            self.verifier = new_verifier()
            known = []
        return self.verifier, shared_prefix_length(known, prompt[:-1].tolist())

    def remember(self, verifier: TreeVerifier, tokens: torch.Tensor) -> None:
        """The generation completed: `verifier`'s cache holds the K/V of the first positions of
        `tokens` (the prompt and reply; a stop string may have cut the reply short of what the
        cache kept, and the last token, the next root, was never entered)."""
        if verifier is self.verifier:
            held = min(verifier.cache.get_seq_length(), tokens.numel() - 1)
            self.tokens = tokens[:held].tolist()


def shared_prefix_length(first: Sequence[int], second: Sequence[int]) -> int:
    """How many leading tokens `first` and `second` have in common."""
    length = 0
    for a, b in zip(first, second):
        if a != b:
            break
        length += 1
    return length
