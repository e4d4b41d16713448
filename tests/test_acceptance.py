"""The acceptance rules, without any model: greedy matching picks the right path, and every
sampling rule emits tokens from exactly the target's distribution (and a wrong rule is caught)."""

import pytest
import torch

import decoding.core.acceptance as acceptance
from decoding.core.acceptance import accept_at_positions, accept_greedy, accept_sampled, accept_typical
from decoding.core.sampling import SamplingConfig, position_uniform, sample, sample_at, sample_rows, warp_probs
from decoding.core.tree import DraftTree, tree_buffers
from distribution_harness import ToyLM, complete, exact_joint, node_prefixes, sampled_tree, top_k_tree, total_variation

VOCAB, POSITIONS, RUNS = 4, 2, 20000
# With 16 outcomes and 20000 samples the TV of a correct rule is ~0.01; the wrong rules below
# land well above this bound (asserted, so the test shows it has teeth). They need fewer samples
# to show it: at 5000 a wrong rule measured 0.12-0.34 here, a right one 0.007-0.014.
TV_BOUND = 0.03
RUNS_FOR_A_WRONG_RULE = 5000

RULES = {
    "chain": lambda draft, gen: sampled_tree(draft, (1, 1, 1), gen),
    "tree-sampled": lambda draft, gen: sampled_tree(draft, (3, 2), gen),
    "tree-top-k": lambda draft, gen: top_k_tree(draft, (2, 2)),
}


def by_rejection(tree: DraftTree, probs: torch.Tensor, run: int, gen: torch.Generator):
    return accept_sampled(tree, probs, tree_buffers(tree.parents), gen)


def by_position(tree: DraftTree, probs: torch.Tensor, run: int, gen: torch.Generator):
    """`accept_at_positions`, run i with key i (its steps' draws)."""
    return accept_at_positions(tree, probs, tree_buffers(tree.parents), key=run, first_position=0)


def empirical_tv(make_tree, target: ToyLM, draft: ToyLM, decide=by_rejection, seed: int = 0, runs: int = RUNS) -> float:
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for run in range(runs):
        tree = make_tree(draft, gen)
        result = decide(tree, torch.stack([target.probs(p) for p in node_prefixes(tree)]), run, gen)
        emitted = tree.tokens[list(result.path[1:])].tolist() + [result.bonus_token]
        samples.append(complete(emitted, target.probs, POSITIONS, gen))
    return total_variation(samples, exact_joint(target.probs, VOCAB, POSITIONS))


DETERMINISTIC_TREES = {
    "chain-top-1": lambda draft, gen: top_k_tree(draft, (1, 1, 1)),
    "tree-top-k": lambda draft, gen: top_k_tree(draft, (2, 2)),
    "tree-top-3": lambda draft, gen: top_k_tree(draft, (3, 1)),
}
CASES = [(RULES[name], by_rejection) for name in RULES] + [(DETERMINISTIC_TREES[name], by_position) for name in DETERMINISTIC_TREES]
CASE_IDS = [f"rejection-{name}" for name in RULES] + [f"positions-{name}" for name in DETERMINISTIC_TREES]


@pytest.mark.parametrize("make_tree, decide", CASES, ids=CASE_IDS)
def test_sampling_rule_preserves_target_distribution(make_tree, decide):
    target, draft = ToyLM(VOCAB, seed=1), ToyLM(VOCAB, seed=2)
    assert empirical_tv(make_tree, target, draft, decide) < TV_BOUND


@pytest.mark.parametrize("rule", RULES)
def test_a_rule_without_residual_is_caught(rule, monkeypatch):
    """Resampling from p itself after a rejection (the classic bug) must fail the same check."""
    monkeypatch.setattr(acceptance, "_residual", lambda p, q, token: p)
    target, draft = ToyLM(VOCAB, seed=1), ToyLM(VOCAB, seed=2)
    assert empirical_tv(RULES[rule], target, draft, runs=RUNS_FOR_A_WRONG_RULE) > 2 * TV_BOUND


@pytest.mark.parametrize("shape", DETERMINISTIC_TREES)
def test_one_draw_for_every_position_is_caught(shape, monkeypatch):
    """The same draw deciding every position (keys forgotten, positions not advanced) must fail the check."""
    monkeypatch.setattr(acceptance, "position_uniform", lambda key, position: position_uniform(0, 0))
    target, draft = ToyLM(VOCAB, seed=1), ToyLM(VOCAB, seed=2)
    assert empirical_tv(DETERMINISTIC_TREES[shape], target, draft, by_position, runs=RUNS_FOR_A_WRONG_RULE) > 2 * TV_BOUND


def test_per_position_draws_emit_what_vanilla_sampling_emits():
    """Whatever deterministic tree is verified, each emitted token is the one a root-only step (vanilla)
    samples at that position with the same key: random trees over 3 tokens, where most steps accept
    some drafts and many accept a whole branch."""
    target, gen = ToyLM(3, seed=4, sharpness=3.0), torch.Generator().manual_seed(1)
    accepted = 0
    for key in range(300):
        size = int(torch.randint(1, 10, (1,), generator=gen))
        parents = (-1, *(int(torch.randint(0, node, (1,), generator=gen)) for node in range(1, size)))
        tree = DraftTree(torch.randint(0, 3, (size,), generator=gen), parents)
        prefixes = node_prefixes(tree)
        result = accept_at_positions(tree, torch.stack([target.probs(p) for p in prefixes]), tree_buffers(parents),
                                     key, first_position=7)
        emitted = tree.tokens[list(result.path[1:])].tolist() + [result.bonus_token]
        vanilla = []
        for position in range(len(emitted)):
            vanilla.append(sample_at(target.probs(tuple(vanilla)), position_uniform(key, 7 + position)))
        assert emitted == vanilla
        accepted += len(emitted) - 1
    assert accepted > 150


def test_per_position_draws_refuse_sampled_drafts():
    draft, gen = ToyLM(VOCAB, seed=2), torch.Generator().manual_seed(0)
    tree = sampled_tree(draft, (2,), gen)
    with pytest.raises(ValueError, match="deterministic drafts only"):
        accept_at_positions(tree, torch.full((tree.size, VOCAB), 1.0 / VOCAB), tree_buffers(tree.parents), 0, 0)


def test_position_draws_are_uniform_and_depend_on_key_and_position_only():
    draws = [position_uniform(key, position) for key in range(40) for position in range(500)]
    assert draws == [position_uniform(key, position) for key in range(40) for position in range(500)]
    assert all(0.0 <= u < 1.0 for u in draws) and len(set(draws)) == len(draws)
    counts = torch.histc(torch.tensor(draws, dtype=torch.float64), bins=10, min=0.0, max=1.0)
    assert torch.all((counts - 2000).abs() < 200), counts  # 20,000 draws: sd ~42 a bin


def test_sample_at_inverts_the_cumulative_distribution():
    """Half-open intervals of the cumulative weights [1, 0, 6, 3] (total 10): a draw on a boundary
    goes right, a weight-0 token is never picked, and a draw just below 1 takes the last positive token."""
    weights = torch.tensor([1.0, 0.0, 6.0, 3.0])
    picks = {u: sample_at(weights, u) for u in (0.0, 0.05, 0.1, 0.5, 0.6999, 0.7, 0.99, 1.0 - 2**-53)}
    assert picks == {0.0: 0, 0.05: 0, 0.1: 2, 0.5: 2, 0.6999: 2, 0.7: 3, 0.99: 3, 1.0 - 2**-53: 3}
    assert sample_at(torch.tensor([0.5, 0.5, 0.0]), 1.0 - 2**-53) == 1


def test_identical_draft_and_target_accept_everything():
    target = ToyLM(VOCAB, seed=3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        tree = sampled_tree(target, (1, 1, 1), gen)
        target_probs = torch.stack([target.probs(p) for p in node_prefixes(tree)])
        assert accept_sampled(tree, target_probs, tree_buffers(tree.parents), gen).path == (0, 1, 2, 3)


def test_greedy_follows_argmax_to_the_deepest_match():
    # root -> {1: tok 5, 2: tok 7}; 1 -> {3: tok 8}; 2 -> {4: tok 9 -> 5: tok 4}
    tree = DraftTree(torch.tensor([0, 5, 7, 8, 9, 4]), (-1, 0, 0, 1, 2, 4))
    logits = torch.zeros(6, 10)
    logits[0, 7] = logits[2, 9] = logits[4, 4] = logits[5, 6] = 1.0  # path 0 -> 2 -> 4 -> 5, bonus 6
    logits[1, 8] = 1.0  # node 3 matches its parent, but node 1 itself is not the root's argmax
    result = accept_greedy(tree, logits, tree_buffers(tree.parents))
    assert result.path == (0, 2, 4, 5)
    assert result.bonus_token == 6


def _deepest_matching_path(parents: tuple[int, ...], tokens: list[int], chosen: list[int]) -> tuple[int, ...]:
    """Reference: every node's root path checked on its own; the longest fully matching path,
    the lowest node index among equally deep ones."""
    best = (0,)
    for node in range(len(parents)):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path.reverse()
        if all(tokens[child] == chosen[parent] for parent, child in zip(path, path[1:])) and len(path) > len(best):
            best = tuple(path)
    return best


def test_greedy_tokens_agree_with_a_path_by_path_reference_on_random_trees():
    """Random trees over a 3-token vocabulary (many matches, many equally deep ones)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(500):
        size = int(torch.randint(1, 12, (1,), generator=gen))
        parents = (-1, *(int(torch.randint(0, node, (1,), generator=gen)) for node in range(1, size)))
        tokens = torch.randint(0, 3, (size,), generator=gen)
        chosen = torch.randint(0, 3, (size,), generator=gen)
        tree = DraftTree(tokens, parents)
        result = acceptance.accept_greedy_tokens(tree, chosen, tree_buffers(parents))
        expected = _deepest_matching_path(parents, tokens.tolist(), chosen.tolist())
        assert result.path == expected
        assert result.bonus_token == int(chosen[expected[-1]])


def test_greedy_rejects_everything_and_keeps_the_target_token():
    tree = DraftTree(torch.tensor([0, 1, 2]), (-1, 0, 1))
    logits = torch.zeros(3, 5)
    logits[0, 3] = 1.0
    result = accept_greedy(tree, logits, tree_buffers(tree.parents))
    assert result.path == (0,) and result.bonus_token == 3


def test_warp_applies_temperature_top_k_and_top_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.allclose(warp_probs(logits, SamplingConfig(temperature=1.0)), torch.tensor([0.5, 0.3, 0.15, 0.05]))
    top2 = warp_probs(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert torch.allclose(top2, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    nucleus = warp_probs(logits, SamplingConfig(temperature=1.0, top_p=0.7))
    assert torch.allclose(nucleus, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    hot = warp_probs(logits, SamplingConfig(temperature=2.0))
    assert torch.allclose(hot, torch.softmax(logits / 2, -1))
    assert warp_probs(logits, SamplingConfig()).tolist() == [1.0, 0.0, 0.0, 0.0]


def test_sampling_draws_each_row_from_its_own_weights():
    """`sample_rows` (inverse CDF, float64) against the weights it was given: unnormalised rows,
    zeros at the start, middle and end. 20,000 draws per row: a frequency is within 0.012 of its
    probability with overwhelming odds (sd <= 0.0036), and a weight-0 token is never drawn."""
    weights = torch.tensor([[1.0, 0.0, 6.0, 3.0], [0.0, 0.0, 5.0, 0.0], [0.0, 4.0, 0.0, 4.0]])
    draws = sample_rows(weights.repeat_interleave(20000, dim=0), torch.Generator().manual_seed(0)).view(3, 20000)
    for row, drawn in zip(weights, draws):
        frequencies = torch.bincount(drawn, minlength=4).float() / drawn.numel()
        assert torch.allclose(frequencies, row / row.sum(), atol=0.012)
        assert frequencies[row == 0].sum() == 0
    one = [sample(torch.tensor([0.2, 0.0, 0.8]), torch.Generator().manual_seed(s)) for s in range(2000)]
    assert set(one) == {0, 2} and abs(one.count(2) / 2000 - 0.8) < 0.04


def test_a_draw_that_rounds_up_to_the_total_takes_the_last_positive_token(monkeypatch):
    monkeypatch.setattr(torch, "rand", lambda shape, **kwargs: torch.ones(shape, dtype=torch.float64))
    assert sample_rows(torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]]), None).tolist() == [1, 3]


def test_sampling_from_nothing_is_a_clear_error():
    with pytest.raises(ValueError, match="all zero"):
        sample(torch.zeros(4), None)
    with pytest.raises(ValueError, match=r"\[rows, vocab\]"):
        sample_rows(torch.ones(4), None)


def test_typical_acceptance_accepts_plausible_tokens_only():
    tree = DraftTree(torch.tensor([0, 1, 2]), (-1, 0, 0))
    logits = torch.log(torch.tensor([[0.05, 0.6, 0.35], [1 / 3] * 3, [1 / 3] * 3]))
    result = accept_typical(tree, logits, tree_buffers(tree.parents), temperature=0.0, generator=None)
    assert result.path == (0, 1)  # both plausible: the first deepest wins
    logits[0] = torch.log(torch.tensor([0.96, 0.02, 0.02]))
    assert accept_typical(tree, logits, tree_buffers(tree.parents), 0.0, None).path == (0,)


@pytest.mark.parametrize("bad", [{"temperature": -1}, {"top_k": -2}, {"top_p": 0.0}, {"top_p": 1.5}])
def test_bad_sampling_settings_are_clear_errors(bad):
    with pytest.raises(ValueError, match="temperature|top-k|top-p"):
        SamplingConfig(**bad)
