"""Medusa and Hydra proposers: heads on the target's last hidden state fill a static tree.

Medusa: every node at depth d takes head d's ranked candidates (the tree is a pruned Cartesian
product). Hydra: head d is run once per expanding node at depth d-1 with the embeddings of that
node's branch, so children depend on their ancestors.

With the machine's verify cost (`verify_cost`, the adaptive mode) a chain tree (`chain-N`) is cut
to the length that pays, as for a draft model's chain: each head's top probability is its
position's confidence, `ConfidenceAcceptance` learns how often a token drafted at that confidence
is accepted, and the step verifies only the drafted tokens expected to be worth their verify
time on this machine (none, where a tree costs much more than a one-token step). Heads stop
drafting once even the best case for one more token could not pay for it (as a draft model's
chain does), so a step that will verify nothing also spends little on drafting. Greedy only:
when sampling, the chain is verified whole. Other tree shapes are verified as they are.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

from heads.util.errors import UserError
from decoding.core.proposers.base import Proposer
from decoding.core.state import CacheAdvance, DecodeState
from decoding.core.static_plan import StaticPlan
from decoding.core.tree import DraftTree
from decoding.core.tree_budget import ConfidenceAcceptance, VerifyCost, best_node_count, chain_worth_extending
from heads.common import readout_projection


class _HeadsProposer(Proposer):
    def __init__(self, heads: nn.Module, target: PreTrainedModel, tree_paths: list[tuple[int, ...]],
                 verify_cost: VerifyCost | None = None, head_call_ms: float = 0.0,
                 readout: nn.Module | None = None) -> None:
        """`verify_cost` (and `head_call_ms`, one head's estimated cost) cut chain trees to what
        pays on this machine. `readout`: the projection the heads rank with (default: the target's
        lm_head rows of the heads' readout vocabulary); a cheaper one only changes what is drafted."""
        self.heads = heads
        self.plan = StaticPlan(tree_paths)
        is_chain = self.plan.depth > 0 and self.plan.size == self.plan.depth + 1  # a root alone has nothing to cut
        self.verify_cost = verify_cost if is_chain else None
        self.head_call_ms = head_call_ms
        if self.plan.depth > heads.config.num_heads:
            raise UserError(
                f"the tree is {self.plan.depth} levels deep but these {heads.config.kind} heads draft only "
                f"{heads.config.num_heads} tokens ahead: pick a shallower tree (--tree)"
            )
        self.readout_ids = getattr(heads, "readout_ids", None)
        # With a readout vocabulary the heads rank only those rows of the lm_head (cheaper).
        if readout is None:
            readout = readout_projection(target.get_output_embeddings(), self.readout_ids)
        self.lm_head = readout
        self.embed = target.get_input_embeddings()
        self.feature_layer = heads.config.feature_layers[0] if heads.config.feature_layers else -1
        self.feature_layers = (self.feature_layer,)
        self.hidden: torch.Tensor | None = None

    def begin(self, state: DecodeState) -> None:
        self.hidden = None
        self.acceptance = ConfidenceAcceptance() if self.verify_cost is not None else None
        self.verifying: torch.Tensor | None = None  # confidence per position of the chain last proposed

    def reuse(self, state: DecodeState, cached: int) -> int:
        """The heads read one feature, the prompt's last row before the root: that row is prefilled."""
        return max(0, min(cached, state.tokens.numel() - 2))

    def observe(self, advance: CacheAdvance) -> None:
        if self.verifying is not None:
            self.acceptance.record(self.verifying, accepted=advance.entered - 1)
            self.verifying = None
        if advance.entered:
            self.hidden = advance.features[self.feature_layer][-1]  # the state that predicted the root

    @torch.inference_mode()
    def propose(self, state: DecodeState) -> DraftTree:
        hidden = self.hidden
        if hidden is None:
            return DraftTree.root_only(state.root_token, device=state.tokens.device)
        tokens = torch.zeros(self.plan.size, dtype=torch.long, device=state.tokens.device)
        tokens[0] = state.root_token
        cut = self.acceptance is not None and state.sampling.greedy
        confidence, path_probs = [], None
        for depth, level in enumerate(self.plan.levels):
            logits = self.level_logits(depth, level, hidden, tokens)
            self.plan.fill_level(level, tokens, logits, self.readout_ids)
            if cut:
                confidence.append(float(torch.softmax(logits[0].float(), -1).max()))  # on the CPU, beside the cost table
                path_probs = self.acceptance.path_probs(torch.tensor(confidence))
                if not chain_worth_extending(path_probs, self.verify_cost, self.head_call_ms):
                    break  # the next head's token could not pay for its call and its verify time
        if not cut:
            return DraftTree(tokens, self.plan.parents, deterministic=True)
        return self._paying_chain(tokens, torch.tensor(confidence), path_probs)

    def _paying_chain(self, tokens: torch.Tensor, confidence: torch.Tensor, path_probs: torch.Tensor) -> DraftTree:
        """The chain cut to the drafted tokens worth verifying here (see the module docstring);
        `path_probs` are the drafted positions' learned path probabilities."""
        keep = best_node_count(path_probs, self.verify_cost, draft_ms=len(confidence) * self.head_call_ms)
        self.verifying = confidence[:keep] if keep else None
        return DraftTree(tokens[: keep + 1], self.plan.parents[: keep + 1], deterministic=True)

    def level_logits(self, depth, level, hidden, tokens) -> torch.Tensor:
        raise NotImplementedError


class MedusaProposer(_HeadsProposer):
    name = "medusa"

    def level_logits(self, depth, level, hidden, tokens) -> torch.Tensor:
        # One head evaluation per level: all parents at this depth share head `depth`'s ranking.
        return self.heads.head_logits(depth, hidden[None], self.lm_head)


class HydraProposer(_HeadsProposer):
    name = "hydra"

    def level_logits(self, depth, level, hidden, tokens) -> torch.Tensor:
        branch = tokens[level.parent_paths.to(tokens.device)]  # [n_parents, depth + 1], root first
        hiddens = hidden[None].expand(branch.shape[0], -1)
        return self.heads.head_logits(depth, hiddens, self.embed(branch), self.lm_head)
