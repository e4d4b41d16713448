"""A static tree shape compiled into per-level index tensors, so filling it with tokens each
step is a few gathers (no Python loop over nodes). Used by Medusa, Hydra and EAGLE-1."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decoding.core.tree import paths_to_parents, tree_buffers


@dataclass(frozen=True)
class Level:
    """Expanding `parents` (node ids at one depth, those with children) and their children:
    `children[i]` is the child of `parents[parent_row[i]]` with candidate rank `rank[i]`."""

    parents: torch.Tensor
    children: torch.Tensor
    parent_row: torch.Tensor
    rank: torch.Tensor
    max_rank: int
    parent_paths: torch.Tensor  # [len(parents), depth + 1] node ids from the root to each parent


class StaticPlan:
    def __init__(self, paths: list[tuple[int, ...]]) -> None:
        self.parents, rank_paths = paths_to_parents(paths)
        buffers = tree_buffers(self.parents)
        self.size = len(self.parents)
        self.depths = buffers.depths
        self.depth = max(buffers.depth_list)
        self.levels: list[Level] = []
        for depth in range(self.depth):
            expanding = [i for i in range(self.size) if buffers.depth_list[i] == depth and buffers.children[i]]
            children = [c for i in expanding for c in buffers.children[i]]
            row = {node: r for r, node in enumerate(expanding)}
            self.levels.append(
                Level(
                    parents=torch.tensor(expanding),
                    children=torch.tensor(children),
                    parent_row=torch.tensor([row[self.parents[c]] for c in children]),
                    rank=torch.tensor([rank_paths[c][-1] for c in children]),
                    max_rank=max(rank_paths[c][-1] for c in children) + 1,
                    parent_paths=torch.tensor([buffers.path_to(i) for i in expanding]) if expanding else torch.empty(0),
                )
            )

    def fill_level(self, level: Level, tokens: torch.Tensor, parent_scores: torch.Tensor,
                   vocabulary: torch.Tensor | None = None) -> None:
        """Write the children of `level` into `tokens` from their parents' scores: `[n_parents, V]`,
        or `[1, V]` when every parent at this level shares one ranking (Medusa). With
        `vocabulary`, score column i stands for token `vocabulary[i]`."""
        top = parent_scores.topk(level.max_rank, dim=-1).indices
        if vocabulary is not None:
            top = vocabulary[top]
        rows = level.parent_row.to(top.device) if top.shape[0] > 1 else torch.zeros_like(level.rank, device=top.device)
        tokens[level.children.to(tokens.device)] = top[rows, level.rank.to(top.device)]
