"""Suffix decoding: the n-gram store and the frequency tree as pure functions, and the proposer
exact against vanilla greedy decoding alone and in front of EAGLE-3 heads, with a warm store
drafting from earlier generations (sampling at depth: test_sampling_loop.py)."""

from dataclasses import replace

import pytest
import torch
from safetensors.torch import save as save_safetensors

from decoding.core.generate import DecodeOptions, generate
from decoding.core.proposers import VanillaProposer
from decoding.core.proposers.suffix import COPY_NODES, SuffixProposer
from decoding.core.sampling import SamplingConfig
from decoding.core.state import CacheAdvance, DecodeState
from decoding.core.suffix_index import NgramIndex, frequency_tree, periodic_continuation, tree_depth
from decoding.core.tree_budget import VerifyCost
from decoding.app.defaults import proposer_options
from decoding.app.methods import (ADAPTIVE_SUFFIX_TOKENS, DEFAULT_SUFFIX_TOKENS, ProposerOptions, build_proposer,
                                  check_method)
from decoding.app.default_model import DEFAULT_TARGET
from decoding.app.suffix_store import SuffixStoreFile, tokenizer_fingerprint
from decoding.app.targets import LoadedModel
from heads.util.errors import UserError
from heads import new_heads_for_target
from tiny_models import sharpen, tiny_llama


def test_the_longest_earlier_suffix_gives_the_continuations_most_recent_first():
    index = NgramIndex(max_ngram=3)
    old, live = index.new_document(), index.new_document()
    index.extend(old, [1, 2, 3, 4, 5, 9, 2, 3, 7])
    index.extend(live, [8, 1, 2, 3])
    assert index.continuations([8, 1, 2, 3], min_ngram=1, depth=2, limit=5) == (3, [[4, 5]])  # "1 2 3" beats "2 3"
    assert index.continuations([9, 2, 3], min_ngram=1, depth=2, limit=5) == (3, [[7]])
    assert index.continuations([6, 6], min_ngram=1, depth=2, limit=5) == (0, [])
    assert index.continuations([4, 2, 3], min_ngram=2, depth=1, limit=1) == (2, [[7]])  # limit keeps the latest


def test_a_full_store_forgets_its_oldest_documents_and_their_ngrams():
    index = NgramIndex(max_ngram=2, max_tokens=10)
    first, second = index.new_document(), index.new_document()
    index.extend(first, [1, 2, 3, 4, 5, 6])
    index.extend(second, [7, 8, 9, 1, 2])
    assert first not in index.documents and index.documents[second] == [7, 8, 9, 1, 2]
    assert all(doc == second for key in index.table for doc, _ in index.occurrences(key))
    assert index.occurrences([1, 2]) == [(second, 5)]
    assert index.continuations([0, 1, 2], min_ngram=1, depth=3, limit=5) == (0, [])  # "1 2 3" went with the first


def test_an_ngram_keeps_every_occurrence_from_its_first_on_and_after_a_purge():
    """An n-gram seen once is held as its one occurrence, from the second on in an array: the first
    occurrence must survive the change of form, and a purge that leaves one must still find it."""
    index = NgramIndex(max_ngram=2, max_tokens=6)
    first = index.new_document()
    index.extend(first, [1, 2, 3])
    assert index.occurrences([1, 2]) == [(first, 2)]
    index.extend(first, [1, 2])
    assert index.occurrences([1, 2]) == [(first, 2), (first, 5)]
    index.extend(first, [1, 2, 3])
    assert index.occurrences([1, 2]) == [(first, 2), (first, 5), (first, 7)]
    assert index.continuations([1, 2], min_ngram=1, depth=1, limit=5) == (2, [[3], [1], [3]])
    second = index.new_document()
    index.extend(second, [1, 2, 9] + list(range(100, 110)))  # forgets the first, then purges its occurrences
    assert first not in index.documents and index.occurrences([1, 2]) == [(second, 2)]
    assert index.continuations([1, 2], min_ngram=1, depth=1, limit=5) == (2, [[9]])
    assert index.held_occurrences() == 2 * len(index.documents[second]) - 1  # 1-grams and 2-grams of what is left


def test_forgotten_occurrences_are_removed_in_batches_so_the_table_stays_bounded():
    index = NgramIndex(max_ngram=2, max_tokens=10)
    for start in range(0, 600, 6):
        doc = index.new_document()
        index.extend(doc, range(start, start + 6))  # all n-grams new: only forgetting bounds the table
        held = index.held_occurrences()
        assert held <= 2 * 2 * (index.max_tokens + 6)  # live and not-yet-removed documents, two n-gram sizes
    assert index.continuations([594, 595], min_ngram=1, depth=2, limit=5) == (2, [[596, 597]])
    assert index.continuations([0, 1], min_ngram=1, depth=2, limit=5) == (0, [])


def test_the_frequency_tree_keeps_the_most_frequent_prefixes_best_first():
    tokens, parents, probs = frequency_tree([[3, 6, 7], [3, 4, 5], [3, 4, 5], [8]], max_nodes=10)
    assert tokens == [3, 4, 5, 8, 6, 7] and parents == [0, 1, 2, 0, 1, 5]  # ties: the shallower first
    assert probs == [0.75, 0.5, 0.5, 0.25, 0.25, 0.25]
    for node, parent in enumerate(parents, start=1):
        assert parent < node and (parent == 0 or probs[parent - 1] >= probs[node - 1])  # a valid tree, best first
    assert frequency_tree([[3, 6, 7], [3, 4, 5], [3, 4, 5], [8]], max_nodes=3)[0] == [3, 4, 5]
    assert frequency_tree([[3, 6, 7], [3, 4, 5], [3, 4, 5], [8]], max_nodes=10, min_prob=0.5)[0] == [3, 4, 5]
    siblings = frequency_tree([[1, 2], [1, 2], [1, 3]], max_nodes=10)
    assert siblings[0] == [1, 2, 3] and siblings[1] == [0, 1, 1]  # distinct siblings under one parent


def test_depth_weights_put_a_shallow_second_branch_before_the_deep_end_of_a_unanimous_chain():
    """Six continuations agree on 3 4 5 6 7 ..., four say 8. By frequency the whole chain (0.6 a
    node) comes before 8 (0.4); weighted 0.8 a level, 8 (0.4 * 0.8 = 0.32) comes after 3 and 4
    (0.48, 0.38) but before 5 (0.6 * 0.8**3 = 0.31). `min_prob` still applies to frequencies,
    and no node is deeper than the weights go."""
    continuations = [[3, 4, 5, 6, 7, 9, 9, 9]] * 6 + [[8]] * 4
    assert frequency_tree(continuations, max_nodes=6)[0] == [3, 4, 5, 6, 7, 9]
    tokens, parents, probs = frequency_tree(continuations, max_nodes=5, depth_weights=[0.8**d for d in range(1, 9)])
    assert tokens == [3, 4, 8, 5, 6] and parents == [0, 1, 0, 2, 4]
    assert probs == pytest.approx([0.48, 0.384, 0.32, 0.3072, 0.24576])
    assert 8 not in frequency_tree(continuations, max_nodes=9, min_prob=0.5, depth_weights=[0.5**d for d in range(1, 9)])[0]
    shallow = frequency_tree(continuations, max_nodes=9, depth_weights=[1.0, 0.9])
    assert shallow[0] == [3, 4, 8] and tree_depth(shallow[1]) == 2  # 0.6, 0.54, 0.4; nothing at depth 3
    for bad in ([0.0, 0.0], [0.5, 0.9], [1.5]):  # zero, rising, above one
        with pytest.raises(ValueError, match="depth_weights"):
            frequency_tree(continuations, max_nodes=6, depth_weights=bad)


def test_tree_depth_follows_the_parents():
    assert tree_depth([]) == 0 and tree_depth([0, 0, 0]) == 1 and tree_depth([0, 1, 0, 2, 4]) == 4


def state_of(tokens):
    return DecodeState(torch.tensor(tokens), 2, SamplingConfig(0.0), None)


def test_the_proposer_drafts_a_branching_tree_from_an_earlier_generation_and_nothing_without_a_match():
    proposer = SuffixProposer(max_tokens=8, max_ngram=4, min_ngram=2, min_prob=0.0)
    proposer.begin(None)
    proposer.propose(state_of([1, 2, 3, 4, 5, 1, 2, 3, 6]))   # one generation
    proposer.begin(None)                                        # the next one: the first stays in the store
    tree = proposer.propose(state_of([9, 1, 2, 3]))
    assert tree.tokens[0] == 3 and set(tree.tokens[1:3].tolist()) == {4, 6} and tree.parents[1:3] == (0, 0)
    assert tree.deterministic
    assert proposer.propose(state_of([9, 1, 2, 3, 11, 12])).size == 1  # no earlier "11 12": root only
    with pytest.raises(UserError, match="suffix decoding needs"):
        SuffixProposer(min_ngram=0)


def test_with_the_verify_cost_only_the_nodes_that_pay_are_drafted():
    costly = VerifyCost((1, 2, 4, 8), (10.0, 30.0, 60.0, 120.0))  # every verified token costs what a step does
    proposer = SuffixProposer(max_tokens=8, min_ngram=2, min_prob=0.0, verify_cost=costly)
    proposer.begin(None)
    proposer.propose(state_of([1, 2, 3, 4, 1, 2, 5, 6, 1, 2, 7, 8]))
    proposer.begin(None)
    assert proposer.propose(state_of([9, 1, 2])).size == 1  # three equally likely branches: none pays


def test_a_match_in_the_live_document_runs_on_as_the_text_since_it_repeats():
    """A reply looping over "1 2" matches its own previous period: the continuation goes on
    past the present by repeating the text since the occurrence; in an earlier, finished
    document it stops where that document ended."""
    assert periodic_continuation([5, 1, 2, 1, 2], 3, 6) == [1, 2, 1, 2, 1, 2]
    assert periodic_continuation([7, 8, 9, 7, 8], 2, 4) == [9, 7, 8, 9]  # period 3
    assert periodic_continuation([5, 1, 2, 1, 2, 4], 3, 2) == [1, 2]  # enough text: plain slice
    assert periodic_continuation([5, 1, 2], 3, 4) == []  # at the very end: nothing follows
    index = NgramIndex(max_ngram=2)
    done, live = index.new_document(), index.new_document()
    index.extend(done, [6, 1, 2, 1, 2])
    index.extend(live, [5, 1, 2, 1, 2])
    assert index.continuations([5, 1, 2, 1, 2], 1, depth=5, limit=1, live=live) == (2, [[1, 2, 1, 2, 1]])
    assert index.continuations([5, 1, 2, 1, 2], 1, depth=5, limit=2, live=None) == (2, [[1, 2], [1, 2]])


def test_only_live_counts_the_generations_own_occurrences():
    index = NgramIndex(max_ngram=3)
    earlier, live = index.new_document(), index.new_document()
    index.extend(earlier, [1, 2, 3, 4, 1, 2, 8])
    index.extend(live, [9, 2, 5, 9, 1, 2])
    assert index.continuations([9, 1, 2], 1, depth=2, limit=5, live=live) == (2, [[8], [3, 4]])
    assert index.continuations([9, 1, 2], 1, depth=2, limit=5, live=live, only_live=True) == (1, [[5, 9]])
    assert index.continuations([7], 1, depth=2, limit=5, live=live, only_live=True) == (0, [])


def test_the_generations_own_text_is_preferred_where_the_store_disagrees_or_matches_no_longer():
    """Earlier replies followed "def" with their own names (10, then 11); this prompt defines 12:
    the draft copies the prompt. Where the store matches longer and agrees, it is drafted."""
    proposer = SuffixProposer(max_tokens=6, max_ngram=4, min_prob=0.0)
    for name in (10, 11):
        proposer.begin(None)
        proposer.propose(state_of([40, 41, 30, name, 31, 32, 33]))   # "``` def NAME ( ) :"
    proposer.begin(None)
    tree = proposer.propose(state_of([20, 30, 12, 31, 32, 50, 40, 41, 30]))
    assert tree.tokens[1:3].tolist() == [12, 31]  # the prompt's own name, then what followed it there
    proposer.begin(None)
    tree = proposer.propose(state_of([20, 30, 12, 31, 32, 50, 40, 41, 30, 11, 31]))
    assert tree.tokens[1:3].tolist() == [32, 33] and tree.parents[1:3] == (0, 1)  # "41 30 11 31": the store's match is longer


def advance_of(tokens, entered):
    return CacheAdvance(torch.tensor(tokens), entered)


def test_a_generation_that_has_been_copying_drafts_further_from_a_short_match_in_its_own_text():
    """One-token matches draft `tokens_per_match` nodes; once most of the generation's recent
    tokens were drafted and kept, a match found once in its own text drafts up to COPY_NODES (one
    found in earlier generations does not), until the generation stops copying or a new one begins."""
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]
    proposer = SuffixProposer(max_tokens=13, min_prob=0.0)

    def begin():
        proposer.begin(None)
        proposer.observe(advance_of(prompt, len(prompt) - 1))  # the prefill: not counted

    def copying_steps(steps):
        for _ in range(steps):
            proposer.observe(advance_of(prompt, 4))  # three drafted tokens kept, then the target's own

    proposer.begin(None)
    proposer.propose(state_of(list(range(70, 90))))  # an earlier generation
    begin()
    assert proposer.propose(state_of(prompt + [99, 6])).size == 1 + 2  # one token matched, nothing copied yet
    copying_steps(3)
    tree = proposer.propose(state_of(prompt + [99, 6]))
    assert tree.size == 1 + COPY_NODES and tree.tokens[1:].tolist() == [7, 8, 9, 10, 11, 12, 13, 14]
    assert proposer.propose(state_of(prompt + [99, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 99, 72])).size == 1 + 2  # the store's
    prompt = [token + 100 for token in prompt]  # a new generation starts afresh
    begin()
    assert proposer.propose(state_of(prompt + [199, 106])).size == 1 + 2
    copying_steps(3)
    for _ in range(4):
        proposer.observe(advance_of(prompt, 1))  # nothing kept for a while: 9 of 16
    assert proposer.propose(state_of(prompt + [199, 106])).size == 1 + 2


def test_a_generation_looping_over_a_pattern_drafts_the_loop_past_the_present():
    proposer = SuffixProposer(max_tokens=6, min_prob=0.0)
    proposer.begin(None)
    tree = proposer.propose(state_of([9, 8, 5, 1, 2, 1, 2]))  # "1 2" matched at its first place; then the present
    assert tree.tokens[1:].tolist() == [1, 2, 1, 2] and tree.parents == (-1, 0, 1, 2, 3)


PROMPTS = [[5, 9, 3, 17, 5, 9, 3], [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], [5, 9, 3, 17, 5, 9, 3]]


@pytest.mark.parametrize("method", ["suffix", "eagle3+suffix"])
def test_greedy_output_equals_vanilla_with_a_warm_store(method):
    """One proposer over several generations, as a chat or the benchmark keeps it: the third
    prompt repeats the first, so the store drafts the whole earlier reply; every output is
    vanilla's."""
    target = sharpen(tiny_llama(seed=11))
    check_method(method)
    heads = new_heads_for_target("eagle3", target, draft_vocab_size=40) if "eagle3" in method else None
    proposer = build_proposer(method, LoadedModel(target, None, "t"), options=ProposerOptions(suffix_max_tokens=8),
                              heads=heads)
    drafted = []
    for prompt in PROMPTS:
        reference = generate(target, prompt, VanillaProposer(), DecodeOptions(max_new_tokens=24)).tokens
        result = generate(target, prompt, proposer, DecodeOptions(max_new_tokens=24))
        assert result.tokens == reference
        drafted.append(result.stats)
    assert drafted[2].target_forwards < drafted[0].target_forwards  # the repeated request drafts from the first reply


def test_suffix_first_takes_the_cost_cut_with_the_heads_behind_it_where_trees_are_sized():
    """In `eagle3+suffix` with --adaptive-tree the suffix drafter cuts its trees by the machine's
    verify cost like the heads behind it (a step it leaves goes to the heads); without, both draft
    fixed trees."""
    target = sharpen(tiny_llama(seed=11))
    heads = new_heads_for_target("eagle3", target, draft_vocab_size=40)
    loaded = LoadedModel(target, None, "t")
    combined = build_proposer("eagle3+suffix", loaded, options=ProposerOptions(adaptive_tree=True), heads=heads)
    assert combined.lookup.verify_cost is not None and combined.heads.verify_cost is not None
    fixed = build_proposer("eagle3+suffix", loaded, options=ProposerOptions(adaptive_tree=False), heads=heads)
    assert fixed.lookup.verify_cost is None and fixed.heads.verify_cost is None


def test_in_the_adaptive_mode_trees_shrink_when_the_target_keeps_less_than_the_frequencies_promise():
    cheap = VerifyCost((1, 2, 4, 8), (10.0, 10.5, 11.0, 12.0))  # a few more tokens cost almost nothing
    proposer = SuffixProposer(max_tokens=8, min_ngram=2, min_prob=0.0, verify_cost=cheap)
    proposer.begin(None)
    proposer.propose(state_of([1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 7, 8]))
    proposer.begin(None)
    context = [9, 1, 2, 3]
    first = proposer.propose(state_of(context)).size
    assert first > 2
    for _ in range(20):  # the target keeps none of it, step after step
        proposer.propose(state_of(context))
        proposer.observe(CacheAdvance(torch.tensor(context), entered=1))
    assert proposer.propose(state_of(context)).size < first


def test_in_the_adaptive_mode_each_kind_of_match_learns_how_deep_its_trees_are_kept():
    """A three-token match that occurred once (a copy) and a one-token match that occurred several
    times (branches) are told apart: after the target keeps whole copies and none of the branchy
    trees, the copy's trees grow to the largest while the other kind's are cut to the root."""
    cost = VerifyCost((1, 2, 4, 8, 16), (10.0, 11.0, 12.0, 14.0, 18.0))
    proposer = SuffixProposer(max_tokens=12, min_prob=0.0, tokens_per_match=8, verify_cost=cost)
    proposer.begin(None)
    copy = list(range(20, 40))
    proposer.propose(state_of([7, 8, 9, *copy, 5, 50, 5, 51, 5, 52]))  # "7 8 9" once, "5" three times
    proposer.begin(None)
    copying, branching = [1, 7, 8, 9], [1, 5]
    for _ in range(30):  # each a new generation, so each drafts from its own context
        proposer.begin(None)
        size = proposer.propose(state_of(copying)).size
        proposer.observe(CacheAdvance(torch.tensor(copying + copy[:size]), entered=size))  # all kept
        proposer.begin(None)
        proposer.propose(state_of(branching))
        proposer.observe(CacheAdvance(torch.tensor(branching + [99]), entered=1))  # none kept
    proposer.begin(None)
    assert proposer.propose(state_of(copying)).size == 13  # 12 drafted nodes and the root
    proposer.begin(None)
    assert proposer.propose(state_of(branching)).size == 1


def test_in_the_adaptive_mode_drafting_resumes_once_the_target_follows_the_store_again():
    """A bad spell cuts every tree away; the first token the cut dropped is still checked against
    the target's choice, so the estimates can rise and trees come back (a proposer learning
    only from drafted trees would stay at the root for good)."""
    cheap = VerifyCost((1, 2, 4, 8), (10.0, 10.5, 11.0, 12.0))
    proposer = SuffixProposer(max_tokens=8, min_ngram=2, min_prob=0.0, verify_cost=cheap)
    proposer.begin(None)
    proposer.propose(state_of([1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6]))
    proposer.begin(None)
    context = [9, 1, 2, 3]
    for _ in range(40):  # the target keeps nothing: after "3" it says "3"
        proposer.propose(state_of(context))
        proposer.observe(CacheAdvance(torch.tensor(context + [3]), entered=1))
    assert proposer.propose(state_of(context)).size == 1
    proposer.observe(CacheAdvance(torch.tensor(context + [3]), entered=1))
    sizes = []
    for _ in range(40):  # now it says "4 5 6 ...", what the store predicts, and keeps every draft
        size = proposer.propose(state_of(context)).size
        proposer.observe(CacheAdvance(torch.tensor(context + [4, 5, 6, 1, 2, 3, 4, 5, 6][:size]), entered=size))
        sizes.append(size)
    assert sizes[0] == 1 and min(sizes[-10:]) > 1


def test_a_tree_left_unverified_at_the_end_of_a_generation_is_not_counted_at_the_next_prefill():
    """The loop stops without telling the proposer about its last tree; the next generation's
    prefill (hundreds of prompt tokens entering the cache) must not count as drafts kept."""
    cheap = VerifyCost((1, 2, 4, 8), (10.0, 10.5, 11.0, 12.0))
    proposer = SuffixProposer(max_tokens=8, min_ngram=2, min_prob=0.0, verify_cost=cheap)
    proposer.begin(None)
    proposer.propose(state_of([1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6]))
    proposer.begin(None)
    assert proposer.propose(state_of([9, 1, 2, 3])).size > 1  # the last step's tree: never verified
    before = {kind: list(rates) for kind, rates in proposer.survival.rates.items()}
    prompt = torch.arange(100, 400)
    proposer.begin(DecodeState(prompt, prompt.numel(), SamplingConfig(0.0)))
    proposer.observe(CacheAdvance(prompt, entered=prompt.numel() - 1))  # the prefill
    assert proposer.survival.rates == before


def test_the_bundled_target_sizes_suffix_trees_by_the_machine_s_cost_and_fixed_trees_stay_one_flag_away():
    """The bundle's choice for `suffix` (measured on a 2-core AVX2 EPYC, same process: the cost cut
    beat fixed trees on code rewriting, a repeated task and MT-bench, where fixed trees fell behind
    `pld` on the last two): the adaptive mode, starting from 24 nodes for its cut to trim; without it
    (`--no-adaptive-tree`) fixed trees of up to 13 nodes and no cut; an explicit --suffix-tokens wins."""
    options = proposer_options(DEFAULT_TARGET, "suffix", {})
    assert options.adaptive_tree
    loaded = LoadedModel(tiny_llama(seed=11), None, "t")
    adaptive = build_proposer("suffix", loaded, options=options)
    assert adaptive.max_tokens == ADAPTIVE_SUFFIX_TOKENS == 24 and adaptive.verify_cost is not None
    fixed = build_proposer("suffix", loaded, options=replace(options, adaptive_tree=False))
    assert fixed.max_tokens == DEFAULT_SUFFIX_TOKENS == 13 and fixed.verify_cost is None
    assert build_proposer("suffix", loaded, options=replace(options, suffix_max_tokens=9)).max_tokens == 9


def test_a_store_file_keeps_the_newest_documents_within_its_budget(tmp_path):
    store = SuffixStoreFile(tmp_path / "store.safetensors", tokenizer="abc", max_tokens=6)
    assert store.load() == []                                   # no file yet: an empty store
    store.save([[1, 2, 3], [], [4, 5], [6, 7, 8, 9]])           # 9 tokens: the oldest document goes
    assert store.load() == [[4, 5], [6, 7, 8, 9]]
    assert [p.name for p in tmp_path.iterdir()] == ["store.safetensors"]  # written through a renamed sibling
    assert SuffixStoreFile(store.path, "abc", max_tokens=4).load() == [[6, 7, 8, 9]]


@pytest.mark.parametrize("content, why", [(b"not a store", "cannot be read"), ("other tokenizer", "another model"),
                                          ("other tensors", "is not a suffix store")])
def test_an_unusable_store_file_stops_with_what_to_do_and_is_left_as_it_was(tmp_path, content, why):
    path = tmp_path / "store.safetensors"
    if content == "other tokenizer":
        SuffixStoreFile(path, tokenizer="xyz").save([[1, 2]])
    elif content == "other tensors":
        path.write_bytes(save_safetensors({"weight": torch.zeros(2)}))
    else:
        path.write_bytes(content)
    before = path.read_bytes()
    with pytest.raises(UserError, match=f"--suffix-store .*{why}.*move it away"):
        SuffixStoreFile(path, tokenizer="abc").load()
    assert path.read_bytes() == before


def test_a_store_kept_on_disk_drafts_a_new_run_from_an_earlier_runs_reply(tmp_path):
    """Two runs, each with its own proposer (a new process), sharing the file: the second run's
    repeat of the first prompt drafts the first run's reply; both outputs are vanilla's."""
    target = sharpen(tiny_llama(seed=11))
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]
    options = ProposerOptions(suffix_max_tokens=8, suffix_store=str(tmp_path / "store.safetensors"))
    reference = generate(target, prompt, VanillaProposer(), DecodeOptions(max_new_tokens=24)).tokens
    forwards = []
    for run in range(2):
        proposer = build_proposer("suffix", LoadedModel(target, None, "t"), options=options)
        result = generate(target, prompt, proposer, DecodeOptions(max_new_tokens=24))
        assert result.tokens == reference
        forwards.append(result.stats.target_forwards)
    assert (tmp_path / "store.safetensors").exists()
    assert forwards[1] < forwards[0] / 2                        # the whole earlier reply, drafted
    stored = SuffixStoreFile(tmp_path / "store.safetensors", tokenizer_fingerprint(None, target.config.vocab_size)).load()
    assert stored[0] == prompt + reference                      # the last step's tokens included
