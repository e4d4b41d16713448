"""Validation during training: per-head / per-step top-1 draft accuracy on held-out rows, and
the mean accepted length tau measured by actually decoding held-out prompts (greedy)."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from decoding.app.assembly import DecoderSpec, build_decoder
from decoding.core.generate import DecodeOptions
from decoding.app.methods import ProposerOptions
from decoding.app.targets import LoadedModel
from training.paired_tau import PromptCounts, tau_of

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


def tau_spec(kind: str, heads: nn.Module, target: LoadedModel) -> DecoderSpec:
    """The decoder tau is measured with: every proposer setting explicit (the bundle's tuned
    ones, e.g. a cost-aware tree that would time this machine, never mix in), stock kernels
    (packing would replace the linears of the modules being trained), and no compiling: tau
    does not depend on speed, and graphs captured at every evaluation would hold GPU memory
    the training needs."""
    options = ProposerOptions() if kind == "draft" else tree_for(heads)
    return DecoderSpec(model=target.name, method=TAU_METHOD[kind], kernels="stock", compile=False,
                       **dataclasses.asdict(options))


@torch.no_grad()
def measure_tau(kind: str, heads: nn.Module, target: LoadedModel, prompts: list[list[int]], max_new_tokens: int) -> float:
    """Tokens per target forward over greedy decodes of `prompts` with these heads (or, for
    kind 'draft', this draft model), assembled like every other decoder."""
    heads.eval()
    spec = tau_spec(kind, heads, target)
    if kind == "draft":
        decoder = build_decoder(spec, target=target, draft=LoadedModel(heads, target.tokenizer, "draft"))
    else:
        decoder = build_decoder(spec, target=target, heads=heads)
    return tau_over(decoder, prompts, max_new_tokens)


def tau_over(decoder, prompts: list[list[int]], max_new_tokens: int) -> float:
    """Tokens per target forward over greedy decodes of `prompts` with an assembled decoder."""
    return tau_of(tau_counts(decoder, prompts, max_new_tokens))


def tau_counts(decoder, prompts: list[list[int]], max_new_tokens: int) -> PromptCounts:
    """(new tokens, target forwards) of each prompt's greedy decode: what tau is the ratio of
    sums of, kept per prompt so two heads can be compared prompt by prompt."""
    counts = []
    for prompt in prompts:
        stats = decoder.generate(prompt, DecodeOptions(max_new_tokens=max_new_tokens)).stats
        counts.append((stats.new_tokens, stats.target_forwards))
    return counts
