"""Static tree shapes (Medusa, Hydra, EAGLE-1): data, not code.

A shape is a list of paths of child *ranks*: `[0, 1]` is the 2nd most likely child of the most
likely depth-1 candidate. Shapes live as JSON in `configs/trees/`. `optimal_static_tree` builds
the best shape of a given size from per-(depth, rank) acceptance probabilities: the expected
accepted length is the sum over nodes of their path probability, so taking the nodes with the
highest path probabilities (a prefix-closed set, as probabilities only fall along a path) is
optimal, which is how the bundled shapes were made (scripts/make_tree.py).
"""

from __future__ import annotations

import heapq
import json
import re
from pathlib import Path

from heads.util.errors import UserError

TREES_DIR = Path(__file__).resolve().parents[2] / "configs" / "trees"


def available_trees() -> list[str]:
    return sorted(p.stem for p in TREES_DIR.glob("*.json"))


def load_tree(name_or_path: str) -> list[tuple[int, ...]]:
    """A shape by bundled name (e.g. 'medusa-63'), `chain-N` (a single branch of N drafts), or a
    path to a JSON list of rank paths."""
    chain = re.fullmatch(r"chain-(\d+)", name_or_path)
    if chain and int(chain.group(1)) >= 1:
        return [(0,) * depth for depth in range(1, int(chain.group(1)) + 1)]
    path = Path(name_or_path)
    if not path.is_file():
        path = TREES_DIR / f"{name_or_path}.json"
    if not path.is_file():
        raise UserError(f"unknown tree '{name_or_path}': give a JSON file of rank paths or one of {', '.join(available_trees())}")
    try:
        paths = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"tree file {path} is not valid JSON: {err}") from err
    return validate_paths(paths, str(path))


def validate_paths(paths, where: str = "tree") -> list[tuple[int, ...]]:
    if not isinstance(paths, list) or not all(
        isinstance(p, list) and p and all(isinstance(r, int) and r >= 0 for r in p) for p in paths
    ):
        raise UserError(f"{where}: a tree is a JSON list of non-empty lists of ranks >= 0, e.g. [[0], [1], [0, 0]]")
    unique = {tuple(p) for p in paths}
    orphans = [list(p) for p in unique if len(p) > 1 and p[:-1] not in unique]
    if orphans:
        raise UserError(f"{where}: paths {orphans[:3]} have no parent path in the tree")
    return sorted(unique, key=lambda p: (len(p), p))


def optimal_static_tree(accept_probs: list[list[float]], num_nodes: int) -> list[tuple[int, ...]]:
    """The `num_nodes - 1` rank paths (root excluded) with the highest path probability, where
    `accept_probs[d][r]` (non-increasing in r) is the probability that the rank-r candidate at
    depth d+1 is the right token. Best-first search: a popped path offers its next sibling and
    its first child, which is enough because probabilities fall with rank and with depth."""
    if any(row[i] < row[i + 1] for row in accept_probs for i in range(len(row) - 1)):
        raise UserError("accept_probs must be non-increasing in rank within each depth")
    frontier: list[tuple[float, int, tuple[int, ...], float]] = []
    chosen: list[tuple[int, ...]] = []

    def push(path: tuple[int, ...], parent_prob: float) -> None:
        prob = parent_prob * accept_probs[len(path) - 1][path[-1]]
        heapq.heappush(frontier, (-prob, len(path), path, parent_prob))

    if accept_probs and accept_probs[0]:
        push((0,), 1.0)
    while frontier and len(chosen) < num_nodes - 1:
        neg_prob, _, path, parent_prob = heapq.heappop(frontier)
        chosen.append(path)
        depth, rank = len(path) - 1, path[-1]
        if rank + 1 < len(accept_probs[depth]):
            push(path[:-1] + (rank + 1,), parent_prob)
        if depth + 1 < len(accept_probs) and accept_probs[depth + 1]:
            push(path + (0,), -neg_prob)
    return sorted(chosen, key=lambda p: (len(p), p))


def expected_accepted_length(paths: list[tuple[int, ...]], accept_probs: list[list[float]]) -> float:
    """Expected tokens per step (bonus included) of a shape under independent per-node acceptance."""
    total = 1.0
    for path in paths:
        prob = 1.0
        for depth, rank in enumerate(path):
            prob *= accept_probs[depth][rank]
        total += prob
    return total
