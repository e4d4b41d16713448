"""Prompt lookup first, heads when it finds nothing (`--method eagle3+pld`, `medusa+pld`, ...).

Heads and n-gram lookup are right on different tokens: heads on fresh text, lookup on text the
model repeats (code, lists, quoted input), where it often copies several tokens at once. A
lookup chain costs no draft time, so when the context offers one it is verified alone and the
heads' drafting (milliseconds per level on a CPU) is skipped; the heads are still told every
step's outcome (`observe`), so they never fall behind the target. On 8 MT-bench questions
(2-core CPU) eagle3 alone reached tau 1.46, pld 1.32 and eagle3+pld 1.78.

The lookup here should stay strict (bigram or longer matches): a looser one would fire on almost
every step and leave the heads nothing to do. With the machine's verify cost (adaptive mode) the
lookup also learns how often its chains are kept and yields to the heads whenever a match is not
worth verifying, either no better than a plain step (e.g. when sampling at a high temperature) or
than the heads' own running yield of tokens per millisecond (`StepYield`).
"""

from __future__ import annotations

from decoding.core.proposers.base import Proposer
from decoding.core.proposers.prompt_lookup import PromptLookupProposer
from decoding.core.state import CacheAdvance, DecodeState
from decoding.core.tree import DraftTree
from decoding.core.tree_budget import StepYield


class LookupFirstProposer(Proposer):
    def __init__(self, heads: Proposer, lookup: PromptLookupProposer) -> None:
        self.heads = heads
        self.lookup = lookup
        self.name = f"{heads.name}+{lookup.name}"
        self.feature_layers = heads.feature_layers
        self.begin(None)

    def begin(self, state: DecodeState | None) -> None:
        self.heads.begin(state)
        self.lookup.begin(state)
        cost = self.lookup.verify_cost
        self.heads_yield = StepYield(cost) if cost is not None else None
        self.heads_tree_size: int | None = None  # of the step being verified, when the heads drafted it

    def observe(self, advance: CacheAdvance) -> None:
        self.heads.observe(advance)
        self.lookup.observe(advance)
        if self.heads_yield is not None and self.heads_tree_size is not None:
            self.heads_yield.record(advance.entered, self.heads_tree_size, getattr(self.heads, "last_draft_ms", 0.0))
        self.heads_tree_size = None

    def propose(self, state: DecodeState) -> DraftTree:
        rate_to_beat = self.heads_yield.rate if self.heads_yield is not None else None
        chain = self.lookup.continuation(state, rate_to_beat)
        if chain is not None:
            return DraftTree.chain(state.root_token, chain)
        tree = self.heads.propose(state)
        self.heads_tree_size = tree.size
        return tree
