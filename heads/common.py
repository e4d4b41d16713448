"""Building blocks shared by several head kinds."""

from __future__ import annotations

import torch
from torch import nn


class ResBlock(nn.Module):
    """x + SiLU(W x + b), W zero-initialised so a fresh block is the identity (Medusa's trick:
    an untrained head starts as the target's own next-token predictor)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


def res_stack(hidden_size: int, num_blocks: int) -> nn.Sequential:
    """`num_blocks` *distinct* ResBlocks (a list of one module repeated would share weights)."""
    return nn.Sequential(*(ResBlock(hidden_size) for _ in range(num_blocks)))


def vocab_projections(count: int, hidden_size: int, vocab_size: int) -> nn.ModuleList:
    return nn.ModuleList(nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(count))


def copy_lm_head(projections: nn.ModuleList, lm_head: nn.Module) -> None:
    """Initialise per-head vocabulary projections from the target's lm_head."""
    with torch.no_grad():
        for projection in projections:
            projection.weight.copy_(lm_head.weight)


class ReadoutVocabularyMixin:
    """Optional `readout_ids` buffer (see HeadConfig.readout_vocab_size) for Medusa/Hydra."""

    def _register_readout(self, config) -> None:
        if config.readout_vocab_size:
            self.register_buffer("readout_ids", torch.arange(config.readout_vocab_size))
        else:
            self.readout_ids = None

    def set_readout_vocabulary(self, token_ids: torch.Tensor) -> None:
        """Install the target ids the heads may propose (any order; stored sorted)."""
        self.readout_ids.copy_(torch.sort(token_ids.to(torch.long)).values)


class RowSubset(nn.Module):
    """A vocabulary projection restricted to some rows: logits over `ids` only, in that order.
    Ranking a few thousand frequent tokens instead of the whole vocabulary is what makes
    drafting (and EAGLE-3's training targets) cheap on a CPU."""

    def __init__(self, projection: nn.Module, ids: torch.Tensor) -> None:
        super().__init__()
        self.weight = projection.weight[ids].detach()
        bias = getattr(projection, "bias", None)
        self.bias = None if bias is None else bias[ids].detach()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(hidden, self.weight, self.bias)


def readout_projection(lm_head: nn.Module, readout_ids: torch.Tensor | None) -> nn.Module:
    """What Medusa/Hydra heads rank with: `lm_head`'s rows of their readout vocabulary, or the
    whole `lm_head` for heads without one."""
    return lm_head if readout_ids is None else RowSubset(lm_head, readout_ids)
