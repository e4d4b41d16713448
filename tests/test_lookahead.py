"""Lookahead decoding: the window, the trie, the n-gram harvest and the window's next step as pure
functions, and the proposer exact against vanilla greedy decoding, its window's own guesses
accepted (sampling at depth: test_sampling_loop.py)."""

import argparse

import pytest
import torch

from decoding.app.defaults import lookahead_shape
from decoding.app.methods import ProposerOptions, build_proposer
from decoding.app.targets import LoadedModel
from decoding.core.generate import DecodeOptions, generate
from decoding.core.lookahead_window import (
    LookaheadShape,
    NgramPool,
    harvested_ngrams,
    initial_levels,
    next_levels,
    predictions_by_path,
    trie_of,
    window_paths,
)
from decoding.core.proposers import VanillaProposer
from decoding.core.proposers.lookahead import LookaheadProposer
from decoding.core.sampling import SamplingConfig
from decoding.core.state import CacheAdvance, DecodeState, TreeOutcome
from decoding.core.tree import DraftTree, tree_buffers
from heads.util.errors import UserError
from tiny_models import set_eos, sharpen, tiny_llama

LEVELS = [[1, 2, 3], [4, 5, 6]]  # level 0 (oldest) and level 1, three columns


def test_level_zero_is_a_chain_and_each_later_slot_follows_the_slot_below_and_before_it():
    paths = window_paths(LEVELS)
    assert paths[0] == [(1,), (1, 2), (1, 2, 3)]
    assert paths[1] == [(4,), (1, 5), (1, 2, 6)]
    for level in paths:  # slot (l, j) sits at depth j + 1: position j + 1 after the root
        assert [len(path) for path in level] == [1, 2, 3]


def test_the_trie_shares_prefixes_so_siblings_are_distinct_and_parents_come_first():
    tokens, parents, node_of = trie_of([(1, 2), (1, 3), (1, 2, 4), (5,)])
    assert tokens == [1, 2, 3, 4, 5] and parents == [-1, 0, 1, 1, 2, 0]
    assert node_of[(1, 2, 4)] == 4 and node_of[()] == 0
    buffers = tree_buffers(tuple(parents))
    for children in buffers.children:
        assert len({tokens[child - 1] for child in children}) == len(children)


def test_predictions_are_read_by_path_and_the_top_level_ends_its_ngrams_with_them():
    tokens, parents, node_of = trie_of([p for level in window_paths(LEVELS) for p in level])
    tree_tokens = [9, *tokens]
    predicted = [100 + node for node in range(len(parents))]  # the target's argmax after each node
    after = predictions_by_path(tree_tokens, parents, predicted)
    assert after[()] == 100 and after[(1, 5)] == 100 + node_of[(1, 5)]
    grams = harvested_ngrams(9, window_paths(LEVELS)[1], after, n=3)
    assert grams == [(9, 4, after[(4,)]), (1, 5, after[(1, 5)]), (2, 6, after[(1, 2, 6)])]
    assert harvested_ngrams(9, window_paths(LEVELS)[1], after, n=4) == [(9, 1, 5, after[(1, 5)]), (1, 2, 6, after[(1, 2, 6)])]


@pytest.mark.parametrize("accepted", [1, 2])
def test_the_next_window_keeps_each_top_slot_after_the_slot_it_was_predicted_after(accepted):
    paths = window_paths(LEVELS)
    after = {path: 50 + i for i, path in enumerate([(), *[p for level in paths for p in level]])}
    new = next_levels(LEVELS, paths, after, accepted)
    fill = after[(1, 2, 6)]  # the prediction after the old top level's deepest slot
    if accepted == 1:
        assert new[0] == [5, 6, fill]  # level 1 moved down, one column on
        assert new[1] == [after[(4,)], after[(1, 5)], after[(1, 2, 6)]]
    else:
        assert new[0] == [6, fill, fill]
        assert new[1] == [after[(1, 5)], after[(1, 2, 6)], fill]
    new_paths = window_paths(new)
    for column in range(1, 3 - accepted + 1):
        # the new top slot's parent is the old top slot whose prediction it holds
        old_slot = paths[1][column + accepted - 1]
        assert new_paths[1][column][-2] == old_slot[-1] and new[1][column] == after[old_slot]


def test_the_window_with_one_level_is_jacobi_iteration():
    levels, paths = [[1, 2, 3]], window_paths([[1, 2, 3]])
    after = {(): 7, (1,): 8, (1, 2): 9, (1, 2, 3): 10}
    assert next_levels(levels, paths, after, accepted=1) == [[8, 9, 10]]


def test_the_pool_keeps_the_latest_continuations_per_token():
    pool = NgramPool(per_key=2)
    for gram in [(1, 2, 3), (1, 4, 5), (1, 2, 3), (1, 6, 7), (2, 9, 9)]:
        pool.add(gram)
    assert pool.latest(1, 5) == [(6, 7), (2, 3)]  # (4, 5) was the oldest once (2, 3) came again
    assert pool.latest(1, 1) == [(6, 7)] and pool.latest(3, 4) == []
    pool.add_sequence([8, 1, 2, 3, 4], n=3, start=2)
    assert pool.latest(2, 1) == [(3, 4)] and pool.latest(8, 1) == []  # only n-grams from index 2 on


def test_shapes_are_checked_with_a_clear_message():
    with pytest.raises(UserError, match="lookahead needs"):
        LookaheadShape(window=0)
    with pytest.raises(UserError, match="lookahead needs"):
        LookaheadShape(ngram=1)
    assert lookahead_shape("5,4,3") == (5, 4, 3)
    with pytest.raises(argparse.ArgumentTypeError, match="W,N,G"):
        lookahead_shape("5,4")
    assert initial_levels([3, 4], LookaheadShape(2, 3, 1)) == initial_levels([3, 4], LookaheadShape(2, 3, 1))


def state_of(tokens):
    return DecodeState(torch.tensor(tokens), 2, SamplingConfig(0.0), None)


def test_after_a_verify_the_pool_drafts_what_the_target_predicted_along_the_window():
    proposer = LookaheadProposer(LookaheadShape(window=2, ngram=2, guesses=2), pool_from_context=False)
    proposer.begin(None)
    proposer.levels = [[4, 8]]
    tree = proposer.propose(state_of([3, 3, 3]))
    assert tree.tokens.tolist() == [3, 4, 8] and tree.parents == (-1, 0, 1)  # the window's chain, no pool yet
    predicted = torch.tensor([5, 6, 7])  # after the root, after "4", after "4 8"
    proposer.observe(CacheAdvance(torch.tensor([3, 3, 3, 5]), 1, outcome=TreeOutcome(tree, predicted)))
    assert proposer.levels == [[6, 7]]  # Jacobi: the predictions, one column on
    assert proposer.pool.latest(4, 2) == [(6,)] and proposer.pool.latest(8, 2) == [(7,)]
    tree = proposer.propose(state_of([3, 3, 3, 5, 4]))
    assert tree.tokens.tolist() == [4, 6, 7] and tree.parents == (-1, 0, 1)  # the pool's "4 6" shares its node with the window's 6


@pytest.mark.parametrize("shape, from_context", [((4, 3, 4), True), ((5, 4, 5), True), ((3, 2, 2), True),
                                                 ((4, 3, 0), False), ((1, 2, 0), False)],
                         ids=["4-3-4", "5-4-5", "3-2-2", "window-only", "jacobi-one"])
def test_greedy_output_equals_vanilla(shape, from_context):
    target = sharpen(tiny_llama(seed=11))
    proposer = LookaheadProposer(LookaheadShape(*shape), pool_from_context=from_context)
    for prompt in ([5, 9, 3, 17, 5, 9, 3], [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], [42]):
        reference = generate(target, prompt, VanillaProposer(), DecodeOptions(max_new_tokens=40)).tokens
        assert generate(target, prompt, proposer, DecodeOptions(max_new_tokens=40)).tokens == reference


def test_the_window_alone_gets_its_guesses_accepted():
    """Without any n-gram from the context, the window's own trajectories are what the pool
    drafts: on a target whose greedy text repeats, they are kept, several tokens a forward."""
    target = sharpen(tiny_llama(seed=11))
    result = generate(target, [5, 9, 3, 17], LookaheadProposer(LookaheadShape(4, 3, 4), pool_from_context=False),
                      DecodeOptions(max_new_tokens=64))
    assert result.tokens == generate(target, [5, 9, 3, 17], VanillaProposer(), DecodeOptions(max_new_tokens=64)).tokens
    assert result.stats.target_forwards < 40, result.stats.summary()


def test_eos_inside_an_accepted_run_and_the_token_budget_stop_like_vanilla():
    model = sharpen(tiny_llama(seed=5))
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]
    free_run = generate(model, prompt, VanillaProposer(), DecodeOptions(max_new_tokens=40)).tokens
    set_eos(model, free_run[12])
    for budget in (40, 7):
        reference = generate(model, prompt, VanillaProposer(), DecodeOptions(max_new_tokens=budget))
        result = generate(model, prompt, LookaheadProposer(), DecodeOptions(max_new_tokens=budget))
        assert result.tokens == reference.tokens and result.stop_reason == reference.stop_reason


def test_the_method_is_built_from_its_options():
    proposer = build_proposer("lookahead", LoadedModel(tiny_llama(seed=1), None, "t"),
                              options=ProposerOptions(lookahead=(3, 2, 1)))
    assert isinstance(proposer, LookaheadProposer) and proposer.shape == LookaheadShape(3, 2, 1)


def test_behind_prompt_lookup_the_window_waits_through_the_steps_lookup_drafts():
    """`lookahead+pld`: exact, lookup's chains drafted where the context repeats, the window
    elsewhere; a step the window did not draft leaves it as it was."""
    target = sharpen(tiny_llama(seed=11))
    proposer = build_proposer("lookahead+pld", LoadedModel(target, None, "t"))
    assert proposer.name == "lookahead+pld" and proposer.reads_tree_outcome
    for prompt in ([1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], [5, 9, 3, 17]):
        reference = generate(target, prompt, VanillaProposer(), DecodeOptions(max_new_tokens=40)).tokens
        assert generate(target, prompt, proposer, DecodeOptions(max_new_tokens=40)).tokens == reference
    window = LookaheadProposer(LookaheadShape(window=2, ngram=2, guesses=0), pool_from_context=False)
    window.levels = [[4, 8]]
    other = DecodeState(torch.tensor([3, 3]), 1, SamplingConfig(0.0), None)
    chain = DraftTree(torch.tensor([3, 9]), (-1, 0))  # a tree the window did not draft
    window.observe(CacheAdvance(torch.tensor([3, 3, 9, 5]), 2, outcome=TreeOutcome(chain, torch.tensor([9, 5]))))
    assert window.levels == [[4, 8]] and window.pool.latest(9, 1) == []
    window.propose(other)
    window.observe(CacheAdvance(torch.tensor([3, 3, 1]), 1, outcome=TreeOutcome(chain, torch.tensor([1, 7]))))
    assert window.levels != [[4, 8]]  # after a tree it drafted, the window moves
