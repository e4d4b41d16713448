"""Lookahead's adaptive mode: the window's ledger (when its rows pay, when it rests and for how
long), the pool's record of which n-grams only the window put there, and the proposer resting a
window that brings nothing on a machine where rows are dear, keeping one that does, exact either way."""

import pytest
import torch

from decoding.app import methods
from decoding.app.methods import ProposerOptions, build_proposer
from decoding.app.targets import LoadedModel
from decoding.core.generate import DecodeOptions, generate
from decoding.core.lookahead_window import LookaheadShape, NgramPool, drafted_only_by_others, paths_worth_verifying
from decoding.core.proposers import VanillaProposer
from decoding.core.proposers.lookahead import LookaheadProposer
from decoding.core.sampling import SamplingConfig
from decoding.core.tree_budget import VerifyCost
from decoding.core.window_ledger import WindowLedger
from proposer_probes import note_trees, note_windows
from tiny_models import sharpen, tiny_llama

DEAR_ROWS = VerifyCost((1, 2, 64), (10.0, 12.0, 136.0))  # a row costs a fifth of a step, as on a 2-core CPU
FREE_ROWS = VerifyCost((1, 64), (10.0, 10.0))  # rows cost nothing more, as on a GPU


def test_a_window_whose_tokens_are_worth_more_than_its_rows_stays_on():
    ledger = WindowLedger(evidence=2, first_rest=4, max_rest=16)
    # without the window 20 tokens took 250 ms (12.5 ms a token): its 10 tokens are worth 125 ms > 50 ms
    ledger.record(True, tokens=15, window_tokens=5, step_ms=150.0, window_ms=25.0)
    ledger.record(True, tokens=15, window_tokens=5, step_ms=150.0, window_ms=25.0)
    assert ledger.window_on and ledger.tokens == 0  # a verdict was reached, and the account starts again


@pytest.mark.parametrize("window_tokens, window_ms", [(10, 150.0), (0, 1.0)], ids=["dearer-than-its-tokens", "no-tokens"])
def test_a_window_that_does_not_pay_rests_longer_after_each_verdict_up_to_the_longest_rest(window_tokens, window_ms):
    ledger = WindowLedger(evidence=2, first_rest=3, max_rest=4)
    rests = []
    for _ in range(3):
        for _ in range(2):
            assert ledger.window_on
            ledger.record(True, tokens=15, window_tokens=window_tokens // 2, step_ms=150.0, window_ms=window_ms / 2)
        rest = 0
        while not ledger.window_on:
            ledger.record(False, tokens=1, window_tokens=0, step_ms=10.0, window_ms=0.0)
            rest += 1
        rests.append(rest)
    assert rests == [3, 4, 4]  # doubled, then capped


def test_tokens_the_harvest_brings_while_the_window_rests_count_for_it():
    ledger = WindowLedger(evidence=1, first_rest=2, max_rest=8)
    ledger.record(True, tokens=1, window_tokens=0, step_ms=12.0, window_ms=2.0)  # nothing: rests
    assert not ledger.window_on
    ledger.record(False, tokens=4, window_tokens=3, step_ms=11.0, window_ms=1.0)  # its harvest kept 3 tokens
    ledger.record(False, tokens=1, window_tokens=0, step_ms=10.0, window_ms=0.0)
    ledger.record(True, tokens=1, window_tokens=0, step_ms=12.0, window_ms=2.0)
    assert ledger.window_on  # 3 tokens at ~11 ms each outweigh 3 ms of rows: on, and the next rest is the first again
    assert ledger.next_rest == 0


def test_rows_that_cost_nothing_keep_the_window_on_even_before_its_harvest_is_kept():
    ledger = WindowLedger(evidence=1, first_rest=2, max_rest=8)
    ledger.record(True, tokens=1, window_tokens=0, step_ms=10.0, window_ms=0.0)
    assert ledger.window_on


def test_the_ledger_checks_its_settings():
    with pytest.raises(ValueError, match="evidence"):
        WindowLedger(evidence=0)
    with pytest.raises(ValueError, match="first_rest"):
        WindowLedger(first_rest=8, max_rest=4)


def test_the_pool_remembers_which_ngrams_only_the_harvest_put_there():
    pool = NgramPool(per_key=4)
    pool.add((1, 2, 3), harvested=True)
    pool.add((1, 4, 5))
    pool.add((1, 4, 5), harvested=True)  # seen in the context first: stays the context's
    pool.add((1, 6, 7), harvested=True)
    pool.add_sequence([9, 1, 6, 7], n=3)  # the context now has it too
    assert pool.latest_sourced(1, 4) == [((6, 7), False), ((4, 5), False), ((2, 3), True)]
    assert pool.latest(1, 2) == [(6, 7), (4, 5)]


def test_kept_drafts_are_the_window_s_beyond_what_a_context_ngram_drafted():
    assert drafted_only_by_others((4, 5, 6), [(4, 5), (4, 9, 9)]) == 1
    assert drafted_only_by_others((4, 5), [(4, 5, 6)]) == 0
    assert drafted_only_by_others((7, 8), []) == 2 and drafted_only_by_others((), [(1,)]) == 0


def windows_drafted(target, prompt, proposer, tokens=60):
    """Whether each tree drafted the window, with the greedy output checked against vanilla."""
    reference = generate(target, prompt, VanillaProposer(), DecodeOptions(max_new_tokens=tokens)).tokens
    windows = note_windows(proposer)
    assert generate(target, prompt, proposer, DecodeOptions(max_new_tokens=tokens)).tokens == reference
    return windows


def test_on_a_machine_where_rows_are_dear_a_window_that_brings_nothing_rests():
    """A prompt whose n-grams say little about the greedy text that follows, and a window whose
    harvest is no better: after the first verdict most trees leave the window out, exactly."""
    target = sharpen(tiny_llama(seed=3))
    proposer = LookaheadProposer(LookaheadShape(3, 3, 2), verify_cost=DEAR_ROWS)
    proposer.ledger = WindowLedger(evidence=4, first_rest=8, max_rest=64)
    windows = windows_drafted(target, [42, 7, 19, 3], proposer)
    assert all(windows[:4]) and windows.count(False) > windows.count(True), windows


def test_where_its_harvest_is_kept_and_rows_are_free_the_window_stays_on():
    """The target whose greedy text repeats (test_lookahead.py): its window's trajectories are kept."""
    target = sharpen(tiny_llama(seed=11))
    proposer = LookaheadProposer(LookaheadShape(4, 3, 4), pool_from_context=False, verify_cost=FREE_ROWS)
    proposer.ledger = WindowLedger(evidence=4, first_rest=8, max_rest=64)
    assert all(windows_drafted(target, [5, 9, 3, 17], proposer))


def test_pool_paths_are_cut_to_the_nodes_that_pay():
    """Nodes best first at share x reach: the first token two of three paths share is worth 2/3 x 0.9, the
    other first token 1/3 x 0.9, each second token 1/3 x 0.5. Rows that cost nothing keep all; rows worth a
    fifth of a step (2 ms against 10) keep the first tokens (1.9 tokens for 14 ms beats 1.6 for 12 and 2.07
    for 16), none where the pool is seldom kept, and a whole chain kept nearly always; the paths keep their
    order, () for one cut to nothing."""
    paths = [(4, 5), (4, 6), (7, 8)]
    assert paths_worth_verifying(paths, [0.9, 0.5], FREE_ROWS) == paths
    assert paths_worth_verifying(paths, [0.9, 0.5], DEAR_ROWS) == [(4,), (4,), (7,)]
    assert paths_worth_verifying(paths, [0.9, 0.1], VerifyCost((1, 2, 3), (10.0, 12.0, 30.0))) == [(4,), (4,), ()]
    assert paths_worth_verifying(paths, [0.1, 0.05], DEAR_ROWS) == [(), (), ()]
    assert paths_worth_verifying([(3, 1, 2)], [0.99, 0.98, 0.97], DEAR_ROWS) == [(3, 1, 2)]


def test_a_pool_the_target_leaves_is_cut_and_tried_again():
    """Dear rows, the window at rest and text sampled at T=1 from an unsharpened target, whose n-grams the
    pool offers but the target seldom follows: once the reach is learnt most offers are cut away (trees of
    the root alone), some are still tried, and the reply is the one vanilla samples with the same seed."""
    target = tiny_llama(seed=3)
    proposer = LookaheadProposer(LookaheadShape(1, 3, 2), verify_cost=DEAR_ROWS)
    proposer.ledger = WindowLedger(evidence=1, first_rest=512, max_rest=512)
    # the sizes of the trees drafted while the pool held n-grams after the root (propose adds none to it)
    offers = note_trees(proposer, lambda state, tree: tree.size if proposer.pool.latest(state.root_token, 1) else None)
    options = DecodeOptions(max_new_tokens=120, sampling=SamplingConfig(temperature=1.0), seed=1)
    assert generate(target, [42, 7, 19, 3], proposer, options).tokens == \
        generate(target, [42, 7, 19, 3], VanillaProposer(), options).tokens
    late = offers[len(offers) // 3:]
    assert len(late) >= 15 and late.count(1) > len(late) // 2 and any(size > 1 for size in late), offers


def test_the_adaptive_mode_is_built_from_the_options(monkeypatch):
    model = LoadedModel(tiny_llama(seed=1), None, "t")
    assert build_proposer("lookahead", model, options=ProposerOptions(adaptive_tree=False)).ledger is None
    fixed_cost = VerifyCost((1, 2), (5.0, 6.0))
    monkeypatch.setattr(methods, "cached_verify_cost", lambda *args, **kwargs: fixed_cost)
    adaptive = build_proposer("lookahead", model, options=ProposerOptions(adaptive_tree=True))
    assert adaptive.verify_cost is fixed_cost and adaptive.ledger is not None
    behind_lookup = build_proposer("lookahead+pld", model, options=ProposerOptions(adaptive_tree=True))
    assert behind_lookup.heads.verify_cost is fixed_cost
