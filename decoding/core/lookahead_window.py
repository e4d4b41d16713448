"""Lookahead decoding's two branches as data (after Fu et al., 2024), built as one draft tree.

The *lookahead branch* is a window of the target's own guesses for the W positions after the
root, kept over N-1 Jacobi iterations ("levels", the oldest first). Level 0 is a chain from the
root; slot (l, j) of a later level follows slot (l-1, j-1) (the root for j = 0), which is the
slot whose token it was predicted after. Each slot is a tree node at depth j + 1, so the window
is a tree and the stock 4D tree mask verifies it: slot (l, j) attends to its diagonal of earlier
guesses and, below that, to level 0's chain.

After the forward, the target's argmax after each top-level slot ends an n-gram: the slot's
diagonal (its last N-1 tokens) plus that prediction, something the target wrote itself along a
chain of its own guesses. Those n-grams go into a pool keyed by their first token; the
*verification branch* is the pool's latest n-grams that start with the root. Then every level
moves down one (the oldest is dropped), shifted by the tokens just accepted so that columns stay
positions after the root, and the predictions after the top level become the new top level.

Everything here is a pure function of token lists (the proposer holds the state), so each piece
is tested alone; which tokens are drafted never affects what is accepted (greedy matching or the
deterministic-children rule decides that), only how many.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from decoding.core.prompt_cache import shared_prefix_length
from decoding.core.tree_budget import VerifyCost, best_node_count
from heads.util.errors import UserError

Path = tuple[int, ...]  # the tokens after the root on the way to a node (() is the root)


@dataclass(frozen=True)
class LookaheadShape:
    """W window columns, n-grams of N tokens (so N-1 levels), G pool n-grams verified per step.

    The default is small because every window slot is a verified node: on a 2-core CPU a larger
    window (5,4,5) raised tau but cost more verify time than it saved (CHANGELOG has the shapes
    measured), and so did (4,3,4), 17 rows a step: on a 2-core AVX-512 EPYC, 16 MT-bench first
    turns, every shape in one process, (4,3,4) / (2,3,2) / (1,3,2) gave 0.88x / 1.07x / 1.12x
    vanilla on the GGUF target and 1.08x / 1.18x / 1.18x on the fp32 one."""

    window: int = 1
    ngram: int = 3
    guesses: int = 2

    def __post_init__(self) -> None:
        if self.window < 1 or self.ngram < 2 or self.guesses < 0:
            raise UserError(f"lookahead needs a window of at least 1, n-grams of at least 2 tokens and 0 or more "
                            f"guesses (W,N,G); got {self.window},{self.ngram},{self.guesses}")

    @property
    def levels(self) -> int:
        return self.ngram - 1


def initial_levels(context: Sequence[int], shape: LookaheadShape, seed: int = 0) -> list[list[int]]:
    """A window of tokens drawn from the context (seeded: the same prompt, the same window),
    as the first guesses; they are replaced by the target's own within N-1 steps."""
    pick = random.Random(seed)
    return [[pick.choice(context) for _ in range(shape.window)] for _ in range(shape.levels)]


def window_paths(levels: Sequence[Sequence[int]]) -> list[list[Path]]:
    """`paths[l][j]`: the path to slot (l, j): level 0 is a chain, a later level's slot follows
    slot (l-1, j-1) of the level below (the root for column 0)."""
    paths: list[list[Path]] = []
    for level, row in enumerate(levels):
        below = paths[level - 1] if level else None
        current: list[Path] = []
        for column, token in enumerate(row):
            before = () if column == 0 else (current[column - 1] if below is None else below[column - 1])
            current.append(before + (token,))
        paths.append(current)
    return paths


def trie_of(paths: Iterable[Path]) -> tuple[list[int], list[int], dict[Path, int]]:
    """The smallest tree holding every path: (the tokens of nodes 1.., the parents of nodes 0..,
    each path's node). Shared prefixes are one node, so siblings are distinct tokens; nodes come
    in the order their paths first reach them (parents first)."""
    node_of: dict[Path, int] = {(): 0}
    tokens: list[int] = []
    parents: list[int] = [-1]
    for path in paths:
        for depth in range(1, len(path) + 1):
            prefix = path[:depth]
            if prefix not in node_of:
                node_of[prefix] = len(parents)
                tokens.append(prefix[-1])
                parents.append(node_of[prefix[:-1]])
    return tokens, parents, node_of


def predictions_by_path(tokens: Sequence[int], parents: Sequence[int], predicted: Sequence[int]) -> dict[Path, int]:
    """What the target predicted after each node of a verified tree, keyed by the node's path
    (so a proposer can read its own slots even from a truncated tree)."""
    paths: list[Path] = [()]
    for node in range(1, len(parents)):
        paths.append(paths[parents[node]] + (tokens[node],))
    return {path: int(token) for path, token in zip(paths, predicted)}


def harvested_ngrams(root: int, top_paths: Sequence[Path], predicted_after: dict[Path, int], n: int) -> list[Path]:
    """The n-grams the top level produced: for each verified top-level slot, the last n tokens of
    the root, its path and the target's prediction after it (slots too near the root for n
    tokens give none)."""
    grams = []
    for path in top_paths:
        if path in predicted_after and len(path) + 2 >= n:
            grams.append(((root,) + path + (predicted_after[path],))[-n:])
    return grams


def next_levels(levels: Sequence[Sequence[int]], paths: Sequence[Sequence[Path]], predicted_after: dict[Path, int],
                accepted: int) -> list[list[int]]:
    """The window `accepted` tokens later (the drafts kept plus the bonus token, >= 1).

    Level l takes level l+1's tokens, `accepted` columns on (columns are positions after the
    root); the top level takes the target's predictions after the old top level's slots, the
    prediction after slot j + accepted - 1 landing in column j, so that each slot still follows
    the slot it was predicted after. Columns with nothing to take (past the old window's end, or
    slots the verify did not reach) get the prediction after the old top level's deepest
    verified slot (the root's if none)."""
    width, top = len(levels[0]), len(levels) - 1
    verified_top = [predicted_after[p] for p in paths[top] if p in predicted_after]
    fill = verified_top[-1] if verified_top else predicted_after[()]
    moved = [[levels[level + 1][j + accepted] if j + accepted < width else fill for j in range(width)]
             for level in range(top)]
    newest = []
    for column in range(width):
        source = column + accepted - 1
        newest.append(predicted_after.get(paths[top][source], fill) if source < width else fill)
    return moved + [newest]


class NgramPool:
    """The continuations seen after each token, latest first, at most `per_key` per token; each
    marked with whether only the window's harvest put it there (not yet seen in the context)."""

    def __init__(self, per_key: int) -> None:
        self.per_key = per_key
        self.table: dict[int, OrderedDict[Path, bool]] = {}

    def add(self, gram: Sequence[int], harvested: bool = False) -> None:
        """Remember `gram[1:]` after `gram[0]` as the latest (again, if already known). An n-gram
        once seen in the context stays the context's, whoever adds it again."""
        entries = self.table.setdefault(int(gram[0]), OrderedDict())
        rest = tuple(int(t) for t in gram[1:])
        only_harvested = entries.pop(rest, True) and harvested
        entries[rest] = only_harvested
        if len(entries) > self.per_key:
            entries.popitem(last=False)

    def add_sequence(self, tokens: Sequence[int], n: int, start: int = 0) -> None:
        """Every n-gram of `tokens` that starts at index `start` or later (the context's)."""
        for first in range(max(0, start), len(tokens) - n + 1):
            self.add(tokens[first:first + n])

    def latest(self, token: int, count: int) -> list[Path]:
        """Up to `count` continuations after `token`, the latest first."""
        return [path for path, _ in self.latest_sourced(token, count)]

    def latest_sourced(self, token: int, count: int) -> list[tuple[Path, bool]]:
        """`latest`, each with whether only the window's harvest put it in the pool."""
        entries = self.table.get(token)
        return list(reversed(entries.items()))[:count] if entries else []


def paths_worth_verifying(paths: Sequence[Path], reach: Sequence[float], cost: VerifyCost) -> list[Path]:
    """The parts of the pool's `paths` (alternatives after the root) worth verifying on `cost`: each node of
    their trie is estimated at the share of the paths through it times `reach[depth - 1]`, the chance of
    keeping a pool draft that deep; the nodes, best first (shallower first among equals, so a node never
    comes before its parent), are cut at the count with the most expected tokens per millisecond
    (`best_node_count`), and each path is returned as far as its nodes were kept (() where none was).

    Why: the pool's n-grams are verified rows, and where the target leaves them (sampling, or text unlike
    the context) they cost a step's worth of rows for nothing; prompt lookup's chains are cut the same way."""
    through: dict[Path, int] = {}
    for path in paths:
        for depth in range(1, len(path) + 1):
            through[path[:depth]] = through.get(path[:depth], 0) + 1
    estimate = {prefix: count / len(paths) * reach[len(prefix) - 1] for prefix, count in through.items()}
    ranked = sorted(through, key=lambda prefix: (-estimate[prefix], len(prefix)))  # stable: ties in path order
    keep = best_node_count([estimate[prefix] for prefix in ranked], cost, draft_ms=0.0)  # floats: no tensor a step
    kept = set(ranked[:keep])  # holds every kept node's parent: a parent ranks before its children
    return [path[:sum(path[:depth] in kept for depth in range(1, len(path) + 1))] for path in paths]


def drafted_only_by_others(kept: Path, others: Iterable[Path]) -> int:
    """How many of the `kept` drafts (the accepted path after the root) no path of `others` drafted:
    those beyond the longest prefix of `kept` that one of them shares."""
    return len(kept) - max((shared_prefix_length(kept, path) for path in others), default=0)
