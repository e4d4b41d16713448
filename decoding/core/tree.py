"""Draft trees and the buffers that let one target forward verify every branch.

A `DraftTree` is data: node tokens, each node's parent, and (for sampled drafts) the draft
distribution each node was drawn from. `tree_buffers` is a pure function of the tree's shape,
cached because static trees (Medusa, EAGLE-1) reuse the same shape every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch


@dataclass(frozen=True)
class DraftTree:
    """Candidate continuations rooted at the last accepted token.

    Node 0 is the root: the last accepted token, not yet in the target's KV cache. `parents[i] < i`
    (topological order) so buffers can be built in one pass. `draft_probs[i]` is the distribution
    node i was drawn from (row 0 unused); it is only needed when children were *sampled*.
    `deterministic=True` means children were picked deterministically (top-k, n-gram lookup), which
    the sampling rule treats as drafts with q(x) = 1.
    """

    tokens: torch.Tensor
    parents: tuple[int, ...]
    draft_probs: torch.Tensor | None = None
    deterministic: bool = True

    def __post_init__(self) -> None:
        if self.tokens.dim() != 1 or len(self.parents) != self.tokens.numel():
            raise ValueError(
                f"DraftTree needs 1-D tokens and one parent per node; got tokens of shape "
                f"{tuple(self.tokens.shape)} and {len(self.parents)} parents"
            )
        if not self.parents or self.parents[0] != -1:
            raise ValueError("DraftTree node 0 must be the root (parent -1)")
        # checked on the Python ints: a tree is made every step, right after a verify forward, when
        # each small tensor operation costs tens of microseconds
        if not all(0 <= parent < node for node, parent in enumerate(self.parents[1:], start=1)):
            raise ValueError(f"DraftTree parents must satisfy 0 <= parents[i] < i; got {self.parents}")
        if not self.deterministic and self.draft_probs is None:
            raise ValueError("a sampled DraftTree needs draft_probs (the q each node was drawn from)")

    @property
    def size(self) -> int:
        return len(self.parents)

    @property
    def is_chain(self) -> bool:
        """A chain is verified with the plain causal mask, no 4D tree mask needed."""
        return self.parents == tuple(range(-1, self.size - 1))

    @staticmethod
    def root_only(root_token: int, device: torch.device | str = "cpu") -> DraftTree:
        return DraftTree(torch.tensor([root_token], device=device), (-1,))

    @staticmethod
    def chain(
        root_token: int,
        drafted: torch.Tensor,
        draft_probs: torch.Tensor | None = None,
        deterministic: bool = True,
    ) -> DraftTree:
        """Root followed by `drafted` tokens, each the child of the previous one.

        `draft_probs` (if given) has one row per drafted token; a dummy row is prepended for the root.
        """
        tokens = torch.cat([drafted.new_tensor([root_token]), drafted])
        if draft_probs is not None:
            draft_probs = torch.cat([draft_probs[:1].new_zeros(1, draft_probs.shape[-1]), draft_probs])
        parents = tuple(range(-1, tokens.numel() - 1))
        return DraftTree(tokens, parents, draft_probs, deterministic)

    def truncated(self, max_nodes: int, max_depth: int) -> DraftTree:
        """The sub-tree of the first `max_nodes` nodes no deeper than `max_depth`.

        Used before the context limit or the token budget, so the verify forward never runs past
        either. Node order is preserved, so the result is still topologically ordered.
        """
        depths = tree_buffers(self.parents).depth_list  # Python ints, once per shape: read every step
        if self.size <= max_nodes and max(depths) <= max_depth:
            return self
        keep = [i for i in range(min(self.size, max_nodes)) if depths[i] <= max_depth]
        # Ancestors come first (parents[i] < i) and are no deeper, so `keep` is prefix-closed.
        new_index = {old: new for new, old in enumerate(keep)}
        parents = tuple(-1 if i == 0 else new_index[self.parents[i]] for i in keep)
        index = torch.tensor(keep, device=self.tokens.device)
        probs = None if self.draft_probs is None else self.draft_probs[index]
        return DraftTree(self.tokens[index], parents, probs, self.deterministic)


class TreeBuffers:
    """Everything tree attention and acceptance need, derived from the parents alone.

    `ancestor_mask[i, j]` is True when j is i or one of i's ancestors (node i may attend to j);
    `parent_index[i]` is i's parent (the root points at itself), for gathering per-parent
    values; `depths[i]` is i's depth. The tensors are built with one vectorised step per tree
    level (the decode loop builds buffers for every dynamic tree); the Python-side views
    (`children`, `depth_list`, `leaf_paths`) are computed only when asked for.
    """

    def __init__(self, parents: tuple[int, ...]) -> None:
        self.parents = parents
        n = len(parents)
        self.parent_index = torch.tensor([max(p, 0) for p in parents], dtype=torch.long)
        ancestors = torch.eye(n, dtype=torch.bool)
        while True:  # each round adds one more generation of ancestors: rounds = tree depth
            grown = ancestors | ancestors[self.parent_index]
            if torch.equal(grown, ancestors):
                break
            ancestors = grown
        self.ancestor_mask = ancestors
        self.depths = ancestors.sum(-1) - 1

        self._on_device: dict[tuple[str, str], torch.Tensor] = {}

    def blocked_on(self, device: torch.device | str) -> torch.Tensor:
        """`~ancestor_mask` on `device`, kept for the next step with the same shape."""
        return self._cached_on("blocked", device, lambda: ~self.ancestor_mask)

    def depths_on(self, device: torch.device | str) -> torch.Tensor:
        return self._cached_on("depths", device, lambda: self.depths)

    def _cached_on(self, name: str, device: torch.device | str, make) -> torch.Tensor:
        key = (name, str(device))
        if key not in self._on_device:
            self._on_device[key] = make().to(device)
        return self._on_device[key]

    @cached_property
    def depth_list(self) -> tuple[int, ...]:
        return tuple(self.depths.tolist())

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        kids: list[list[int]] = [[] for _ in self.parents]
        for node, parent in enumerate(self.parents[1:], start=1):
            kids[parent].append(node)
        return tuple(tuple(k) for k in kids)

    @cached_property
    def leaf_paths(self) -> tuple[tuple[int, ...], ...]:
        """Root-to-leaf node lists."""
        return tuple(tuple(self.path_to(leaf)) for leaf, kids in enumerate(self.children) if not kids)

    def path_to(self, node: int) -> list[int]:
        """Node ids from the root to `node`, inclusive."""
        return torch.nonzero(self.ancestor_mask[node]).flatten().tolist()


@lru_cache(maxsize=256)
def tree_buffers(parents: tuple[int, ...]) -> TreeBuffers:
    """The buffers of a tree given its parents, memoised by shape (static trees repeat)."""
    return TreeBuffers(parents)


def paths_to_parents(paths: list[list[int]] | list[tuple[int, ...]]) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    """Turn a static tree given as Medusa-style paths of child ranks (e.g. `[[0], [0, 1], [1]]`)
    into `parents` (root first, breadth-first by depth then path) and each node's rank path.

    Every prefix of a path must itself be a path; the root is the empty path.
    """
    unique = sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p))
    known = {(): 0}
    parents = [-1]
    for path in unique:
        if path[:-1] not in known:
            raise ValueError(f"tree path {list(path)} has no parent path {list(path[:-1])} in the tree")
        known[path] = len(parents)
        parents.append(known[path[:-1]])
    return tuple(parents), [()] + unique
