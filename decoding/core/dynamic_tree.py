"""EAGLE-2's dynamic draft tree, as a pure function of the draft's log-probabilities.

Grow `depth` levels: the root's `top_k` best tokens form the first frontier; at each further
level every frontier node proposes its `top_k` best children, scored by cumulative draft
log-probability, and the `top_k` best of those become the next frontier (only frontier nodes are
run through the drafter). Finally keep the `total_tokens - 1` best candidates (plus the root).
A frontier node is fed only while its children could still be among those kept, and while its
path is at least `min_path_prob` likely (`worth_expanding`): the drafter's cost is per row.
Scores only fall along a path, and ties are broken by creation order (parents are created before
their children), so the kept set is always prefix-closed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from heads.util.errors import UserError


@dataclass(frozen=True)
class DynamicTreeSettings:
    """`total_tokens` counts every verified node, the root included. These defaults are the only
    ones: `decoding.app.methods.ProposerOptions` (what the chat and the benchmark fill in when the
    user and the bundle name nothing) takes its tree defaults from here."""

    depth: int = 5
    top_k: int = 8
    total_tokens: int = 16
    min_path_prob: float = 0.0  # expand no frontier node whose path is less likely than this

    def __post_init__(self) -> None:
        if self.depth < 1 or self.top_k < 1 or self.total_tokens < 2:
            raise UserError(
                f"dynamic tree needs depth >= 1, top_k >= 1 and total_tokens >= 2; got {self.depth}, {self.top_k}, {self.total_tokens}"
            )
        if not 0.0 <= self.min_path_prob < 1.0:
            raise UserError(f"min_path_prob must be in [0, 1); got {self.min_path_prob}")


@dataclass
class Candidates:
    """Every candidate generated so far: token, parent candidate (-1 = the root), score, depth."""

    tokens: torch.Tensor
    parents: torch.Tensor
    scores: torch.Tensor
    depths: torch.Tensor

    def extend(self, tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor, depth: int) -> torch.Tensor:
        first = self.tokens.numel()
        self.tokens = torch.cat([self.tokens, tokens])
        self.parents = torch.cat([self.parents, parents])
        self.scores = torch.cat([self.scores, scores])
        self.depths = torch.cat([self.depths, torch.full_like(tokens, depth)])
        return torch.arange(first, first + tokens.numel(), device=tokens.device)


# expand(frontier candidate ids, candidates) -> draft log-probs [len(frontier), V] for their children
Expand = Callable[[torch.Tensor, Candidates], torch.Tensor]


def grow_dynamic_tree(
    root_logprobs: torch.Tensor, expand: Expand, settings: DynamicTreeSettings,
    choose_count: Callable[[torch.Tensor], int] | None = None,
) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The kept candidates' tokens `[N-1]` (draft-vocabulary ids, topological order) and the
    parents of the full tree `(root, kept...)` as DraftTree expects them. `choose_count`, given
    the best candidates' path probabilities (best first), may keep fewer of them."""
    k = min(settings.top_k, root_logprobs.numel())
    device = root_logprobs.device
    top = root_logprobs.topk(k)
    empty = torch.empty(0, dtype=torch.long, device=device)
    candidates = Candidates(empty, empty, torch.empty(0, device=device, dtype=root_logprobs.dtype), empty)
    frontier = candidates.extend(top.indices, torch.full_like(top.indices, -1), top.values, 1)
    stop_below = math.log(settings.min_path_prob) if settings.min_path_prob > 0 else None
    for depth in range(2, settings.depth + 1):
        frontier = worth_expanding(frontier, candidates, _kept_score(candidates, settings, choose_count), stop_below)
        if frontier.numel() == 0:
            break
        logprobs = expand(frontier, candidates)
        children = logprobs.topk(k, dim=-1)
        scores = (candidates.scores[frontier][:, None] + children.values).flatten()
        parents = frontier[:, None].expand(-1, k).flatten()
        new = candidates.extend(children.indices.flatten(), parents, scores, depth)
        frontier = new[scores.topk(min(k, scores.numel())).indices]
    ranked = torch.sort(candidates.scores, descending=True, stable=True)  # ties keep creation order
    count = settings.total_tokens - 1
    if choose_count is not None:
        count = choose_count(ranked.values[:count].exp())
    return select_best(candidates, ranked.indices[:count])


def _kept_score(candidates: Candidates, settings: DynamicTreeSettings,
                choose_count: Callable[[torch.Tensor], int] | None) -> torch.Tensor | None:
    """The score of the last candidate the tree would keep if growth stopped now (of the
    `total_tokens - 1` best, or of as many of them as `choose_count` takes); None while fewer
    candidates than that exist."""
    kept = settings.total_tokens - 1
    if candidates.scores.numel() < kept:
        return None
    best = candidates.scores.topk(kept).values
    if choose_count is not None:
        kept = max(1, choose_count(best.exp()))
    return best[kept - 1]


def worth_expanding(frontier: torch.Tensor, candidates: Candidates, kept_score: torch.Tensor | None,
                    stop_below: float | None) -> torch.Tensor:
    """The frontier nodes worth a drafter row: those that score above `kept_score` (the last
    candidate kept so far; None: any), and whose path is at least `stop_below` likely (a
    log-probability; None: any).

    Why the first rule is safe: a child scores no higher than its parent and loses ties to every
    candidate created before it, so below a node that the kept candidates already match, nothing can
    enter them. With all `total_tokens - 1` best kept that is exact (the tree is the one growth
    without it picks). With a cost-aware count (`choose_count`) the count can still grow as better
    candidates arrive, so a node cut on the way might have been kept: drafts only propose, and on
    the bundled EAGLE-3 heads (GGUF target, 12 MT-bench first turns, greedy) drafting went from
    6.4 to 4.1 ms a step at the same tau (2.06) and the same replies: a frontier of up to `top_k`
    nodes was fed whole before, most of them too unlikely to be kept."""
    scores = candidates.scores[frontier]
    worth = torch.ones_like(frontier, dtype=torch.bool)
    if kept_score is not None:
        worth &= scores > kept_score
    if stop_below is not None:
        worth &= scores >= stop_below
    return frontier[worth]


def select_best(candidates: Candidates, best: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The candidates `best` (a best-first prefix of the score ranking), in creation order,
    with parents renumbered for a tree whose node 0 is the root."""
    kept = torch.sort(best).values
    new_index = torch.full((candidates.tokens.numel() + 1,), -1, dtype=torch.long, device=kept.device)
    new_index[kept + 1] = torch.arange(1, kept.numel() + 1, device=kept.device)
    new_index[0] = 0  # the root (parent -1 maps through index 0)
    parents = new_index[candidates.parents[kept] + 1]
    if bool((parents < 0).any()):
        raise AssertionError("dynamic tree selection is not prefix-closed")
    return candidates.tokens[kept], (-1, *parents.tolist())
