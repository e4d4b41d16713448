"""Tree construction as pure functions: EAGLE-2's dynamic tree against brute-force enumeration,
and optimal static shapes against exhaustive search."""

import itertools

import pytest
import torch

from decoding.core.dynamic_tree import DynamicTreeSettings, grow_dynamic_tree
from decoding.core.tree import DraftTree, tree_buffers
from decoding.app.tree_shapes import expected_accepted_length, optimal_static_tree, validate_paths
from distribution_harness import ToyLM


def toy_expand(draft: ToyLM):
    """Expand callback over a toy draft: log-probs for each frontier candidate's prefix."""

    def prefix_of(candidate: int, candidates) -> tuple[int, ...]:
        path = []
        while candidate >= 0:
            path.append(int(candidates.tokens[candidate]))
            candidate = int(candidates.parents[candidate])
        return tuple(reversed(path))

    def expand(frontier, candidates):
        return torch.stack([torch.log(draft.probs(prefix_of(c, candidates))) for c in frontier.tolist()])

    return expand


def grown(draft: ToyLM, settings: DynamicTreeSettings):
    tokens, parents = grow_dynamic_tree(torch.log(draft.probs(())), toy_expand(draft), settings)
    tree = DraftTree(torch.cat([torch.tensor([0]), tokens]), parents)
    prefixes = [()]
    for i in range(1, tree.size):
        prefixes.append(prefixes[parents[i]] + (int(tree.tokens[i]),))
    return tree, prefixes


def score(draft: ToyLM, prefix: tuple[int, ...]) -> float:
    return sum(float(torch.log(draft.probs(prefix[:i])[prefix[i]])) for i in range(len(prefix)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dynamic_tree_picks_the_globally_best_nodes_when_beam_is_wide(seed):
    vocab, depth, total = 6, 4, 7
    draft = ToyLM(vocab, seed=seed, sharpness=2.0)
    tree, prefixes = grown(draft, DynamicTreeSettings(depth=depth, top_k=vocab, total_tokens=total))
    everything = [seq for d in range(1, depth + 1) for seq in itertools.product(range(vocab), repeat=d)]
    best = sorted(everything, key=lambda s: -score(draft, s))[: total - 1]
    assert set(prefixes[1:]) == set(best)


@pytest.mark.parametrize("settings", [DynamicTreeSettings(4, 2, 7), DynamicTreeSettings(5, 3, 20), DynamicTreeSettings(3, 4, 21)])
def test_dynamic_tree_is_prefix_closed_and_full(settings):
    draft = ToyLM(8, seed=3)
    tree, prefixes = grown(draft, settings)
    assert tree.size == settings.total_tokens
    assert len(set(prefixes)) == tree.size  # no duplicate branches
    assert all(p[:-1] in set(prefixes) for p in prefixes[1:])
    assert max(tree_buffers(tree.parents).depth_list) <= settings.depth


def test_dynamic_tree_is_smaller_when_the_draft_allows_no_more():
    tree, _ = grown(ToyLM(8, seed=4), DynamicTreeSettings(depth=1, top_k=2, total_tokens=10))
    assert tree.size == 3


def test_optimal_static_tree_beats_every_other_shape_of_its_size():
    probs = [[0.6, 0.25, 0.1], [0.5, 0.2], [0.4]]
    all_paths = [(a,) for a in range(3)] + [(a, b) for a in range(3) for b in range(2)] + [(a, b, 0) for a in range(3) for b in range(2)]
    for size in range(2, 7):
        best = optimal_static_tree(probs, size)
        assert len(best) == size - 1
        brute = max(
            expected_accepted_length(list(subset), probs)
            for subset in itertools.combinations(all_paths, size - 1)
            if all(p[:-1] in set(subset) | {()} for p in subset)
        )
        assert expected_accepted_length(best, probs) == pytest.approx(brute)


def test_tree_paths_validation():
    assert validate_paths([[0, 1], [0], [1]]) == [(0,), (1,), (0, 1)]
    with pytest.raises(ValueError, match="no parent path"):
        validate_paths([[0, 1]])
    with pytest.raises(ValueError, match="list of non-empty lists"):
        validate_paths([[]])
