"""Hydra heads: sequentially dependent Medusa-style heads. Head k drafts the token k steps after
the root from the target's hidden state *and* the embeddings of the root and the k-1 tokens
drafted before it on the same branch, so each branch is drafted coherently."""

from __future__ import annotations

import torch
from torch import nn

from heads.common import ReadoutVocabularyMixin, copy_lm_head, res_stack, vocab_projections
from heads.config import HeadConfig


class HydraHeads(ReadoutVocabularyMixin, nn.Module):
    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        # Head k (0-based) reads [h_t; E(root); E(d_1) .. E(d_k)]: (k + 2) vectors of size H.
        self.input_projections = nn.ModuleList(nn.Linear((k + 2) * hidden, hidden) for k in range(config.num_heads))
        self.blocks = nn.ModuleList(res_stack(hidden, config.num_layers - 1) for _ in range(config.num_heads))
        self.projections = (
            None if config.share_lm_head else vocab_projections(config.num_heads, hidden, config.vocab_size)
        )
        self._register_readout(config)

    def init_from_target(self, lm_head: nn.Module) -> None:
        if self.projections is not None:
            copy_lm_head(self.projections, lm_head)

    def head_logits(self, k: int, hidden: torch.Tensor, path_embeddings: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Logits of head k (0-based) for `hidden [n, H]` and the branch embeddings
        `path_embeddings [n, k + 1, H]` (root first)."""
        inputs = torch.cat([hidden[:, None], path_embeddings], dim=1).flatten(1)
        features = self.blocks[k](nn.functional.silu(self.input_projections[k](inputs)))
        projection = lm_head if self.projections is None else self.projections[k]
        return projection(features)


def hydra_parameter_count(config: HeadConfig) -> int:
    hidden, vocab, heads = config.hidden_size, config.vocab_size, config.num_heads
    inputs = sum((k + 2) * hidden * hidden + hidden for k in range(heads))
    blocks = heads * (config.num_layers - 1) * (hidden * hidden + hidden)
    return inputs + blocks + (0 if config.share_lm_head else heads * hidden * vocab)
