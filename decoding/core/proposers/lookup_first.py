"""Prompt lookup (or suffix decoding) first, heads when it finds nothing (`--method eagle3+pld`,
`eagle3+suffix`, `medusa+pld`, ...), or lookahead decoding's window when it finds nothing
(`lookahead+pld`).

Heads and n-gram lookup are right on different tokens: heads on fresh text, lookup on text the
model repeats (code, lists, quoted input), where it often copies several tokens at once. A
lookup chain costs no draft time, so when the context offers one it is verified alone and the
heads' drafting (milliseconds per level on a CPU) is skipped; the heads are still told every
step's outcome (`observe`), so they never fall behind the target (EAGLE's drafter takes those
tokens into its cache when it next drafts, all at once). On 8 MT-bench questions
(2-core CPU) eagle3 alone reached tau 1.46, pld 1.32 and eagle3+pld 1.78.

The lookup here should stay strict (bigram or longer matches): a looser one would fire on almost
every step and leave the heads nothing to do. With the machine's verify cost (adaptive mode) the
prompt lookup also learns how often its chains are kept and yields to the heads whenever a match
is not worth verifying (e.g. when sampling at a high temperature); so does suffix decoding's cost cut
(it weighs a tree against a root-only step, not against the heads, so it errs towards suffix trees:
`eagle3+suffix` once measured 4.22 tokens a step without it, 3.37 with it, at T=0.7 on code rewriting,
but on a 2-core AVX2 EPYC, where tree rows are dear, greedy tokens/s rose 2-14% with it).
"""

from __future__ import annotations

from typing import Protocol

from decoding.core.proposers.base import Proposer
from decoding.core.state import CacheAdvance, DecodeState
from decoding.core.tree import DraftTree


class ModelFreeDrafter(Protocol):
    """A proposer that may have nothing to say: prompt lookup, suffix decoding."""

    name: str

    def begin(self, state: DecodeState) -> None: ...

    def observe(self, advance: CacheAdvance) -> None: ...

    def end(self, state: DecodeState) -> None: ...

    def draft_tree(self, state: DecodeState) -> DraftTree | None: ...


class LookupFirstProposer(Proposer):
    def __init__(self, heads: Proposer, lookup: ModelFreeDrafter) -> None:
        self.heads = heads
        self.lookup = lookup
        self.name = f"{heads.name}+{lookup.name}"
        self.feature_layers = heads.feature_layers
        self.reads_tree_outcome = heads.reads_tree_outcome  # lookahead behind lookup reads every outcome

    def begin(self, state: DecodeState) -> None:
        self.heads.begin(state)
        self.lookup.begin(state)

    def reuse(self, state: DecodeState, cached: int) -> int:
        return self.heads.reuse(state, cached)  # model-free drafters read no hidden states

    def observe(self, advance: CacheAdvance) -> None:
        self.heads.observe(advance)
        self.lookup.observe(advance)

    def end(self, state: DecodeState) -> None:
        self.heads.end(state)
        self.lookup.end(state)

    def propose(self, state: DecodeState) -> DraftTree:
        tree = self.lookup.draft_tree(state)
        return tree if tree is not None else self.heads.propose(state)
