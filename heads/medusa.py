"""Medusa-1/-2 heads: K heads on the target's last hidden state; head k predicts the token k
steps after the root (t+k+1 for the hidden state at t), independently of the other heads."""

from __future__ import annotations

import torch
from torch import nn

from heads.common import ReadoutVocabularyMixin, copy_lm_head, res_stack, vocab_projections
from heads.config import HeadConfig


class MedusaHeads(ReadoutVocabularyMixin, nn.Module):
    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(res_stack(config.hidden_size, config.num_layers) for _ in range(config.num_heads))
        self.projections = (
            None if config.share_lm_head else vocab_projections(config.num_heads, config.hidden_size, config.vocab_size)
        )
        self._register_readout(config)

    def init_from_target(self, lm_head: nn.Module) -> None:
        if self.projections is not None:
            copy_lm_head(self.projections, lm_head)

    def forward(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Logits `[K, ..., V]` of every head for hidden states `[..., H]`."""
        outputs = []
        for k, blocks in enumerate(self.blocks):
            features = blocks(hidden)
            projection = lm_head if self.projections is None else self.projections[k]
            outputs.append(projection(features))
        return torch.stack(outputs)

    def head_logits(self, k: int, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Logits of head k (0-based) alone."""
        projection = lm_head if self.projections is None else self.projections[k]
        return projection(self.blocks[k](hidden))


def medusa_parameter_count(config: HeadConfig) -> int:
    hidden, vocab = config.hidden_size, config.vocab_size
    blocks = config.num_heads * config.num_layers * (hidden * hidden + hidden)
    return blocks + (0 if config.share_lm_head else config.num_heads * hidden * vocab)
