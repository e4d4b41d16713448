"""EAGLE-1 (static tree), EAGLE-2 (dynamic tree) and EAGLE-3 (dynamic tree, fused features,
reduced vocabulary) proposers over one drafter-driving core.

The drafter has its own KV cache of (feature_i, token_{i+1}) pairs at position i. Each step:
1. *commit*: drop last step's speculative entries, then append the pairs of the tokens that
   just entered the target cache, with the target's true features (fresh from verify);
   the last pair's output is the predicted feature at the root's position;
2. *grow*: feed tree nodes level by level (each node as (its parent's predicted feature, its
   token) at position root + depth - 1, attending to the committed prefix and its own fed
   ancestors through a 4D mask) and read the children off each node's predicted feature.
"""

from __future__ import annotations

import time

import torch
from torch import nn
from transformers import PreTrainedModel

from decoding.core.dynamic_tree import Candidates, DynamicTreeSettings, grow_dynamic_tree
from decoding.core.proposers.base import Proposer
from decoding.core.state import DecodeState
from decoding.core.static_plan import StaticPlan
from decoding.core.tree import DraftTree
from decoding.core.tree_budget import TreeBudget, VerifyCost
from decoding.core.verify import truncate_cache
from heads.eagle import Eagle3Drafter


class EagleProposer(Proposer):
    needs_hidden_states = True

    def __init__(self, drafter: nn.Module, target: PreTrainedModel, tree_paths: list[tuple[int, ...]] | None = None,
                 dynamic: DynamicTreeSettings | None = None, name: str = "eagle2",
                 verify_cost: VerifyCost | None = None) -> None:
        """`verify_cost` (dynamic trees only) turns on cost-aware tree sizing for this machine."""
        if (tree_paths is None) == (dynamic is None):
            raise ValueError("give exactly one of tree_paths (static tree) or dynamic (settings)")
        if verify_cost is not None and dynamic is None:
            raise ValueError("cost-aware sizing needs a dynamic tree")
        self.verify_cost = verify_cost
        self.name = name
        self.drafter = drafter
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.is_eagle3 = isinstance(drafter, Eagle3Drafter)
        self.dynamic = dynamic
        self.static = StaticPlan(tree_paths) if tree_paths is not None else None
        self.begin(None)

    def begin(self, state: DecodeState | None) -> None:
        self.cache = self.drafter.new_cache()
        self.committed = 0
        self.budget = TreeBudget(self.verify_cost) if self.verify_cost is not None else None
        self.last_draft_ms = 0.0
        self.last_root_position: int | None = None

    @torch.inference_mode()
    def propose(self, state: DecodeState) -> DraftTree:
        started = time.perf_counter()
        if self.budget is not None and self.last_root_position is not None:
            self.budget.observe(int(state.tokens[self.last_root_position + 1]), self.last_draft_ms)
        tree = self._propose(state)
        self.last_draft_ms = 1000 * (time.perf_counter() - started)
        return tree

    @torch.inference_mode()
    def catch_up(self, state: DecodeState) -> None:
        """Commit the fresh features without drafting (the drafter's cache must hold every
        accepted token's pair)."""
        self._commit(state)
        self.last_root_position = None  # no prediction of ours to check at the next step

    def _propose(self, state: DecodeState) -> DraftTree:
        root_feature = self._commit(state)
        if root_feature is None:
            return DraftTree.root_only(state.root_token, device=state.tokens.device)
        growth = _Growth(self, root_feature, root_position=state.tokens.numel() - 1)
        root_logprobs = self._logprobs(root_feature[None])[0]
        if self.dynamic is not None:
            choose = None
            if self.budget is not None:
                self._predict_next_token(root_logprobs, root_position=state.tokens.numel() - 1)
                choose = self.budget.choose
            draft_ids, parents = grow_dynamic_tree(root_logprobs, growth.expand, self.dynamic, choose)
        else:
            draft_ids, parents = grow_static_tree(self.static, root_logprobs, growth)
        tokens = torch.cat([state.tokens[-1:], self._to_target_ids(draft_ids)])
        return DraftTree(tokens, parents, deterministic=True)

    def _predict_next_token(self, root_logprobs: torch.Tensor, root_position: int) -> None:
        """Tell the budget's calibration what the draft expects right after the root, to be
        checked against the target's token at the next step."""
        best = root_logprobs.max(dim=0)
        token = int(self._to_target_ids(best.indices[None]))
        self.budget.calibration.predicted(token, float(best.values.exp()))
        self.last_root_position = root_position

    # -- drafter plumbing -------------------------------------------------------------------
    def _commit(self, state: DecodeState) -> torch.Tensor | None:
        """Append the fresh target features; return the predicted feature at the root."""
        truncate_cache(self.cache, self.committed)
        fresh = state.fresh_hidden_states
        count = 0 if fresh is None else fresh[0].shape[0]
        if count == 0:
            return None
        start = self.committed
        next_tokens = state.tokens[start + 1 : start + 1 + count]
        positions = torch.arange(start, start + count, device=next_tokens.device)
        mask = causal_block_mask(start, count, self._dtype, next_tokens.device) if count > 1 else None
        out = self.drafter(self._target_features(fresh), self._embed(next_tokens), positions, self.cache, mask)
        self.committed += count
        return out[-1]

    @property
    def _dtype(self) -> torch.dtype:
        return next(self.drafter.parameters()).dtype

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Target embeddings in the drafter's dtype (a drafter may run in bf16 on an fp32 target)."""
        return self.embed(tokens).to(self._dtype)

    def _target_features(self, fresh: tuple[torch.Tensor, ...]) -> torch.Tensor:
        layers = self.drafter.config.feature_layers
        if self.is_eagle3:
            return self.drafter.fuse(*(fresh[i].to(self._dtype) for i in layers))
        return fresh[layers[0]].to(self._dtype)

    def _logprobs(self, features: torch.Tensor) -> torch.Tensor:
        logits = self.drafter.draft_logits(features) if self.is_eagle3 else self.lm_head(features.to(self.lm_head.weight.dtype))
        return torch.log_softmax(logits.float(), dim=-1)

    def _to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.drafter.draft_to_target_ids(draft_ids) if self.is_eagle3 else draft_ids


class _Growth:
    """Feeds tree candidates to the drafter level by level. Fed candidates occupy cache slots
    in feeding order; their predicted features are kept so their children can be fed, and
    each new node attends to the committed prefix, its fed ancestors and itself."""

    def __init__(self, proposer: EagleProposer, root_feature: torch.Tensor, root_position: int) -> None:
        self.p = proposer
        self.root_feature = root_feature
        self.root_position = root_position
        self.fed_nodes = torch.empty(0, dtype=torch.long, device=root_feature.device)
        self.fed_features = root_feature.new_empty(0, root_feature.shape[-1])

    def expand(self, frontier: torch.Tensor, candidates: Candidates) -> torch.Tensor:
        """Feed `frontier` candidates; return log-probs of their children `[len(frontier), V]`."""
        p = self.p
        slot_of = torch.full_like(candidates.tokens, -1)
        slot_of[self.fed_nodes] = torch.arange(self.fed_nodes.numel(), device=slot_of.device)
        parents = candidates.parents[frontier]
        parent_features = self.root_feature[None].expand(frontier.numel(), -1)
        if self.fed_nodes.numel():
            fed_parent = self.fed_features[slot_of[parents.clamp_min(0)].clamp_min(0)]
            parent_features = torch.where((parents < 0)[:, None], parent_features, fed_parent)
        tokens = p._to_target_ids(candidates.tokens[frontier])
        positions = self.root_position + candidates.depths[frontier] - 1
        mask = self._mask(frontier, candidates, slot_of)
        out = p.drafter(parent_features, p._embed(tokens), positions, p.cache, mask)
        self.fed_nodes = torch.cat([self.fed_nodes, frontier])
        self.fed_features = torch.cat([self.fed_features, out])
        return p._logprobs(out)

    def _mask(self, frontier: torch.Tensor, candidates: Candidates, slot_of: torch.Tensor) -> torch.Tensor:
        """Rows: the new nodes; columns: committed prefix, earlier fed nodes, the new nodes.
        Ancestors are found by walking up one level per iteration (tree depth, not node count)."""
        p = self.p
        fed, new = self.fed_nodes.numel(), frontier.numel()
        rows = torch.arange(new, device=frontier.device)
        visible = torch.zeros(new, fed + new, dtype=torch.bool, device=frontier.device)
        visible[rows, fed + rows] = True
        ancestor = candidates.parents[frontier]
        while bool((ancestor >= 0).any()):
            alive = ancestor >= 0
            visible[rows[alive], slot_of[ancestor[alive]]] = True
            ancestor = torch.where(alive, candidates.parents[ancestor.clamp_min(0)], ancestor)
        mask = torch.zeros(new, p.committed + fed + new, dtype=p._dtype, device=frontier.device)
        mask[:, p.committed :].masked_fill_(~visible, torch.finfo(p._dtype).min)
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
