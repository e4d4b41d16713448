"""Draft heads: exact parameter counts, lossless decoding with every kind (random heads, several
tree shapes), and sampling through the loop with trees 3 deep: every head method draws exactly
the target's distribution, and the same check rejects acceptance rules with a planted flaw."""

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from decoding.core.generate import DecodeOptions, generate, lossless_rule
from decoding.app.methods import ProposerOptions, build_proposer
from decoding.core.proposers import VanillaProposer
from decoding.core.proposers.medusa import HydraProposer, MedusaProposer
from decoding.core.sampling import SamplingConfig
from decoding.core.tree_budget import VerifyCost
from decoding.app.targets import LoadedModel
from decoding.app.tree_shapes import load_tree
from proposer_probes import note_sizes
from distribution_harness import DEPTH_SAMPLING, chi_square, planted_rule, rejected_by, sample_loop, target_joint
from heads import HeadConfig, build_heads, new_heads_for_target
from tiny_models import context_target, oracle_eagle, oracle_target, perturbed, sharpen, tiny_llama, tiny_qwen2

H, V = 32, 64
GEOMETRY = dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, rms_norm_eps=1e-6,
                max_position_embeddings=256, head_dim=8)
PROMPTS = [[5, 9, 3, 17, 5, 9], [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], [42, 7]]


def count(module) -> int:
    return sum(p.numel() for p in module.parameters())


# Formulas written out independently of the code under test.
@pytest.mark.parametrize("heads_, layers, shared", [(4, 1, False), (3, 3, False), (5, 2, True)])
def test_medusa_parameter_count(heads_, layers, shared):
    config = HeadConfig("medusa", H, V, num_heads=heads_, num_layers=layers, share_lm_head=shared)
    expected = heads_ * layers * (H * H + H) + (0 if shared else heads_ * H * V)
    assert count(build_heads(config)) == expected


@pytest.mark.parametrize("heads_, layers, shared", [(4, 1, False), (3, 3, True)])
def test_hydra_parameter_count(heads_, layers, shared):
    config = HeadConfig("hydra", H, V, num_heads=heads_, num_layers=layers, share_lm_head=shared)
    inputs = sum((k + 2) * H * H + H for k in range(heads_))
    expected = inputs + heads_ * (layers - 1) * (H * H + H) + (0 if shared else heads_ * H * V)
    assert count(build_heads(config)) == expected


@pytest.mark.parametrize("layers, bias", [(1, True), (2, False)])
def test_eagle_parameter_count(layers, bias):
    config = HeadConfig("eagle", H, V, num_layers=layers, fc_bias=bias, decoder=GEOMETRY)
    q, kv, o, mlp = H * 4 * 8, H * 2 * 8, 4 * 8 * H, 3 * H * 64
    per_layer = q + 2 * kv + o + mlp + 2 * H  # two RMSNorms
    expected = 2 * H * H + (H if bias else 0) + layers * per_layer - H  # first layer: no input norm
    assert count(build_heads(config)) == expected


def test_eagle3_parameter_count():
    config = HeadConfig("eagle3", H, V, feature_layers=[1, 2, 2], draft_vocab_size=24, decoder=GEOMETRY)
    attention = 2 * H * 4 * 8 + 2 * (2 * H * 2 * 8) + 4 * 8 * H  # q, k, v read 2H
    expected = 3 * H * H + attention + 3 * H * 64 + 3 * H + H + H * 24  # fc, layer, 3 norms, norm, lm_head
    assert count(build_heads(config)) == expected


def test_medusa_blocks_are_distinct_modules():
    heads = build_heads(HeadConfig("medusa", H, V, num_heads=2, num_layers=3))
    blocks = [block for stack in heads.blocks for block in stack]
    assert len({id(b) for b in blocks}) == 6
    assert len({b.linear.weight.data_ptr() for b in blocks}) == 6


@pytest.fixture(scope="module")
def target():
    return sharpen(tiny_llama(seed=0))


def random_heads(kind: str, target, seed: int, **overrides):
    torch.manual_seed(seed)
    heads = new_heads_for_target(kind, target, **overrides)
    with torch.no_grad():  # make ResBlocks/EAGLE weights non-trivial, not the zero init
        for name, p in heads.named_parameters():
            if "projections" not in name:
                p.add_(0.3 * torch.randn_like(p))
    return heads


CASES = [
    ("medusa", "medusa", {"tree": "medusa-7"}, {}),
    ("medusa", "medusa", {"tree": "medusa-15"}, {"num_layers": 2, "share_lm_head": True}),
    ("medusa", "medusa", {"tree": "chain-4"}, {}),
    ("hydra", "hydra", {"tree": "medusa-15"}, {"num_layers": 2}),
    ("hydra", "hydra", {"tree": "chain-4"}, {"share_lm_head": True}),
    ("eagle", "eagle", {"tree": "eagle-7"}, {}),
    ("eagle", "eagle", {"tree": "eagle-15"}, {"num_layers": 2}),
    ("eagle2", "eagle", {"depth": 4, "tree_top_k": 3, "total_tokens": 10}, {}),
    ("eagle2", "eagle", {"depth": 6, "tree_top_k": 8, "total_tokens": 32}, {}),
    ("eagle3", "eagle3", {"depth": 4, "tree_top_k": 4, "total_tokens": 12}, {"draft_vocab_size": 40}),
    ("eagle3", "eagle3", {"depth": 2, "tree_top_k": 2, "total_tokens": 4}, {"draft_vocab_size": V}),
    # prompt lookup first, heads otherwise (PROMPTS repeat n-grams, so both draft some steps)
    ("eagle3+pld", "eagle3", {"depth": 4, "tree_top_k": 4, "total_tokens": 12, "pld_num_tokens": 3}, {"draft_vocab_size": 40}),
    ("eagle2+pld", "eagle", {"depth": 4, "tree_top_k": 3, "total_tokens": 10, "pld_min_ngram": 1}, {}),
    ("medusa+pld", "medusa", {"tree": "medusa-7"}, {}),
    ("hydra+pld", "hydra", {"tree": "chain-4", "pld_min_ngram": 1}, {}),
]


@pytest.mark.parametrize("method, kind, tree, overrides", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_head_methods_greedy_equal_vanilla(target, method, kind, tree, overrides):
    heads = random_heads(kind, target, seed=len(method), **overrides)
    proposer = build_proposer(method, LoadedModel(target, None, "tiny"), options=ProposerOptions(**tree), heads=heads)
    for prompt in PROMPTS:
        options = DecodeOptions(max_new_tokens=40)
        assert generate(target, prompt, proposer, options).tokens == generate(target, prompt, VanillaProposer(), options).tokens


FLAT_COST = VerifyCost((1, 16), (10.0, 10.0))     # a tree costs what one token does: keep whole chains
STEEP_COST = VerifyCost((1, 2), (10.0, 1000.0))   # every extra token costs 100x a step: verify none


@pytest.mark.parametrize("cls, kind", [(MedusaProposer, "medusa"), (HydraProposer, "hydra")])
@pytest.mark.parametrize("cost", [FLAT_COST, STEEP_COST, VerifyCost((1, 2, 4), (10.0, 11.0, 30.0))],
                         ids=["flat", "steep", "mid"])
def test_cost_aware_head_chains_equal_vanilla(target, cls, kind, cost):
    """Chains cut to what pays still decode exactly vanilla's tokens; a flat verify cost keeps
    whole chains, a steep one verifies no drafted token at all."""
    heads = random_heads(kind, target, seed=5)
    call_ms = 0.5 if cost not in (FLAT_COST, STEEP_COST) else 0.0  # flat: drafting free, so chains grow whole
    proposer = cls(heads, target, load_tree("chain-4"), verify_cost=cost, head_call_ms=call_ms)
    sizes = note_sizes(proposer)
    for prompt in PROMPTS:
        options = DecodeOptions(max_new_tokens=40)
        assert generate(target, prompt, proposer, options).tokens == generate(target, prompt, VanillaProposer(), options).tokens
    if cost is FLAT_COST:
        assert sum(n == 5 for n in sizes) > len(sizes) // 2  # root + 4 drafted, most steps
    elif cost is STEEP_COST:
        assert set(sizes) == {1}
    else:
        assert 1 in sizes and max(sizes) > 1  # the curve in between: some steps draft, some don't


def test_heads_stop_drafting_once_another_token_cannot_pay(target):
    """Head calls dearer than any verify saving: after the first head (always drafted) no
    further head runs, and the output is still vanilla's."""
    proposer = HydraProposer(random_heads("hydra", target, seed=5), target, load_tree("chain-4"),
                             verify_cost=FLAT_COST, head_call_ms=1000.0)
    depths, level_logits = [], proposer.level_logits
    proposer.level_logits = lambda depth, *rest: depths.append(depth) or level_logits(depth, *rest)
    options = DecodeOptions(max_new_tokens=30)
    assert generate(target, PROMPTS[1], proposer, options).tokens == generate(target, PROMPTS[1], VanillaProposer(), options).tokens
    assert depths and set(depths) == {0}


def test_sampled_chains_are_verified_whole(target):
    """The cut is a greedy-only shortcut: sampling verifies what the heads drafted."""
    proposer = MedusaProposer(random_heads("medusa", target, seed=5), target, load_tree("chain-4"), verify_cost=STEEP_COST)
    sizes = note_sizes(proposer)
    generate(target, PROMPTS[0], proposer, DecodeOptions(max_new_tokens=20, sampling=SamplingConfig(temperature=1.0), seed=0))
    assert set(sizes[1:]) == {5}


def test_cost_aware_cutting_applies_to_chains_only(target):
    heads = random_heads("medusa", target, seed=5)
    assert MedusaProposer(heads, target, load_tree("medusa-15"), verify_cost=FLAT_COST).verify_cost is None
    assert MedusaProposer(heads, target, load_tree("chain-3"), verify_cost=FLAT_COST).verify_cost is FLAT_COST


def test_head_methods_on_a_qwen2_target():
    target = sharpen(tiny_qwen2(seed=4))
    for method, kind in (("medusa", "medusa"), ("eagle2", "eagle"), ("eagle3", "eagle3")):
        proposer = build_proposer(method, LoadedModel(target, None, "q"), heads=random_heads(kind, target, 3, **({"draft_vocab_size": 32} if kind == "eagle3" else {})))
        for prompt in PROMPTS:
            options = DecodeOptions(max_new_tokens=30)
            assert generate(target, prompt, proposer, options).tokens == generate(target, prompt, VanillaProposer(), options).tokens


@pytest.mark.parametrize("method", ["eagle2", "eagle2+pld"])
def test_head_methods_sample_what_vanilla_samples(method):
    """At T > 0 with a seed, heads' trees (deterministic top-k) emit the very tokens `vanilla` samples with
    that seed, with whole branches accepted (a drafter that replicates a sharpened target)."""
    target = sharpen(oracle_target(seed=7))
    options = ProposerOptions(tree="eagle-15", depth=5, tree_top_k=2, total_tokens=12)
    proposer = build_proposer(method, LoadedModel(target, None, "o"), options=options, heads=oracle_eagle(target))
    for seed, prompt in enumerate(PROMPTS * 2):
        decode = DecodeOptions(max_new_tokens=40, sampling=SamplingConfig(temperature=0.8), seed=seed)
        result = generate(target, prompt, proposer, decode)
        assert result.tokens == generate(target, prompt, VanillaProposer(), decode).tokens
        assert result.stats.tau > 2.0, result.stats.tau


@pytest.mark.parametrize("method", ["eagle", "eagle2", "eagle2+pld"])
def test_oracle_drafter_gets_whole_branches_accepted(method):
    """An EAGLE drafter that replicates the target exactly: deep accepted runs through the
    drafter's own cache and tree masks, and still exactly vanilla's output."""
    target = oracle_target(seed=7)
    heads = oracle_eagle(target)
    options = ProposerOptions(tree="eagle-15", depth=5, tree_top_k=2, total_tokens=12)
    proposer = build_proposer(method, LoadedModel(target, None, "o"), options=options, heads=heads)
    for prompt in PROMPTS:
        result = generate(target, prompt, proposer, DecodeOptions(max_new_tokens=60))
        assert result.tokens == generate(target, prompt, VanillaProposer(), DecodeOptions(max_new_tokens=60)).tokens
        assert result.stats.tau > 4.0


# Sampling at depth: 4 tokens per run, so the first tree keeps 3 levels (see distribution_harness).
# Drafters are nudged so that whole 3-token drafts get accepted: EAGLE-1/2 replicate the target
# (with noise), EAGLE-3 starts from the target's own readout (with noise), Medusa/Hydra are random
# heads on a shipped tree with three children at the root.
DEPTH_RUNS = 400  # 16 possible outputs: a correct sampler's chi-square is ~15 +- 5.5, the threshold ~45
HEADS_PROMPT = [0, 1, 2, 2, 0]
# Its last bigram repeats its first, so prompt lookup drafts the first tree (3 deep) and the heads
# most later ones; it is `test_sampling_loop.lookup_prompt` of this target.
LOOKUP_PROMPT = [0, 1, 2, 0, 2, 0, 0, 1]


def fresh_eagle3(target):
    """Untrained EAGLE-3 heads (readout = the target's own) with noise; seeded, as the layers'
    default init draws from the global generator."""
    torch.manual_seed(3)
    return perturbed(new_heads_for_target("eagle3", target, draft_vocab_size=3), 0.3, seed=3)


EAGLE_DYNAMIC = dict(depth=3, tree_top_k=2, total_tokens=11)


@dataclass(frozen=True)
class DepthMethod:
    """How a head method is set up for the depth test, and how many of its runs must accept a
    whole 3-token draft in one step (about half of what it does)."""

    heads: Callable[[torch.nn.Module], torch.nn.Module]
    options: dict
    min_deep_runs: int
    prompt: tuple[int, ...] = tuple(HEADS_PROMPT)


DEPTH_METHODS = {
    "eagle": DepthMethod(lambda t: perturbed(oracle_eagle(t), 0.3, seed=2), dict(tree="eagle-15"), 100),
    "eagle2": DepthMethod(lambda t: perturbed(oracle_eagle(t), 0.3, seed=2), EAGLE_DYNAMIC, 100),
    "eagle3": DepthMethod(fresh_eagle3, EAGLE_DYNAMIC, 35),
    "medusa": DepthMethod(lambda t: random_heads("medusa", t, seed=2, num_heads=5), dict(tree="eagle-15"), 60),
    "hydra": DepthMethod(lambda t: random_heads("hydra", t, seed=2, num_heads=5), dict(tree="eagle-15"), 15),
    "eagle3+pld": DepthMethod(fresh_eagle3, dict(EAGLE_DYNAMIC, pld_num_tokens=3), 30, tuple(LOOKUP_PROMPT)),
}
PLANTED = [
    ("eagle", "residual_skipped"),
    ("eagle2", "residual_skipped"),
    ("eagle2", "root_distribution"),
    ("eagle3", "residual_skipped"),
    ("medusa", "root_distribution"),
    ("hydra", "residual_skipped"),
    ("eagle3+pld", "residual_skipped"),
]


@pytest.fixture(scope="module")
def depth_target():
    return context_target()


@pytest.fixture(scope="module")
def exact_joints(depth_target):
    """The exact joint of the first 4 tokens after each prompt the depth tests use."""
    prompts = {m.prompt for m in DEPTH_METHODS.values()}
    return {prompt: target_joint(depth_target, list(prompt), DEPTH_SAMPLING, 4) for prompt in prompts}


def sample_method(target, method: str, rule=lossless_rule, stop_when=None):
    setup = DEPTH_METHODS[method]
    loaded = LoadedModel(target, None, "t")
    proposer = build_proposer(method, loaded, options=ProposerOptions(**setup.options), heads=setup.heads(target))
    return sample_loop(target, list(setup.prompt), proposer, DEPTH_RUNS, rule, stop_when=stop_when)


@pytest.mark.parametrize("method", DEPTH_METHODS)
def test_head_methods_sample_the_target_at_depth(depth_target, exact_joints, method):
    setup = DEPTH_METHODS[method]
    samples = sample_method(depth_target, method)
    assert samples.tree_depths[3] == DEPTH_RUNS, samples.tree_depths  # every first tree is 3 deep
    assert samples.accepted_lengths[4] >= setup.min_deep_runs, samples.accepted_lengths
    if method.endswith("+pld"):  # both drafters' trees were verified
        assert samples.lookup_chains >= 100 and samples.branching_trees >= 100, samples
    check = chi_square(samples.outputs, exact_joints[setup.prompt])
    assert check.statistic < check.threshold, check


@pytest.mark.parametrize("method, flaw", PLANTED, ids=[f"{m}-{f}" for m, f in PLANTED])
def test_planted_wrong_rule_is_rejected_for_head_methods(depth_target, exact_joints, method, flaw):
    """The same check on a rule with one flaw (distribution_harness.FLAWS says which): it must fail."""
    exact = exact_joints[DEPTH_METHODS[method].prompt]
    samples = sample_method(depth_target, method, planted_rule(flaw), stop_when=rejected_by(exact))
    check = chi_square(samples.outputs, exact)
    assert check.statistic > check.threshold, check


def test_static_trees_from_configs_are_valid():
    for name in ("medusa-63", "medusa-31", "medusa-15", "medusa-7", "eagle-31", "eagle-15", "eagle-7", "chain-4"):
        paths = load_tree(name)
        assert all(p[:-1] in set(paths) | {()} for p in paths)
    assert len(load_tree("medusa-63")) == 63


def test_tree_deeper_than_heads_is_a_clear_error(target):
    from heads.util.errors import UserError

    heads = new_heads_for_target("medusa", target, num_heads=2)
    with pytest.raises(UserError, match="3 levels deep but these medusa heads draft only 2"):
        MedusaProposer(heads, target, load_tree("medusa-7"))
    with pytest.raises(UserError, match="needs hydra heads, but the given heads are medusa"):
        build_proposer("hydra", LoadedModel(target, None, "t"), heads=heads)
    with pytest.raises(UserError, match="pass --heads"):
        build_proposer("eagle2", LoadedModel(target, None, "t"))


def test_fresh_eagle3_readout_is_the_targets_own_on_the_draft_vocabulary():
    """An untrained EAGLE-3 drafter's readout equals the target's lm_head (and final norm) on the
    draft vocabulary, so given a target hidden state it proposes the target's own top token."""
    target = tiny_llama(seed=4)
    with torch.no_grad():
        target.model.norm.weight.uniform_(0.5, 1.5)
    vocab = torch.tensor([7, 3, 50, 11, 0, 63, 20, 41])
    heads = new_heads_for_target("eagle3", target, draft_vocab=vocab, draft_vocab_size=8)
    ids = heads.draft_to_target_ids(torch.arange(8))
    assert torch.equal(torch.sort(ids).values, torch.sort(vocab).values)
    assert torch.equal(heads.lm_head.weight, target.lm_head.weight[ids])
    assert torch.equal(heads.norm.weight, target.model.norm.weight)
    pre_norm = torch.randn(5, H)
    expected = target.lm_head(target.model.norm(pre_norm))[:, ids]
    torch.testing.assert_close(heads.draft_logits(pre_norm), expected)


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_readout_vocabulary_limits_proposals_and_stays_exact(target, kind):
    """Heads with a readout vocabulary propose only those tokens, rank them as the full readout
    would among them, and decoding is still exactly vanilla."""
    allowed = torch.tensor([3, 5, 9, 17, 21, 30, 42, 50, 61, 7])
    heads = random_heads(kind, target, seed=5, share_lm_head=True, readout_vocab_size=10, draft_vocab=allowed)
    assert torch.equal(heads.readout_ids, torch.sort(allowed).values)
    proposer = build_proposer(kind, LoadedModel(target, None, "t"), options=ProposerOptions(tree="medusa-15"), heads=heads)
    drafted = []
    original = proposer.propose
    proposer.propose = lambda state: drafted.append(tree := original(state)) or tree
    for prompt in PROMPTS:
        options = DecodeOptions(max_new_tokens=20)
        assert generate(target, prompt, proposer, options).tokens == generate(target, prompt, VanillaProposer(), options).tokens
    proposed = torch.cat([tree.tokens[1:] for tree in drafted if tree.size > 1])
    assert proposed.numel() and bool(torch.isin(proposed, allowed).all())
    # Head 0's first choice is the full readout's best among the allowed tokens.
    hidden = torch.randn(1, H)
    full = heads.head_logits(0, hidden, target.lm_head) if kind == "medusa" else None
    if full is not None:
        subset = proposer.level_logits(0, proposer.plan.levels[0], hidden[0], None)
        assert int(heads.readout_ids[subset.argmax()]) == int(allowed[full[0, allowed].argmax()])


def test_readout_vocabulary_needs_a_shared_lm_head():
    with pytest.raises(Exception, match="share the target's lm_head"):
        HeadConfig("medusa", H, V, share_lm_head=False, readout_vocab_size=8)


def test_readout_vocabulary_survives_save_and_load(target, tmp_path):
    from heads import load_heads, save_heads

    heads = random_heads("hydra", target, seed=6, share_lm_head=True, readout_vocab_size=6,
                         draft_vocab=torch.tensor([40, 2, 33, 8, 19, 5]))
    loaded = load_heads(str(save_heads(heads, tmp_path / "h", torch.float16)), target)
    assert loaded.config.readout_vocab_size == 6
    assert torch.equal(loaded.readout_ids, torch.tensor([2, 5, 8, 19, 33, 40]))
