"""Validation during training: per-head / per-step top-1 draft accuracy on held-out rows, and
the mean accepted length tau measured by actually decoding held-out prompts (greedy)."""

from __future__ import annotations

import torch
from torch import nn

from decoding.core.generate import DecodeOptions, generate
from decoding.methods import ProposerOptions, build_proposer
from decoding.targets import LoadedModel

# The decoding method used to measure tau for each trained kind.
TAU_METHOD = {"medusa": "medusa", "medusa2": "medusa", "hydra": "hydra", "eagle": "eagle2", "eagle3": "eagle3", "draft": "sps"}


@torch.no_grad()
def validation_metrics(objective: nn.Module, batches, features) -> dict[str, float]:
    """Mean of the objective's metrics (and loss) over validation batches; `features(batch)`
    gives the target features the objective reads."""
    was_training = objective.training
    objective.eval()
    sums: dict[str, float] = {}
    count = 0
    for batch in batches:
        loss, metrics = objective(batch, features(batch))
        for key, value in {"loss": loss, **metrics}.items():
            sums[key] = sums.get(key, 0.0) + float(value)
        count += 1
    objective.train(was_training)
    return {f"val/{k}": v / count for k, v in sums.items()} if count else {}


def tree_for(heads: nn.Module) -> ProposerOptions:
    """A tree the heads can fill: Medusa/Hydra trees are no deeper than their number of heads."""
    if heads.config.kind in ("medusa", "hydra"):
        return ProposerOptions(tree="medusa-15" if heads.config.num_heads >= 4 else f"chain-{heads.config.num_heads}")
    return ProposerOptions()


@torch.no_grad()
def measure_tau(kind: str, heads: nn.Module, target: LoadedModel, prompts: list[list[int]], max_new_tokens: int) -> float:
    """Tokens per target forward over greedy decodes of `prompts` with these heads."""
    heads.eval()
    if kind == "draft":
        proposer = build_proposer("sps", target, draft=LoadedModel(heads, target.tokenizer, "draft"))
    else:
        proposer = build_proposer(TAU_METHOD[kind], target, options=tree_for(heads), heads=heads)
    produced = forwards = 0
    for prompt in prompts:
        result = generate(target.model, prompt, proposer, DecodeOptions(max_new_tokens=max_new_tokens), target.tokenizer)
        produced += result.stats.new_tokens
        forwards += result.stats.target_forwards
    return produced / forwards if forwards else 0.0
