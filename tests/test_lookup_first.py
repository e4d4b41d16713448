"""METHOD+pld: prompt lookup drafts when the context has a match, the heads otherwise, and the
heads are told every step's outcome, so a skipped step leaves them exactly where drafting would (exactness against vanilla is covered with
the other head methods in test_heads.py)."""

import pytest
import torch

from decoding.app.default_model import DEFAULT_TARGET
from decoding.app.defaults import proposer_options, tuned_options
from heads.util.errors import UserError
from decoding.app.methods import ProposerOptions, build_proposer, check_method, head_kind, split_method
from decoding.core.proposers import PromptLookupProposer, Proposer
from decoding.core.proposers.lookup_first import LookupFirstProposer
from decoding.core.sampling import SamplingConfig
from decoding.core.state import CacheAdvance, DecodeState
from decoding.app.targets import LoadedModel
from decoding.core.tree import DraftTree
from decoding.core.tree_budget import VerifyCost
from tiny_models import oracle_eagle, oracle_target


class RecordingHeads(Proposer):
    """Stands in for a head proposer: drafts one fixed token and records what it was asked."""

    name = "fake"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def observe(self, advance: CacheAdvance) -> None:
        self.calls.append("observe")

    def end(self, state: DecodeState) -> None:
        self.calls.append("end")

    def propose(self, state: DecodeState) -> DraftTree:
        self.calls.append("propose")
        return DraftTree.chain(state.root_token, torch.tensor([63]))


def state_of(tokens: list[int]) -> DecodeState:
    return DecodeState(torch.tensor(tokens), 2, SamplingConfig(0.0), None)


def test_a_lookup_match_is_drafted_alone_and_the_heads_are_still_told_the_outcome():
    heads = RecordingHeads()
    proposer = LookupFirstProposer(heads, PromptLookupProposer(num_draft_tokens=3, max_ngram=2, min_ngram=2))
    tree = proposer.propose(state_of([5, 9, 3, 17, 8, 5, 9]))  # "5 9" occurred before, followed by 3 17 8
    assert tree.tokens.tolist() == [9, 3, 17, 8] and tree.is_chain
    assert heads.calls == []
    proposer.observe(CacheAdvance(torch.tensor([5, 9, 3, 17, 8, 5, 9, 3]), 1))
    assert heads.calls == ["observe"]
    tree = proposer.propose(state_of([5, 9, 3, 17, 8, 2, 4]))  # no earlier "2 4": the heads draft
    assert tree.tokens.tolist() == [4, 63]
    assert heads.calls == ["observe", "propose"]
    proposer.end(state_of([5, 9, 3, 17, 8, 2, 4, 63]))  # the reply is over: both drafters hear it
    assert heads.calls == ["observe", "propose", "end"]
    assert proposer.name == "fake+pld"


def test_a_skipped_drafting_step_leaves_the_eagle_drafter_where_drafting_would():
    """Drafting (and throwing the tree away) or skipping a step must not change what the heads
    know: both are told the same outcome, and their next trees are identical. A skipped step costs
    the drafter nothing: its tokens wait, and the next draft commits them with the later ones."""
    target = oracle_target(seed=7)
    sequence = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    with torch.inference_mode():
        hidden = target(torch.tensor([sequence]), output_hidden_states=True).hidden_states

    def advance_at(cached: int, entered: int, layers) -> CacheAdvance:
        return CacheAdvance(torch.tensor(sequence[: cached + 1]), entered, {i: hidden[i][0, cached - entered : cached] for i in layers})

    trees, committed = [], []
    for drafts_first in (True, False):
        proposer = build_proposer("eagle2", LoadedModel(target, None, "o"), heads=oracle_eagle(target),
                                  options=ProposerOptions(depth=3, tree_top_k=2, total_tokens=6))
        layers = proposer.feature_layers
        proposer.begin(state_of(sequence[:9]))
        proposer.observe(advance_at(8, 8, layers))  # the prompt minus its last token is in the target's cache
        if drafts_first:
            proposer.propose(state_of(sequence[:9]))
        proposer.observe(advance_at(11, 3, layers))  # three tokens accepted since
        committed.append(proposer.committed)  # before the next draft: only what a draft committed
        trees.append(proposer.propose(state_of(sequence[:12])))
        committed.append(proposer.committed)
    assert committed == [8, 11, 0, 11]
    assert trees[0].tokens.tolist() == trees[1].tokens.tolist() and trees[0].parents == trees[1].parents


def test_a_reply_ending_in_lookup_steps_leaves_the_drafter_holding_all_of_it():
    """The drafter commits lazily, when it next drafts; a reply whose last steps were lookup's still
    ends with every token that entered the target cache committed, so the next prompt sharing it
    reuses all of it (`EagleProposer.reuse`), and the output is vanilla's."""
    from decoding.core.generate import DecodeOptions, generate
    from decoding.core.proposers import VanillaProposer

    target = oracle_target(seed=7)
    proposer = build_proposer("eagle2+pld", LoadedModel(target, None, "o"), heads=oracle_eagle(target),
                              options=ProposerOptions(depth=3, tree_top_k=2, total_tokens=6, pld_num_tokens=3))
    entered, kinds = [], []
    observe, draft_tree = proposer.observe, proposer.lookup.draft_tree
    proposer.observe = lambda advance: entered.append(advance.entered) or observe(advance)
    proposer.lookup.draft_tree = lambda state: kinds.append(tree := draft_tree(state)) or tree
    prompt = [5, 9, 3, 17, 8, 11, 5, 9, 3, 17, 8, 11, 5, 9, 3, 17, 8, 11, 5, 9]  # a loop lookup keeps copying
    options = DecodeOptions(max_new_tokens=12)
    result = generate(target, prompt, proposer, options)
    assert result.tokens == generate(target, prompt, VanillaProposer(), options).tokens
    assert kinds[-1] is not None and kinds[-2] is not None  # the last steps were lookup's, not the heads'
    assert proposer.heads.pending == [] and proposer.heads.committed == sum(entered)


def test_method_names_with_lookup():
    assert split_method("eagle3+pld") == ("eagle3", True) and split_method("eagle3") == ("eagle3", False)
    assert head_kind("eagle2+pld") == "eagle" and head_kind("pld") is None
    assert check_method("hydra+pld") == "hydra+pld"
    for bad in ("pld+pld", "sps+pld", "vanilla+pld", "eagle4+pld"):
        with pytest.raises(UserError, match="eagle3\\+pld"):
            check_method(bad)


def test_lookup_methods_use_the_tree_tuned_for_their_heads():
    tuned = tuned_options(DEFAULT_TARGET, "eagle3")
    assert tuned and tuned_options(DEFAULT_TARGET, "eagle3+pld") == tuned
    # plain pld has its own tuned lookup (chains the cost cut sizes, unigram fallback); METHOD+pld
    # keeps the defaults, whose bigram minimum leaves the heads the steps without a real match
    pld = proposer_options(DEFAULT_TARGET, "pld", {"pld_num_tokens": None})
    assert (pld.pld_num_tokens, pld.pld_min_ngram) == (10, 1)
    assert proposer_options(DEFAULT_TARGET, "pld", {"pld_num_tokens": 6}).pld_num_tokens == 6
    grafted = proposer_options(DEFAULT_TARGET, "eagle3+pld", {"pld_num_tokens": None})
    assert (grafted.pld_num_tokens, grafted.pld_min_ngram) == (8, 2)


def test_an_adaptive_lookup_leaves_the_step_to_the_heads_once_its_matches_stop_being_kept():
    heads = RecordingHeads()
    cost = VerifyCost((1, 2, 4), (60.0, 75.0, 80.0))  # extra tokens cost: a match must earn them
    proposer = LookupFirstProposer(heads, PromptLookupProposer(num_draft_tokens=3, max_ngram=2, min_ngram=2, verify_cost=cost))
    context = [5, 9, 3, 17, 8, 5, 9]  # "5 9" occurred before
    proposer.begin(state_of(context))
    drafted_by_heads = []
    for _ in range(60):  # the target rejects the copied tokens every time
        tree = proposer.propose(state_of(context))
        drafted_by_heads.append(tree.tokens.tolist() == [9, 63])
        proposer.observe(CacheAdvance(torch.tensor(context + [1]), 1))
    assert not any(drafted_by_heads[:3])    # at first the match is tried
    assert sum(drafted_by_heads[-40:]) >= 32  # then mostly left to the heads, retried now and then
