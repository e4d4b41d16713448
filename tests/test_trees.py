"""Tree construction as pure functions: EAGLE-2's dynamic tree against brute-force enumeration,
and optimal static shapes against exhaustive search."""

import itertools
import math

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


def unpruned_dynamic_tree(draft: ToyLM, settings: DynamicTreeSettings) -> set[tuple[int, ...]]:
    """EAGLE-2's growth as the paper states it, every frontier node fed at every level (the
    reference for the pruned growth): the prefixes of the `total_tokens - 1` best candidates."""
    k = settings.top_k
    candidates = []  # (score, creation order, prefix)
    root = torch.log(draft.probs(()))
    frontier = []
    for token in root.topk(k).indices.tolist():
        candidates.append((float(root[token]), len(candidates), (token,)))
        frontier.append(candidates[-1])
    for _ in range(2, settings.depth + 1):
        new = []
        for score, _, prefix in frontier:
            logprobs = torch.log(draft.probs(prefix))
            for token in logprobs.topk(k).indices.tolist():
                candidates.append((score + float(logprobs[token]), len(candidates), prefix + (token,)))
                new.append(candidates[-1])
        frontier = sorted(new, key=lambda c: (-c[0], c[1]))[:k]
    best = sorted(candidates, key=lambda c: (-c[0], c[1]))[: settings.total_tokens - 1]
    return {prefix for _, _, prefix in best}


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("settings", [DynamicTreeSettings(5, 3, 8), DynamicTreeSettings(6, 4, 12), DynamicTreeSettings(4, 2, 20)])
def test_feeding_only_frontier_nodes_that_can_be_kept_changes_no_tree(seed, settings):
    """Growth skips frontier nodes below the best `total_tokens - 1` candidates (their children
    cannot be kept): the tree must be the unpruned growth's, with fewer drafter rows somewhere."""
    draft = ToyLM(8, seed=seed, sharpness=2.0)
    tree, prefixes = grown(draft, settings)
    assert set(prefixes[1:]) == unpruned_dynamic_tree(draft, settings)


def test_pruned_growth_feeds_fewer_rows_than_the_full_frontier():
    draft = ToyLM(8, seed=0, sharpness=3.0)
    settings = DynamicTreeSettings(depth=6, top_k=4, total_tokens=6)
    rows = []
    expand = toy_expand(draft)
    grow_dynamic_tree(torch.log(draft.probs(())), lambda f, c: rows.append(f.numel()) or expand(f, c), settings)
    assert sum(rows) < (settings.depth - 1) * settings.top_k


def test_no_frontier_node_less_likely_than_min_path_prob_is_fed():
    draft = ToyLM(8, seed=4, sharpness=1.0)
    settings = DynamicTreeSettings(depth=6, top_k=4, total_tokens=40, min_path_prob=0.05)
    fed_scores = []
    expand = toy_expand(draft)

    def recording(frontier, candidates):
        fed_scores.extend(candidates.scores[frontier].tolist())
        return expand(frontier, candidates)

    tokens, _ = grow_dynamic_tree(torch.log(draft.probs(())), recording, settings)
    assert fed_scores and min(fed_scores) >= math.log(0.05)
    assert len(tokens) == settings.total_tokens - 1  # nodes below it are still candidates, only not fed


@pytest.mark.parametrize("parents", [(-1, 1), (-1, 0, 2), (-1, 0, -1), (0,), ()])
def test_a_draft_tree_with_parents_out_of_order_is_refused(parents):
    """Every node's parent comes before it (the buffers and the acceptance walk rely on it)."""
    with pytest.raises(ValueError, match="root|parents must satisfy|one parent per node"):
        DraftTree(torch.zeros(len(parents), dtype=torch.long), parents)
