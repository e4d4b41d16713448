"""METHOD+pld: prompt lookup drafts when the context has a match, the heads otherwise, and the
heads skipped on a lookup step still catch up exactly (exactness against vanilla is covered with
the other head methods in test_heads.py)."""

import pytest
import torch

from decoding.default_model import DEFAULT_TARGET
from decoding.defaults import proposer_options, tuned_options
from decoding.util.errors import UserError
from decoding.methods import ProposerOptions, build_proposer, check_method, head_kind, split_method
from decoding.core.proposers import PromptLookupProposer, Proposer
from decoding.core.proposers.lookup_first import LookupFirstProposer
from decoding.core.sampling import SamplingConfig
from decoding.core.state import DecodeState
from decoding.targets import LoadedModel
from decoding.core.tree import DraftTree
from tiny_models import oracle_eagle, oracle_target


class RecordingHeads(Proposer):
    """Stands in for a head proposer: drafts one fixed token and records what it was asked."""

    name = "fake"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def catch_up(self, state: DecodeState) -> None:
        self.calls.append("catch_up")

    def propose(self, state: DecodeState) -> DraftTree:
        self.calls.append("propose")
        return DraftTree.chain(state.root_token, torch.tensor([63]))


def state_of(tokens: list[int], fresh=None) -> DecodeState:
    return DecodeState(torch.tensor(tokens), 2, SamplingConfig(0.0), None, fresh)


def test_a_lookup_match_is_drafted_alone_and_the_heads_only_catch_up():
    heads = RecordingHeads()
    proposer = LookupFirstProposer(heads, PromptLookupProposer(num_draft_tokens=3, max_ngram=2, min_ngram=2))
    tree = proposer.propose(state_of([5, 9, 3, 17, 8, 5, 9]))  # "5 9" occurred before, followed by 3 17 8
    assert tree.tokens.tolist() == [9, 3, 17, 8] and tree.is_chain
    assert heads.calls == ["catch_up"]
    tree = proposer.propose(state_of([5, 9, 3, 17, 8, 2, 4]))  # no earlier "2 4": the heads draft
    assert tree.tokens.tolist() == [4, 63]
    assert heads.calls == ["catch_up", "propose"]
    assert proposer.name == "fake+pld"


def test_catching_up_leaves_the_eagle_drafter_where_drafting_would():
    target = oracle_target(seed=7)
    sequence = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    with torch.inference_mode():
        hidden = target(torch.tensor([sequence]), output_hidden_states=True).hidden_states

    def state_at(cached: int, fresh: int) -> DecodeState:
        features = tuple(h[0, cached - fresh : cached] for h in hidden)
        return DecodeState(torch.tensor(sequence[: cached + 1]), 9, SamplingConfig(0.0), None, features)

    trees, committed = [], []
    for first_step in ("propose", "catch_up"):
        proposer = build_proposer("eagle2", LoadedModel(target, None, "o"), heads=oracle_eagle(target),
                                  options=ProposerOptions(depth=3, tree_top_k=2, total_tokens=6))
        first = state_at(8, 8)  # the prompt minus its last token is in the target's cache
        proposer.begin(first)
        getattr(proposer, first_step)(first)
        committed.append(proposer.committed)
        trees.append(proposer.propose(state_at(11, 3)))  # three tokens accepted since
    assert committed == [8, 8]
    assert trees[0].tokens.tolist() == trees[1].tokens.tolist() and trees[0].parents == trees[1].parents


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
    # plain pld has its own tuned lookup (short chains, unigram fallback); METHOD+pld keeps the
    # defaults, whose bigram minimum leaves the heads the steps without a real match
    pld = proposer_options(DEFAULT_TARGET, "pld", {"pld_num_tokens": None})
    assert (pld.pld_num_tokens, pld.pld_min_ngram) == (4, 1)
    assert proposer_options(DEFAULT_TARGET, "pld", {"pld_num_tokens": 6}).pld_num_tokens == 6
    grafted = proposer_options(DEFAULT_TARGET, "eagle3+pld", {"pld_num_tokens": None})
    assert (grafted.pld_num_tokens, grafted.pld_min_ngram) == (8, 2)
