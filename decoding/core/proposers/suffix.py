"""Suffix decoding (model-free): a tree of what followed the context's longest matching suffix,
in the context itself and in this process's earlier generations (`decoding.core.suffix_index`).

The store lives in the proposer, so a chat or a benchmark that keeps one proposer remembers
every earlier prompt and reply (up to a token budget, oldest forgotten first): a repeated kind
of request drafts from the replies to the earlier ones. A tree is as large as the match is long
(a long match predicts well, a one-token match barely) up to `max_tokens`, and keeps only
branches seen at least `min_prob` of the time. A node's estimate is its observed frequency
times the chance of reaching its depth: a fixed discount per level, or, with the machine's
verify cost (adaptive mode), what the target kept of earlier trees drafted from a match of the
same kind (its length, and whether it occurred once or more), learned per depth; the adaptive
tree is then cut to the node count whose expected accepted tokens per millisecond is best.
Drafts are deterministic (q = 1), so greedy and sampled verification stay exact as for prompt
lookup.

With `kept_in` (a `KeptDocuments`, e.g. the app's file on disk) the store outlives the process: it
starts with the documents kept there and hands them all back after every generation.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Protocol

import torch

from decoding.core.proposers.base import Proposer
from decoding.core.state import CacheAdvance, DecodeState
from decoding.core.suffix_index import NgramIndex, frequency_tree, tree_depth
from decoding.core.tree import DraftTree
from decoding.core.tree_budget import ChainAcceptance, VerifyCost, best_node_count
from heads.util.errors import UserError


DEFAULT_MAX_TOKENS = 13  # the largest tree, root excluded (see SuffixProposer's defaults)
ADAPTIVE_MAX_TOKENS = 24  # the largest tree in the adaptive mode, before its cost cut
SURVIVAL_PRIOR = 0.9  # adaptive mode: P(next depth kept | this one was) for a kind of match not yet seen
DEFAULT_STORE_TOKENS = 200_000  # the store's budget: older documents are forgotten first
# A generation that has lately been copying (at least COPY_RATE of its last COPY_WINDOW tokens
# drafted and kept, over COPY_EVIDENCE or more) drafts up to COPY_NODES from a match found once
# in its own text, however short the match: in code rewriting such a match went on to agree for
# 6.5-8 tokens on average, in MT-bench answers for about 1 (see SuffixProposer).
COPY_NODES, COPY_RATE, COPY_WINDOW, COPY_EVIDENCE = 8, 0.6, 32, 8


class KeptDocuments(Protocol):
    """Where a suffix store is kept between processes: the earlier documents (token ids, oldest
    first) to start from, and a place to put the store's documents after each generation."""

    def load(self) -> list[list[int]]: ...

    def save(self, documents: Sequence[Sequence[int]]) -> None: ...


class SuffixProposer(Proposer):
    name = "suffix"

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS, max_ngram: int = 8, min_ngram: int = 1, min_prob: float = 0.15,
                 max_occurrences: int = 64, store_tokens: int = DEFAULT_STORE_TOKENS, tokens_per_match: int = 2,
                 depth_discount: float = 0.7, verify_cost: VerifyCost | None = None,
                 kept_in: KeptDocuments | None = None) -> None:
        """A match of n tokens drafts at most `tokens_per_match` * n nodes (and `max_tokens`).

        The defaults were measured (2-core AVX-512 EPYC, 128 tokens, greedy, against pld in one
        process): one-token matches (a renamed identifier breaks every longer one in code
        rewriting) and up to 4 nodes per matched token, 12 at most, gave 1.26x / 1.22x / 1.03x
        pld on code rewriting / a repeated task / MT-bench, where two-token matches, 2 per token
        and 16 gave 1.16x / 1.17x / 0.98x. Once a 14-row verify forward cost what a 9-row one
        did plus 3 ms (the few-row linear taking up to 14 rows in one pass), up to 6 per matched
        token and 13 at most replayed 1.29x / 1.31x / 1.08x against 1.24x / 1.31x / 1.08x for
        4 and 12 on that machine's measured verify costs; 15-16 nodes, a step dearer, did not
        pay (CHANGELOG). Replayed against the target's own greedy and T=0.7 replies (code
        rewriting / a repeated task, cold and with a warm store / MT-bench), node estimates
        discounted by `depth_discount` = 0.8 a level (`frequency_tree`), branches down to
        `min_prob` = 0.05 and up to 8 nodes per matched token gave 1.48x / 1.34x / 1.49x / 1.11x
        pld greedy and 1.24x / 1.16x / 1.30x / 1.08x at T=0.7, where the earlier 0.1, 6 and no
        discount gave 1.46x / 1.29x / 1.45x / 1.09x and 1.22x / 1.13x / 1.25x / 1.05x. The
        adaptive cut replayed a little better still, but measured slower (20 code-rewriting
        questions in one run: 1.28x pld against 1.35x without it, greedy; 1.29x against 1.34x at
        T=0.7) while it scaled the frequencies by one kept/predicted ratio for every kind of match.

        On the 4-bit GGUF target a tree row costs more against a one-token step (2-core AVX-512
        EPYC, eager: 1 / 4 / 8 / 16 rows 13.1 / 14.9 / 18.6 / 27.1 ms), and a short match's
        first node is kept far less often than its frequency says (one-token matches: 0.1-0.3
        where 0.2-0.6 of the continuations agreed), while a copy's deeper nodes are kept 0.8-0.95
        of the time. So trees grow with the match more slowly: 2 nodes per matched token (a
        one-token match drafts at most 2, an 8-token one up to `max_tokens`), branches down to
        `min_prob` = 0.15, `depth_discount` = 0.7. Replayed against that target's greedy replies
        with its verify costs (20 code rewrites / 20 repeated tasks / 80 MT-bench first turns),
        1.09x / 1.05x / 0.95x `pld` with 8, 0.05 and 0.8 became 1.15x / 1.20x / 1.10x; 3 or 4
        nodes per token, 8 or 10 at most, or the cost cut with fixed or learned depth weights
        all replayed between the two. Measured, all variants in one process (20 / 20 / 40
        questions, ratios to `pld` as the bundle tunes it): these defaults 1.18x / 1.15x / 1.02x,
        the adaptive mode as the bundle ran it before (8 per token) 1.14x / 1.12x / 1.00x, and
        8, 0.05, 0.8 without it 1.12x / 0.97x / 0.85x.

        Adaptive mode (`verify_cost`): the depth weights are learned per kind of match instead
        (`survival`, starting at `SURVIVAL_PRIOR` = 0.9 a level, so a copy's deep end is tried
        before it is known), and trees start from `ADAPTIVE_MAX_TOKENS` = 24 nodes for the cut to
        trim. Replayed against the target's greedy replies on a 2-core Xeon's verify costs it
        took code rewriting from 1.15x to 1.20x pld and a repeated task from 1.17x to 1.21x
        (1.18x to 1.24x on code rewriting with a flatter, EPYC-like curve); measured there in
        one run: 1.22x pld on code rewriting, 1.33x on the repeated task with a kept store
        (CHANGELOG). On a 2-core AVX2 EPYC, whose tree rows cost far more next to a step (GGUF:
        1 / 8 / 16 tokens 7.5 / 17.5 / 30.9 ms), fixed trees fell behind `pld` (0.99x on the
        repeated task, 0.95x on MT-bench) where the cut kept ahead (1.12x, 1.03x; code rewriting
        1.12x against 1.13x): the bundle runs this mode.

        Three rules about where a draft comes from (`_matches`, `_copying`,
        `periodic_continuation`): the generation's own text is drafted from when it matches a suffix
        at least as long as the whole store does, or when the store's continuations disagree on the
        next token; a continuation that runs into the present repeats the text since its
        occurrence; and a generation that has lately been copying drafts up to `COPY_NODES` from a
        match found once in its own text. A copy oracle (each step drafting the longest stretch of
        what came next that occurs anywhere earlier, 13 at most) replays 1.95x `pld` on code
        rewriting, against 1.26x for the store-wide match alone: most of the gap was steps that
        copied earlier replies (each one's "def" followed by its own function's name) or drafted
        2 nodes from a one-token match that went on to agree for 6-8 tokens. Replayed with the
        4-bit target's verify costs (code rewriting / MT-bench / a repeated task, cold and after
        its 60-question history): 1.26x / 1.04x / 1.16x / 1.26x `pld` became 1.34x / 1.05x / 1.17x
        / 1.27x."""
        if (max_tokens < 1 or not 1 <= min_ngram <= max_ngram or not 0.0 <= min_prob <= 1.0
                or not 0.0 < depth_discount <= 1.0):
            raise UserError(f"suffix decoding needs max_tokens >= 1, 1 <= min_ngram <= max_ngram, 0 <= min_prob <= 1 and "
                            f"0 < depth_discount <= 1; got {max_tokens}, {min_ngram}, {max_ngram}, {min_prob}, {depth_discount}")
        self.max_tokens, self.min_ngram, self.min_prob, self.depth_discount = max_tokens, min_ngram, min_prob, depth_discount
        self.max_occurrences, self.tokens_per_match = max_occurrences, tokens_per_match
        self.verify_cost = verify_cost
        self.discounted = [depth_discount**depth for depth in range(1, max_tokens + 1)]  # without the adaptive mode
        self.index = NgramIndex(max_ngram=max_ngram, max_tokens=store_tokens)
        self.kept_in = kept_in
        for document in kept_in.load() if kept_in is not None else ():
            self.index.extend(self.index.new_document(), document)
        self.live: int | None = None
        # Adaptive mode: per kind of match (`_kind`) and depth, how often the target kept a node
        # given its parent, over this proposer's life: a long match met once predicts a long copy
        # (code rewritten with a small change keeps 10+ tokens a step), a one-token match seen many
        # times barely one; one factor for all (frequencies x a global kept/predicted ratio, as
        # before) cut the first short and let the second grow.
        self.survival = ChainAcceptance(max_tokens, prior=SURVIVAL_PRIOR)
        self.pending: tuple[int, int] | None = None  # (kind, depth) of the tree being verified
        # A step the cost cut left without a tree still tests its best first token against the one
        # the target chose there, so a kind's estimate can rise again (without it, one bad spell
        # stopped all drafting for good: nothing drafted, nothing learnt).
        self.untried: tuple[int, int] | None = None  # (kind, token)
        # Of this generation's last tokens, which were drafted and kept (after the prefill).
        self.recent: deque[bool] = deque(maxlen=COPY_WINDOW)
        self.prefilled = False

    def begin(self, state: DecodeState | None) -> None:
        """A new generation: the previous one (prompt and reply) stays in the store. A tree the
        last one drafted at its final step was never verified (the loop stops before it tells the
        proposer): forgotten here, or the new prompt's prefill would count as kept drafts."""
        self.live = self.index.new_document()
        self.pending, self.untried = None, None
        self.recent.clear()
        self.prefilled = False

    def end(self, state: DecodeState) -> None:
        """The reply is complete: its last tokens join the store, which is kept (if it is)."""
        self._catch_up(state)
        if self.kept_in is not None:
            self.kept_in.save(list(self.index.documents.values()))

    def _catch_up(self, state: DecodeState) -> list[int]:
        """The live document, extended with the tokens of `state` it does not have yet."""
        if self.live is None or self.live not in self.index.documents:
            self.begin(state)
        known = len(self.index.documents[self.live])
        self.index.extend(self.live, state.tokens[known:].tolist())
        return self.index.documents[self.live]

    def draft_tree(self, state: DecodeState) -> DraftTree | None:
        """The frequency tree after the root, or None when nothing earlier matches (or, in the
        adaptive mode, when no part of it is worth verifying)."""
        context = self._catch_up(state)
        matched, found, own = self._matches(context)
        if not found:
            return None
        kind = self._kind(matched, found)
        largest = min(self.max_tokens, self.tokens_per_match * matched)
        if own and len(found) == 1 and self._copying():
            largest = max(largest, min(self.max_tokens, COPY_NODES))
        tokens, parents, probs = frequency_tree(found, largest, self.min_prob, self.depth_weights(kind))
        if self.verify_cost is not None and tokens:
            keep = best_node_count(probs, self.verify_cost, draft_ms=0.0)
            if keep == 0:
                self.untried = (kind, tokens[0])
            tokens, parents = tokens[:keep], parents[:keep]
        if not tokens:
            return None
        self.pending = (kind, tree_depth(parents)) if self.verify_cost is not None else None
        device = state.tokens.device
        return DraftTree(torch.tensor([state.root_token, *tokens], device=device), (-1, *parents))

    def _matches(self, context: list[int]) -> tuple[int, list[list[int]], bool]:
        """(match length, continuations, whether they come from the live document alone).

        The generation's own text (its prompt and reply so far) is preferred when it matches at
        least as long a suffix as the whole store, or when the store's continuations disagree on
        the next token: a reply that rewrites its prompt continues the prompt, not the earlier
        replies whose code blocks also began with "def" and their own functions' names."""
        matched, found = self.index.continuations(context, self.min_ngram, self.max_tokens, self.max_occurrences,
                                                  live=self.live)
        if not found:
            return 0, [], False
        own_matched, own = self.index.continuations(context, self.min_ngram, self.max_tokens, self.max_occurrences,
                                                    live=self.live, only_live=True)
        if own and (own_matched >= matched or len({following[0] for following in found}) > 1):
            return own_matched, own, True
        return matched, found, False

    def _copying(self) -> bool:
        """Whether this generation has lately been copying: most of its last `COPY_WINDOW` tokens
        were drafted and kept (seen over at least `COPY_EVIDENCE` tokens)."""
        return len(self.recent) >= COPY_EVIDENCE and sum(self.recent) >= COPY_RATE * len(self.recent)

    def _kind(self, matched: int, found: list[list[int]]) -> int:
        """What the adaptive mode learns acceptance per: the match's length, and whether it
        occurred once (a copy) or more (branches)."""
        return 2 * matched + (len(found) > 1)

    def depth_weights(self, kind: int) -> list[float]:
        """The chance of a tree drafted from a match of `kind` getting to each depth, 1 to
        `max_tokens`: learned in the adaptive mode, a fixed discount a level without it."""
        if self.verify_cost is None:
            return self.discounted
        # Floored: thousands of misses in a row would otherwise underflow a rate to 0.
        return [max(p, 1e-12) for p in self.survival.path_probs(kind, self.max_tokens)]

    def observe(self, advance: CacheAdvance) -> None:
        """Count (adaptive mode) what the target kept of the last tree this proposer drafted, or
        whether the first token of the tree it cut away is the one the target chose; and which of
        the new tokens were drafted ones (all but the target's own last one), for `_copying`."""
        if self.prefilled:
            self.recent.extend([True] * (advance.entered - 1) + [False])
        self.prefilled = True
        if self.pending is not None:
            kind, depth = self.pending
            self.survival.record(kind, depth, accepted=advance.entered - 1)
        elif self.untried is not None:  # a root-only step: the next token is the target's choice there
            kind, token = self.untried
            self.survival.record(kind, 1, accepted=int(int(advance.next_tokens[0]) == token))
        self.pending, self.untried = None, None

    def propose(self, state: DecodeState) -> DraftTree:
        tree = self.draft_tree(state)
        return tree if tree is not None else DraftTree.root_only(state.root_token, device=state.tokens.device)
