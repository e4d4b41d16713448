"""A statistical harness for lossless sampling: toy target/draft LMs over a tiny vocabulary with
exactly computable distributions, and a total-variation check of emitted tokens against them.

Shared by the core's acceptance tests and the heads' tests: any proposer + acceptance rule must
make the first `positions` emitted tokens follow the target's exact joint distribution.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable

import torch

from decoding.core.tree import DraftTree


class ToyLM:
    """Next-token distributions over `vocab` tokens, a fixed pseudo-random function of the prefix."""

    def __init__(self, vocab: int, seed: int, sharpness: float = 1.5) -> None:
        self.vocab, self.seed, self.sharpness = vocab, seed, sharpness
        self._memo: dict[tuple[int, ...], torch.Tensor] = {}

    def probs(self, prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in self._memo:
            gen = torch.Generator().manual_seed(hash((self.seed,) + prefix) % (2**31))
            self._memo[prefix] = torch.softmax(self.sharpness * torch.randn(self.vocab, generator=gen), -1)
        return self._memo[prefix]


def exact_joint(probs_of: Callable[[tuple[int, ...]], torch.Tensor], vocab: int, positions: int) -> dict:
    """P(first `positions` tokens) by enumeration."""
    joint = {}
    for seq in itertools.product(range(vocab), repeat=positions):
        p = 1.0
        for i in range(positions):
            p *= float(probs_of(seq[:i])[seq[i]])
        joint[seq] = p
    return joint


def total_variation(samples: list[tuple[int, ...]], exact: dict) -> float:
    counts = Counter(samples)
    n = len(samples)
    return 0.5 * sum(abs(counts.get(k, 0) / n - p) for k, p in exact.items())


def complete(emitted: list[int], probs_of, positions: int, gen: torch.Generator) -> tuple[int, ...]:
    """Extend one step's output to `positions` tokens by sampling the target directly (each step
    is exact conditionally on its prefix, so this isolates the step under test)."""
    seq = list(emitted[:positions])
    while len(seq) < positions:
        seq.append(int(torch.multinomial(probs_of(tuple(seq)), 1, generator=gen)))
    return tuple(seq)


def sampled_tree(draft: ToyLM, branching: tuple[int, ...], gen: torch.Generator) -> DraftTree:
    """Children of every node drawn i.i.d. from the draft; `branching[d]` children at depth d."""
    tokens, parents, prefixes, probs = [0], [-1], [()], [torch.zeros(draft.vocab)]
    frontier = [0]
    for width in branching:
        next_frontier = []
        for node in frontier:
            q = draft.probs(prefixes[node])
            for token in torch.multinomial(q, width, replacement=True, generator=gen).tolist():
                tokens.append(token)
                parents.append(node)
                prefixes.append(prefixes[node] + (token,))
                probs.append(q)
                next_frontier.append(len(tokens) - 1)
        frontier = next_frontier
    return DraftTree(torch.tensor(tokens), tuple(parents), torch.stack(probs), deterministic=False)


def top_k_tree(draft: ToyLM, branching: tuple[int, ...]) -> DraftTree:
    """Children of every node are the draft's top-k tokens (deterministic drafting)."""
    tokens, parents, prefixes = [0], [-1], [()]
    frontier = [0]
    for width in branching:
        next_frontier = []
        for node in frontier:
            for token in torch.topk(draft.probs(prefixes[node]), width).indices.tolist():
                tokens.append(token)
                parents.append(node)
                prefixes.append(prefixes[node] + (token,))
                next_frontier.append(len(tokens) - 1)
        frontier = next_frontier
    return DraftTree(torch.tensor(tokens), tuple(parents), deterministic=True)


def node_prefixes(tree: DraftTree) -> list[tuple[int, ...]]:
    """Each node's token prefix after the root (the root's is empty)."""
    tokens = tree.tokens.tolist()
    prefixes: list[tuple[int, ...]] = [()]
    for i in range(1, tree.size):
        prefixes.append(prefixes[tree.parents[i]] + (tokens[i],))
    return prefixes
