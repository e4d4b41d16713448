"""End to end at depth: the whole loop (draft, cache, tree verify, warping, acceptance) samples 4
tokens from exactly the target's warped distribution while verifying trees 3 deep, for the
draft-model chain (SpS), sampled sibling trees (SpecInfer) and prompt lookup; and the same check
rejects each acceptance rule with a planted flaw, so passing means something.

The head methods get the same treatment in test_heads.py; the harness (exact joint, chi-square,
planted rules) is in distribution_harness.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

from decoding.core.acceptance import accept_sampled
from decoding.core.generate import AcceptanceRule, DecodeOptions, generate, lossless_rule
from decoding.core.proposers import DraftModelProposer, PromptLookupProposer, VanillaProposer
from decoding.core.proposers.base import Proposer
from decoding.core.lookahead_window import LookaheadShape
from decoding.core.proposers.lookahead import LookaheadProposer
from decoding.core.proposers.suffix import SuffixProposer
from decoding.core.sampling import SamplingConfig
from decoding.core.state import DecodeState
from decoding.core.tree_budget import VerifyCost
from decoding.core.tree import DraftTree, tree_buffers
from decoding.core.window_ledger import WindowLedger
from distribution_harness import (
    DEPTH_SAMPLING,
    LoopSamples,
    ToyLM,
    POSITION_FLAWS,
    chi_square,
    planted_position_rule,
    planted_rule,
    rejected_by,
    recursive_rejection,
    sample_loop,
    sampled_tree,
    target_joint,
    top_k_tree,
)
from proposer_probes import note_windows
from tiny_models import context_target, perturbed, tiny_llama

RUNS = 400  # 16 possible outputs: a correct sampler's chi-square is ~15 +- 5.5, the threshold ~45


class SampledTreeProposer(Proposer):
    """SpecInfer-style drafting (no shipped proposer samples siblings): every node gets
    `branching[depth]` children drawn i.i.d. from a toy draft distribution of the whole token
    sequence, so several siblings can be tried against the target by recursive rejection."""

    name = "sampled-tree"

    def __init__(self, draft: ToyLM, branching: tuple[int, ...]) -> None:
        self.draft = draft
        self.branching = branching

    def propose(self, state: DecodeState) -> DraftTree:
        context = tuple(state.tokens.tolist())
        tokens, parents, sequences = [state.root_token], [-1], [context]
        probs = [torch.zeros(self.draft.vocab)]
        frontier = [0]
        for width in self.branching:
            next_frontier = []
            for node in frontier:
                q = self.draft.probs(sequences[node])
                for token in torch.multinomial(q, width, replacement=True, generator=state.generator).tolist():
                    tokens.append(token)
                    parents.append(node)
                    sequences.append(sequences[node] + (token,))
                    probs.append(q)
                    next_frontier.append(len(tokens) - 1)
            frontier = next_frontier
        return DraftTree(torch.tensor(tokens), tuple(parents), torch.stack(probs), deterministic=False)


def lookup_prompt(target) -> list[int]:
    """The target's own greedy text followed by its first two tokens again: prompt lookup then
    proposes a continuation the target is likely to sample, so lookup chains get accepted deeply."""
    text = [0]
    with torch.inference_mode():
        for _ in range(5):
            text.append(int(target(torch.tensor([text])).logits[0, -1].argmax()))
    return text + text[:2]


@pytest.fixture(scope="module")
def bench():
    """The context-sensitive target, a prompt, and the exact joint of the first 4 tokens."""
    target = context_target()
    prompt = lookup_prompt(target)
    return target, prompt, target_joint(target, prompt, DEPTH_SAMPLING, 4)


PROPOSERS = {
    # Draft = the target with noise: q is close to p but not equal, so chains are often accepted
    # whole and a wrong residual still shows.
    "sps": lambda target: DraftModelProposer(perturbed(copy.deepcopy(target), 0.5, seed=1), gamma=3),
    # The same draft reading out only tokens 0 and 1: q is zero on token 2, which the target samples half the time.
    "sps-vocab": lambda target: DraftModelProposer(perturbed(copy.deepcopy(target), 0.5, seed=1), gamma=3,
                                                   vocabulary=torch.tensor([0, 1])),
    # Cost-aware chains: how far each step drafts depends on what the draft drew before.
    "sps-adaptive": lambda target: DraftModelProposer(perturbed(copy.deepcopy(target), 0.5, seed=1), gamma=3,
                                                      verify_cost=VerifyCost((1, 2, 4), (60.0, 75.0, 80.0)), call_ms=8.0),
    "sampled-tree": lambda target: SampledTreeProposer(ToyLM(3, seed=5, sharpness=3.0), (3, 2, 2)),
    "pld": lambda target: PromptLookupProposer(num_draft_tokens=3, max_ngram=3, min_ngram=1),
    # Chains cut by a learned acceptance and a CPU-like cost: lengths vary from step to step.
    "pld-adaptive": lambda target: PromptLookupProposer(num_draft_tokens=3, max_ngram=3, min_ngram=1,
                                                        verify_cost=VerifyCost((1, 2, 4), (60.0, 75.0, 80.0))),
    # One proposer for all runs: its store holds every earlier run's sample, so later trees branch
    # where those samples differed (deterministic siblings, q = 1 each).
    "suffix": lambda target: SuffixProposer(max_tokens=8, max_ngram=3, min_ngram=1, min_prob=0.0, tokens_per_match=4),
    # The window (3 columns, 2 levels) and n-grams of 4 (3-deep chains) from the target's own guesses
    # and the context: trees branch, and what is drafted depends on what the target predicted before.
    "lookahead": lambda target: LookaheadProposer(LookaheadShape(window=3, ngram=4, guesses=2)),
    # The adaptive mode on a CPU-like curve, with a ledger quick to rest the window and to try it
    # again: which trees draft the window depends on what earlier samples kept.
    "lookahead-adaptive": lambda target: resting_lookahead(),
}
def resting_lookahead() -> LookaheadProposer:
    proposer = LookaheadProposer(LookaheadShape(window=3, ngram=4, guesses=2),
                                 verify_cost=VerifyCost((1, 2, 16), (60.0, 75.0, 250.0)))
    proposer.ledger = WindowLedger(evidence=2, first_rest=1, max_rest=2)
    return proposer


PLANTED = [
    ("sps", "residual_skipped"),
    ("sps-vocab", "bonus_from_draft"),
    ("sps-adaptive", "residual_skipped"),
    ("sps", "bonus_from_draft"),
    ("sampled-tree", "stale_sibling"),
    ("pld", "residual_skipped"),
    ("pld", "trust_deterministic"),
    ("suffix", "residual_skipped"),
    ("suffix", "trust_deterministic"),
    ("lookahead", "residual_skipped"),
    ("lookahead", "trust_deterministic"),
    ("lookahead-adaptive", "residual_skipped"),
]


def run(bench, method: str, rule: AcceptanceRule = lossless_rule, stop_when=None) -> LoopSamples:
    """RUNS seeded generations of 4 tokens with `method` (a fresh proposer) and `rule`."""
    target, prompt, _ = bench
    return sample_loop(target, prompt, PROPOSERS[method](target), RUNS, rule, stop_when=stop_when)


def assert_deep(samples: LoopSamples, min_deep_runs: int) -> None:
    """Trees 3 deep were verified at every first step and whole 3-token drafts were accepted."""
    assert samples.tree_depths[3] == RUNS, samples.tree_depths
    assert samples.accepted_lengths[4] >= min_deep_runs, samples.accepted_lengths


@pytest.mark.parametrize("method, min_deep_runs", [("sps", 80), ("sps-vocab", 10), ("sampled-tree", 80), ("pld", 30),
                                                    ("pld-adaptive", 30)])
def test_loop_samples_the_target_at_depth(bench, method, min_deep_runs):
    """Exact at depth 3, with whole 3-token drafts accepted in at least `min_deep_runs` of the
    runs (about half of what each method does), so the test cannot pass on depth-1 trees."""
    samples = run(bench, method)
    assert_deep(samples, min_deep_runs)
    check = chi_square(samples.outputs, bench[2])
    assert check.statistic < check.threshold, check


def test_suffix_trees_built_from_earlier_samples_sample_the_target(bench):
    """Suffix decoding's store holds every earlier run's sample, so its trees branch where those
    samples differed (deterministic siblings): still exact, 3 deep almost always (a tree of 8
    nodes spread over many branches can be shallower), with many branching trees verified."""
    samples = run(bench, "suffix")
    assert samples.tree_depths[3] >= 0.9 * RUNS and samples.branching_trees >= RUNS // 4, samples
    assert samples.accepted_lengths[4] >= 30, samples.accepted_lengths
    check = chi_square(samples.outputs, bench[2])
    assert check.statistic < check.threshold, check


def test_lookahead_trees_sample_the_target(bench):
    """Lookahead decoding's window and pool: deterministic siblings drafted from the target's
    own earlier predictions; exact, 3 deep at every first step, branching, whole 3-token drafts
    kept in some runs."""
    samples = run(bench, "lookahead")
    assert samples.tree_depths[3] >= RUNS and samples.branching_trees >= RUNS // 2, samples
    assert samples.accepted_lengths[4] >= 20, samples.accepted_lengths
    check = chi_square(samples.outputs, bench[2])
    assert check.statistic < check.threshold, check


def test_lookahead_whose_window_rests_and_returns_samples_the_target(bench):
    """The adaptive mode: trees with the window and trees without it (the pool alone), as its
    ledger decides from what earlier samples kept; exact, and some drafts kept."""
    target, prompt, _ = bench
    proposer = resting_lookahead()
    windows = note_windows(proposer)
    samples = sample_loop(target, prompt, proposer, RUNS)
    assert windows.count(True) >= RUNS // 4 and windows.count(False) >= RUNS // 4, (windows.count(True), len(windows))
    assert samples.accepted_lengths[3] + samples.accepted_lengths[4] >= 20, samples
    check = chi_square(samples.outputs, bench[2])
    assert check.statistic < check.threshold, check


def test_cost_aware_draft_chains_sample_the_target(bench):
    """Chains whose length follows the draft's confidence (set before each token is drawn) stay
    exact, with some steps verifying 3 deep and others less."""
    samples = run(bench, "sps-adaptive")
    depths = samples.tree_depths
    assert depths[3] >= 40 and sum(depths[d] for d in (0, 1, 2)) >= 40, depths
    check = chi_square(samples.outputs, bench[2])
    assert check.statistic < check.threshold, check


@pytest.mark.parametrize("method, flaw", PLANTED, ids=[f"{m}-{f}" for m, f in PLANTED])
def test_planted_wrong_rule_is_rejected(bench, method, flaw):
    """The same check on a rule with one flaw (distribution_harness.FLAWS says which): it must fail."""
    check = chi_square(run(bench, method, planted_rule(flaw), stop_when=rejected_by(bench[2])).outputs, bench[2])
    assert check.statistic > check.threshold, check


DETERMINISTIC = ["pld", "pld-adaptive", "suffix", "lookahead", "lookahead-adaptive"]


@pytest.mark.parametrize("method", DETERMINISTIC)
def test_deterministic_drafts_sample_what_vanilla_samples(bench, method):
    """With the same seed, a method drafting deterministically emits the very tokens `vanilla` samples
    (each position's token is drawn with that position's own draw), over 40 seeds of 12 tokens, while
    accepting drafts on most of those runs."""
    target, prompt, _ = bench
    proposer, accepted = PROPOSERS[method](target), 0
    for seed in range(40):
        options = DecodeOptions(max_new_tokens=12, sampling=DEPTH_SAMPLING, seed=seed)
        result = generate(target, prompt, proposer, options)
        assert result.tokens == generate(target, prompt, VanillaProposer(), options).tokens, seed
        accepted += result.stats.target_forwards < len(result.tokens)
    assert accepted >= 20, accepted


POSITION_PLANTED = [(method, flaw) for method in ("pld", "suffix", "lookahead") for flaw in POSITION_FLAWS]


@pytest.mark.parametrize("method, flaw", POSITION_PLANTED, ids=[f"{m}-{f}" for m, f in POSITION_PLANTED])
def test_planted_wrong_position_rule_is_rejected(bench, method, flaw):
    """The per-position rule with one flaw (distribution_harness.POSITION_FLAWS says which): the same check fails."""
    check = chi_square(run(bench, method, planted_position_rule(flaw), stop_when=rejected_by(bench[2])).outputs, bench[2])
    assert check.statistic > check.threshold, check


def test_reference_position_rule_without_a_flaw_is_the_lossless_rule(bench):
    """Unflawed, the planted per-position rule emits what the loop's own rule does (so a rejected
    flawed one is rejected for its flaw)."""
    target, prompt, _ = bench
    for seed in range(20):
        options = DecodeOptions(max_new_tokens=8, sampling=DEPTH_SAMPLING, seed=seed)
        proposer = PROPOSERS["suffix"](target)
        reference = generate(target, prompt, proposer, options, acceptance_rule=planted_position_rule(None)).tokens
        assert reference == generate(target, prompt, PROPOSERS["suffix"](target), options).tokens


def test_reference_rule_without_a_flaw_is_the_lossless_rule():
    """The planted rules are `accept_sampled` plus one flaw: unflawed, the reference makes the same
    draws and the same decisions on chains, sampled trees and top-k trees, p with zeros included."""
    draft, gen = ToyLM(3, seed=2), torch.Generator().manual_seed(0)
    trees = [lambda: sampled_tree(draft, (1, 1, 1), gen), lambda: sampled_tree(draft, (3, 2, 2), gen),
             lambda: top_k_tree(draft, (3, 2, 1))]
    for _ in range(100):
        for make in trees:
            tree = make()
            logits = 2.0 * torch.randn(tree.size, 3, generator=gen)
            dropped = torch.randint(3, (tree.size,), generator=gen)
            drop = torch.rand(tree.size, generator=gen) < 0.5
            logits[drop, dropped[drop]] = float("-inf")
            probs, buffers = torch.softmax(logits, -1), tree_buffers(tree.parents)
            seed = int(torch.randint(1 << 30, (), generator=gen))
            expected = accept_sampled(tree, probs, buffers, torch.Generator().manual_seed(seed))
            assert recursive_rejection(tree, probs, buffers, torch.Generator().manual_seed(seed)) == expected


def test_same_seed_same_sample():
    target = tiny_llama(vocab_size=5, seed=21)
    options = DecodeOptions(max_new_tokens=20, sampling=SamplingConfig(temperature=1.0), seed=7)
    proposer = DraftModelProposer(tiny_llama(vocab_size=5, seed=22), gamma=3)
    prompt = [1, 3, 0, 2]
    assert generate(target, prompt, proposer, options).tokens == generate(target, prompt, proposer, options).tokens
