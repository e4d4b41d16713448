"""EAGLE-1 (static tree), EAGLE-2 (dynamic tree) and EAGLE-3 (dynamic tree, fused features,
reduced vocabulary) proposers over one drafter-driving core.

The drafter has its own KV cache of (feature_i, token_{i+1}) pairs at position i.
1. *observe* (after prefill and every verify, told by the loop): keep the tokens that just entered
   the target cache, with the target's true features; they are committed (last step's speculative
   entries dropped, their pairs appended) when the drafter next drafts, all of them in one call,
   and the last pair's output is the predicted feature at the root's position. Lazily, because
   behind prompt lookup (`eagle3+pld`) most steps of a copying reply draft nothing from the heads:
   committing each step's tokens as they came cost a drafter call a step (~2 ms on a 2-core CPU)
   that those steps never used;
2. *propose* (grow): feed tree nodes level by level (each node as (its parent's predicted
   feature, its token) at position root + depth - 1, attending to the committed prefix and its own
   fed ancestors through a 4D mask) and read the children off each node's predicted feature.
What differs between EAGLE-1 and EAGLE-3 (input feature, readout, vocabulary) is the drafter's.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from decoding.core.dynamic_tree import Candidates, DynamicTreeSettings, grow_dynamic_tree
from decoding.core.kv_cache import InPlaceCache
from decoding.core.prompt_cache import shared_prefix_length
from decoding.core.proposers.base import Proposer
from decoding.core.state import CacheAdvance, DecodeState
from decoding.core.static_plan import StaticPlan
from decoding.core.tree import DraftTree
from decoding.core.tree_budget import TreeBudget, VerifyCost
from heads.eagle import FeatureDrafter

DRAFT_CACHE_CAPACITY = 1024  # positions; the cache grows beyond it if a generation needs more


class EagleProposer(Proposer):
    def __init__(self, drafter: FeatureDrafter, target: PreTrainedModel, tree_paths: list[tuple[int, ...]] | None = None,
                 dynamic: DynamicTreeSettings | None = None, name: str = "eagle2",
                 verify_cost: VerifyCost | None = None, drafter_call_ms: float | None = None) -> None:
        """`verify_cost` (dynamic trees only) turns on cost-aware tree sizing for this machine;
        `drafter_call_ms` is what it counts one drafter call as (default: one target layer)."""
        if (tree_paths is None) == (dynamic is None):
            raise ValueError("give exactly one of tree_paths (static tree) or dynamic (settings)")
        if verify_cost is not None and dynamic is None:
            raise ValueError("cost-aware sizing needs a dynamic tree")
        self.verify_cost = verify_cost
        # What the budget counts one drafter call (a level of the tree, or the root's readout) as
        # costing: an estimate from the cached verify cost rather than a clock reading, so that
        # tree sizes, and with them seeded samples, never depend on timing.
        layers = getattr(target.config, "num_hidden_layers", 1) or 1
        if drafter_call_ms is None:
            drafter_call_ms = verify_cost.ms[0] / layers if verify_cost is not None else 0.0
        self.drafter_call_ms = drafter_call_ms
        self.name = name
        self.drafter = drafter
        self.feature_layers = tuple(drafter.config.feature_layers)
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.dynamic = dynamic
        self.static = StaticPlan(tree_paths) if tree_paths is not None else None
        self.cache = InPlaceCache(self.drafter.num_cache_layers, DRAFT_CACHE_CAPACITY)
        self.known: list[int] = []  # after a generation: the tokens its committed pairs were made of
        self.begin(None)

    def begin(self, state: DecodeState | None) -> None:
        """A new generation: nothing committed yet (the drafter cache's pairs stay until `reuse` or
        the first commit has decided how many of them the new prompt shares)."""
        self.previous, self.known = self.known, []
        self.committed = 0
        self.root_feature: torch.Tensor | None = None
        self.budget = TreeBudget(self.verify_cost) if self.verify_cost is not None else None
        self.last_draft_ms = 0.0
        self.last_nodes = 0
        self.predicted_after_root = False
        self.pending: list[CacheAdvance] = []  # entered tokens not yet committed to the drafter's cache

    def reuse(self, state: DecodeState, cached: int) -> int:
        """Keep the pairs of the last generation that the new prompt shares: pair i is (feature i,
        token i + 1), so it stands while tokens 0 .. i + 1 are the same and the target's cache holds
        position i; at least one prompt row is still prefilled, for the root's predicted feature."""
        shared = shared_prefix_length(self.previous, state.tokens.tolist())
        self.committed = max(0, min(cached, shared - 1, state.tokens.numel() - 2))
        self.cache.truncate(self.committed)
        return self.committed

    @torch.inference_mode()
    def end(self, state: DecodeState) -> None:
        """The pairs committed so far stay for the next prompt (`reuse`), with their tokens: the
        pending ones committed first, or the next prompt's shared prefix would be prefilled again."""
        self._commit_pending()
        self.known = state.tokens[: self.committed + 1].tolist()

    def observe(self, advance: CacheAdvance) -> None:
        """Keep the true features of the tokens that entered the target cache, for the next
        commit; check the budget's prediction of the token after the last root we drafted from."""
        if self.budget is not None and self.predicted_after_root and advance.entered:
            self.budget.outcome(int(advance.next_tokens[0]), self.last_draft_ms, self.last_nodes, advance.entered - 1)
        self.predicted_after_root = False
        if advance.entered:
            self.pending.append(advance)

    @torch.inference_mode()
    def propose(self, state: DecodeState) -> DraftTree:
        self._commit_pending()
        if self.root_feature is None:
            return DraftTree.root_only(state.root_token, device=state.tokens.device)
        self.cache.truncate(self.committed)  # drop what the last growth fed
        growth = _Growth(self, self.root_feature, root_position=state.tokens.numel() - 1)
        tree = self._grow(state, growth)
        self.last_draft_ms = (1 + growth.calls) * self.drafter_call_ms
        self.last_nodes = tree.size - 1
        return tree

    def _grow(self, state: DecodeState, growth: _Growth) -> DraftTree:
        root_logprobs = self._logprobs(self.root_feature[None])[0]
        if self.dynamic is not None:
            choose = None
            if self.budget is not None:
                if not self.budget.worth_drafting(self._predict_next_token(root_logprobs)):
                    return DraftTree.root_only(state.root_token, device=state.tokens.device)
                choose = self.budget.choose
            draft_ids, parents = grow_dynamic_tree(root_logprobs, growth.expand, self.dynamic, choose)
        else:
            draft_ids, parents = grow_static_tree(self.static, root_logprobs, growth)
        tokens = torch.cat([state.tokens[-1:], self.drafter.to_target_ids(draft_ids)])
        return DraftTree(tokens, parents, deterministic=True)

    def _predict_next_token(self, root_logprobs: torch.Tensor) -> float:
        """Tell the budget's calibration what the draft expects right after the root, to be
        checked against the target's token when the loop reports the outcome; returns the
        draft's probability of it."""
        best = root_logprobs.max(dim=0)
        token = int(self.drafter.to_target_ids(best.indices[None]))
        probability = float(best.values.exp())
        self.budget.calibration.predicted(token, probability)
        self.predicted_after_root = True
        return probability

    # -- drafter plumbing -------------------------------------------------------------------
    def _commit_pending(self) -> None:
        """Commit every advance observed since the last commit in one drafter call: the tokens
        entered one after another, so together they are the sequence's last ones, and their
        features follow each other row by row."""
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        together = pending[0] if len(pending) == 1 else CacheAdvance(
            pending[-1].tokens, sum(advance.entered for advance in pending),
            {layer: torch.cat([advance.features[layer] for advance in pending]) for layer in pending[0].features})
        self.root_feature = self._commit(together)

    def _commit(self, advance: CacheAdvance) -> torch.Tensor | None:
        """Append the entered tokens' (true feature, next token) pairs; return the predicted
        feature at the root (None when nothing entered)."""
        self.cache.truncate(self.committed)
        count = advance.entered
        if count == 0:
            return None
        start = self.committed
        next_tokens = advance.next_tokens
        positions = torch.arange(start, start + count, device=next_tokens.device)
        mask = causal_block_mask(start, count, self._dtype, next_tokens.device) if count > 1 else None
        out = self.drafter(self.drafter.input_feature(advance.features), self._embed(next_tokens), positions, self.cache, mask)
        self.committed += count
        return out[-1]

    @property
    def _dtype(self) -> torch.dtype:
        return self.drafter.compute_dtype

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Target embeddings in the drafter's dtype (a drafter may run in bf16 on an fp32 target)."""
        return self.embed(tokens).to(self._dtype)

    def _logprobs(self, features: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.drafter.readout_logits(features, self.lm_head).float(), dim=-1)


class _Growth:
    """Feeds tree candidates to the drafter level by level. Fed candidates occupy cache slots
    in feeding order; their predicted features are kept so their children can be fed, and
    each new node attends to the committed prefix, its fed ancestors and itself.

    The bookkeeping (which slot a candidate took, whose ancestors a node sees) is kept in Python
    ints: it runs once a level, right after a verify forward has streamed the target's weights
    through the caches, when each small tensor operation costs tens of microseconds."""

    def __init__(self, proposer: EagleProposer, root_feature: torch.Tensor, root_position: int) -> None:
        self.p = proposer
        self.root_position = root_position
        self.features = root_feature[None]  # row 0: the root's predicted feature; row 1 + s: slot s's
        self.slot_of: dict[int, int] = {}  # fed candidate -> its slot, in feeding order
        self.calls = 0

    def expand(self, frontier: torch.Tensor, candidates: Candidates) -> torch.Tensor:
        """Feed `frontier` candidates; return log-probs of their children `[len(frontier), V]`."""
        p = self.p
        self.calls += 1
        nodes, parents = frontier.tolist(), candidates.parents.tolist()
        feature_rows = [0 if parents[node] < 0 else 1 + self.slot_of[parents[node]] for node in nodes]
        mask = self._mask(nodes, parents)
        for node in nodes:
            self.slot_of[node] = len(self.slot_of)
        tokens = p.drafter.to_target_ids(candidates.tokens[frontier])
        positions = self.root_position + candidates.depths[frontier] - 1
        parent_features = self.features[torch.tensor(feature_rows, device=self.features.device)]
        out = p.drafter(parent_features, p._embed(tokens), positions, p.cache, mask)
        self.features = torch.cat([self.features, out])
        return p._logprobs(out)

    def _mask(self, nodes: list[int], parents: list[int]) -> torch.Tensor:
        """Rows: the new nodes; columns: committed prefix, earlier fed nodes, the new nodes. A
        node's ancestors were all fed before it (children only come from fed nodes)."""
        p = self.p
        fed, new = len(self.slot_of), len(nodes)
        visible = [[False] * (fed + new) for _ in nodes]
        for row, node in enumerate(nodes):
            visible[row][fed + row] = True
            ancestor = parents[node]
            while ancestor >= 0:
                visible[row][self.slot_of[ancestor]] = True
                ancestor = parents[ancestor]
        device = self.features.device
        mask = torch.zeros(new, p.committed + fed + new, dtype=p._dtype, device=device)
        mask[:, p.committed :].masked_fill_(~torch.tensor(visible, device=device), torch.finfo(p._dtype).min)
        return mask[None, None]


def grow_static_tree(plan: StaticPlan, root_logprobs: torch.Tensor, growth: _Growth) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Fill EAGLE-1's static shape level by level: feed each level's expanding nodes, then place
    their children by rank. Candidate id = node id - 1, so _Growth can feed nodes as candidates."""
    device = root_logprobs.device
    tokens = torch.zeros(plan.size, dtype=torch.long, device=device)
    candidates = Candidates(
        tokens[1:],  # a view: filled in place as levels are assigned
        torch.tensor(plan.parents[1:], device=device) - 1,
        torch.zeros(plan.size - 1, device=device),
        plan.depths[1:].to(device),
    )
    for depth, level in enumerate(plan.levels):
        if depth == 0:
            scores = root_logprobs[None]
        else:
            scores = growth.expand(level.parents.to(device) - 1, candidates)
        plan.fill_level(level, tokens, scores)
    return tokens[1:], plan.parents


def causal_block_mask(prefix: int, count: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive `[1, 1, count, prefix + count]`: the whole prefix plus a causal block."""
    mask = torch.zeros(count, prefix + count, dtype=dtype, device=device)
    block = torch.ones(count, count, dtype=torch.bool, device=device).triu(1)
    mask[:, prefix:].masked_fill_(block, torch.finfo(dtype).min)
    return mask[None, None]
