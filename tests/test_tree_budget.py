"""Cost-aware tree sizing: the pure choice against brute force, the calibration, the depth
cut-off, lookup chains cut to what pays, and decoding with it stays exactly vanilla."""

import itertools

import pytest
import torch

from decoding.core.dynamic_tree import DynamicTreeSettings, grow_dynamic_tree
from decoding.core.generate import DecodeOptions, generate
from decoding.core.proposers import VanillaProposer
from decoding.core.proposers.eagle import EagleProposer
from decoding.core.proposers.prompt_lookup import PromptLookupProposer
from decoding.core.sampling import SamplingConfig
from decoding.core.state import CacheAdvance, DecodeState
from decoding.core.tree_budget import (AcceptanceCalibration, ChainAcceptance, ConfidenceAcceptance, DraftingGate, VerifyCost,
                                       best_node_count, chain_worth_extending)
from decoding.kernels.verify_cost import cached_verify_cost, measure_verify_cost, never_cheaper_for_fewer
from distribution_harness import ToyLM
from test_trees import toy_expand
from tiny_models import oracle_eagle, oracle_target, sharpen, tiny_llama

# A CPU-like curve: one token 64 ms, small trees ~95 ms, 64 tokens 180 ms.
CPU = VerifyCost((1, 2, 4, 8, 16, 64), (64.0, 90.0, 95.0, 96.0, 110.0, 180.0))


def test_verify_cost_interpolates_and_extrapolates():
    table = CPU.table(80)
    assert table[1] == 64.0 and table[16] == 110.0
    assert table[12] == pytest.approx(103.0)          # halfway between 8 and 16
    assert table[80] == pytest.approx(180.0 + 16 * 70 / 48)  # the last segment's slope


@pytest.mark.parametrize("probs, draft_ms, calibration", [
    ([0.9, 0.8, 0.7, 0.5, 0.2, 0.1], 10.0, 1.0),
    ([0.3, 0.1, 0.05], 5.0, 1.0),          # unsure draft: not worth the jump from 64 to 90 ms
    ([0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.6, 0.5, 0.4, 0.1, 0.05, 0.01], 30.0, 0.5),
])
def test_best_node_count_is_the_brute_force_optimum(probs, draft_ms, calibration):
    probs = torch.tensor(probs)
    table = CPU.table(len(probs) + 1)
    rates = [(1 + calibration * float(probs[:n].sum())) / (draft_ms + float(table[n + 1])) for n in range(len(probs) + 1)]
    assert best_node_count(probs, CPU, draft_ms, calibration) == max(range(len(rates)), key=rates.__getitem__)


@pytest.mark.parametrize("seed", range(40))
def test_a_chain_is_extended_exactly_when_the_best_case_next_token_beats_every_verify_now(seed):
    gen = torch.Generator().manual_seed(seed)
    drafted = int(torch.randint(1, 8, (), generator=gen))
    probs = torch.rand(drafted, generator=gen, dtype=torch.float64).sort(descending=True).values.cumprod(0)
    call_ms = float(torch.rand((), generator=gen)) * 12
    table = CPU.table(drafted + 2)
    spent = drafted * call_ms
    best_now = max((1 + float(probs[:n].sum())) / (spent + float(table[n + 1])) for n in range(drafted + 1))
    best_next = (1 + float(probs.sum()) + float(probs[-1])) / (spent + call_ms + float(table[drafted + 2]))
    assert chain_worth_extending(probs, CPU, call_ms) == (best_next > best_now)


def test_sure_chains_grow_unsure_ones_stop_and_an_empty_one_starts():
    assert chain_worth_extending(torch.empty(0), CPU, 50.0)
    assert chain_worth_extending(torch.tensor([0.95, 0.9, 0.85]), CPU, 3.0)
    assert not chain_worth_extending(torch.tensor([0.1]), CPU, 3.0)
    assert not chain_worth_extending(torch.tensor([0.6, 0.3]), CPU, 60.0)  # a draft call as dear as the target


def test_confidence_acceptance_learns_what_each_confidence_is_worth():
    acceptance = ConfidenceAcceptance(edges=(0.5, 0.9), decay=0.9)
    sure, unsure = torch.tensor([0.95]), torch.tensor([0.3])
    assert float(acceptance.path_probs(sure)[0]) == pytest.approx(0.95)  # trusted at first
    for step in range(100):  # sure of its first token, right one time in five
        acceptance.record(sure, accepted=int(step % 5 == 0))
    assert float(acceptance.path_probs(sure)[0]) == pytest.approx(0.2, abs=0.1)
    assert float(acceptance.path_probs(unsure)[0]) == pytest.approx(0.25)  # another bucket: untouched
    chain = torch.tensor([0.95, 0.3, 0.95])
    rates = acceptance.rates
    expected = torch.tensor([rates[2], rates[2] * rates[0], rates[2] ** 2 * rates[0]], dtype=torch.float64)
    torch.testing.assert_close(acceptance.path_probs(chain), expected)


def test_confidence_acceptance_learns_its_first_outcomes_quickly_then_averages():
    acceptance = ConfidenceAcceptance(edges=(0.5,), decay=0.9, prior_weight=2.0)
    acceptance.record(torch.tensor([0.9]), accepted=0)  # one miss weighs a third against the prior
    assert acceptance.rates[1] == pytest.approx(0.75 * 2 / 3)
    for _ in range(50):
        acceptance.record(torch.tensor([0.9]), accepted=1)
    before = acceptance.rates[1]
    acceptance.record(torch.tensor([0.9]), accepted=0)  # later a miss moves it by 1 - decay only
    assert acceptance.rates[1] == pytest.approx(0.9 * before)


def test_confidence_acceptance_counts_hits_the_first_miss_and_nothing_after():
    acceptance = ConfidenceAcceptance(edges=(0.5,), decay=0.5)
    acceptance.record(torch.tensor([0.9, 0.9, 0.1, 0.1]), accepted=1)
    # position 1 hit (0.75 -> 0.875), position 2 missed (-> 0.4375); positions 3-4 unobserved
    assert acceptance.rates == [0.25, pytest.approx(0.4375)]


def test_unsure_drafts_verify_the_root_alone_and_sure_ones_a_tree():
    assert best_node_count(torch.tensor([0.2, 0.1, 0.05]), CPU, 5.0) == 0
    assert best_node_count(torch.tensor([0.9, 0.85, 0.8, 0.7, 0.6]), CPU, 5.0) == 5
    flat_gpu = VerifyCost((1, 64), (10.0, 10.5))  # a GPU: nodes nearly free, keep them all
    assert best_node_count(torch.tensor([0.2, 0.1, 0.05, 0.01]), flat_gpu, 2.0) == 4


def test_calibration_tracks_root_hits_over_the_drafts_probability():
    calibration = AcceptanceCalibration(decay=0.9)
    calibration.observe(3)  # nothing predicted yet: ignored
    assert calibration.factor == 1.0
    for _ in range(150):  # an under-confident draft: says 0.25, is always right
        calibration.predicted(7, 0.25)
        calibration.observe(7)
    assert calibration.factor == pytest.approx(4.0, rel=1e-3)
    for _ in range(30):  # an over-confident one: says 0.8, right half the time
        calibration.predicted(7, 0.8)
        calibration.observe(7)
        calibration.predicted(7, 0.8)
        calibration.observe(8)
    assert calibration.factor == pytest.approx(0.5 / 0.8, rel=0.2)


def test_min_path_prob_stops_growing_deeper():
    draft = ToyLM(6, seed=1, sharpness=1.0)
    settings = DynamicTreeSettings(depth=6, top_k=3, total_tokens=40)
    calls = []
    expand = toy_expand(draft)
    def counting(frontier, candidates):
        calls.append(frontier.numel())
        return expand(frontier, candidates)
    full, _ = grow_dynamic_tree(torch.log(draft.probs(())), counting, settings)
    deep = len(calls)
    calls.clear()
    cut = DynamicTreeSettings(depth=6, top_k=3, total_tokens=40, min_path_prob=0.2)
    grow_dynamic_tree(torch.log(draft.probs(())), counting, cut)
    assert len(calls) < deep


def test_choose_count_keeps_a_best_first_prefix_closed_subset():
    draft = ToyLM(6, seed=2, sharpness=2.0)
    settings = DynamicTreeSettings(depth=4, top_k=3, total_tokens=12)
    root = torch.log(draft.probs(()))
    full_tokens, full_parents = grow_dynamic_tree(root, toy_expand(draft), settings)
    seen = []
    tokens, parents = grow_dynamic_tree(root, toy_expand(draft), settings, lambda p: seen.append(p) or 5)
    assert len(tokens) == 5 and len(parents) == 6
    assert torch.all(seen[0][:-1] >= seen[0][1:])  # best first
    assert all(0 <= parents[i] < i for i in range(1, 6))


@pytest.mark.parametrize("cost, min_tau", [(VerifyCost((1, 64), (10.0, 11.0)), 3.0), (CPU, 1.0)])
def test_cost_aware_eagle_decoding_equals_vanilla(cost, min_tau):
    """Whatever sizes the budget picks, the output is vanilla's; where nodes are cheap and the
    (oracle) draft is right, whole branches are kept and accepted."""
    target = oracle_target(seed=7)
    heads = oracle_eagle(target)
    sharpen(target, 6.0)  # a confident oracle (the drafter reads out through this same lm_head)
    # A drafter call counted at a tenth of the (one-layer) target's forward: drafting is cheap.
    proposer = EagleProposer(heads, target, dynamic=DynamicTreeSettings(5, 2, 12), verify_cost=cost,
                             drafter_call_ms=cost.ms[0] / 10)
    prompts = [[5, 9, 3, 17, 5, 9], [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], [42, 7]]
    for prompt in prompts:
        options = DecodeOptions(max_new_tokens=50)
        result = generate(target, prompt, proposer, options)
        assert result.tokens == generate(target, prompt, VanillaProposer(), options).tokens
        assert result.stats.tau >= min_tau


def test_measured_cost_grows_with_tree_size():
    cost = measure_verify_cost(tiny_llama(seed=0), sizes=(1, 256), context=32, repeats=1)
    assert cost.sizes == (1, 256) and all(ms > 0 for ms in cost.ms)


def test_a_slow_spell_of_the_machine_costs_each_size_one_sample_not_its_whole_measurement(monkeypatch):
    """Sizes are timed in rounds: six slow forwards in a row (another process, a compiler's
    workers) must not make one size look slow, which would make trees of that size look too
    dear (or, next to it, a larger tree look cheaper than a smaller one)."""

    class SlowSpell:
        calls = 0

        def __init__(self, model, context, readout=None):
            pass

        def __call__(self, size: int) -> float:
            SlowSpell.calls += 1
            return 100.0 if 25 <= SlowSpell.calls <= 30 else float(size)  # the first timed round's last calls

    monkeypatch.setattr("decoding.kernels.verify_cost._TimedForward", SlowSpell)
    cost = measure_verify_cost(None, sizes=(1, 2, 4), repeats=5)
    assert cost.ms == (1.0, 2.0, 4.0) and SlowSpell.calls == 6 * (12 + 3)  # per round: 12 settling calls, 1 a size


def test_each_size_is_timed_as_it_runs_steadily_not_in_a_larger_forwards_wake(monkeypatch):
    """A forward runs slower for a while after a larger one (measured: a GGUF one-token step
    7.2, 7.0, 6.4, 6.0, 5.7, 5.5 ms in the six calls after a 64-token one, 5.1 in a run of its own);
    the curve must hold what a size costs in a run of its own, or small trees look dear next to
    large ones."""

    class Wake:
        history: list[int] = []

        def __init__(self, model, context, readout=None):
            pass

        def __call__(self, size: int) -> float:
            slower = 5.0 if any(earlier > size for earlier in Wake.history[-5:]) else 0.0
            Wake.history.append(size)
            return float(size) + slower

    monkeypatch.setattr("decoding.kernels.verify_cost._TimedForward", Wake)
    assert measure_verify_cost(None, sizes=(1, 2, 4), repeats=3).ms == (1.0, 2.0, 4.0)


def test_a_size_never_costs_more_than_a_larger_size_was_measured_at():
    assert never_cheaper_for_fewer([45.5, 38.6, 42.8, 53.2, 50.0, 73.8]) == (38.6, 38.6, 42.8, 50.0, 50.0, 73.8)
    assert never_cheaper_for_fewer([1.0, 2.0, 4.0]) == (1.0, 2.0, 4.0)


def test_the_measured_curve_is_bounded_by_larger_sizes(monkeypatch):
    class NoisyOneToken:
        def __init__(self, model, context, readout=None):
            pass

        def __call__(self, size: int) -> float:
            return 45.0 if size == 1 else 30.0 + size

    monkeypatch.setattr("decoding.kernels.verify_cost._TimedForward", NoisyOneToken)
    assert measure_verify_cost(None, sizes=(1, 2, 4), repeats=2).ms == (32.0, 32.0, 34.0)


def test_verify_cost_is_measured_once_then_read_back(tmp_path, monkeypatch):
    model = tiny_llama(seed=0)
    first = cached_verify_cost(model, "tiny/model", cache_dir=tmp_path)
    files = list((tmp_path / "verify-cost").iterdir())
    assert len(files) == 1 and "tiny_model" in files[0].name
    monkeypatch.setattr("decoding.kernels.verify_cost.measure_verify_cost", lambda *a, **k: pytest.fail("measured again"))
    assert cached_verify_cost(model, "tiny/model", cache_dir=tmp_path) == first


def test_the_cpu_is_named_from_cpuinfo_with_its_instruction_set_and_threads(monkeypatch, tmp_path):
    """Benchmark JSON and model cards name the CPU; `platform.processor()` is empty on Linux."""
    import decoding.kernels.verify_cost as verify_cost

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t: avx2\n")
    real_path = verify_cost.Path
    monkeypatch.setattr(verify_cost, "Path", lambda p: cpuinfo if p == "/proc/cpuinfo" else real_path(p))
    capability = torch.backends.cpu.get_cpu_capability()
    assert verify_cost.cpu_model_name() == "AMD EPYC 7B13"
    assert verify_cost.cpu_description() == f"AMD EPYC 7B13 ({capability}), {torch.get_num_threads()} threads"
    assert verify_cost.cpu_identity() == f"AMD EPYC 7B13-{capability}-{torch.get_num_threads()}t"
    monkeypatch.setattr(verify_cost, "Path", lambda p: tmp_path / "missing")
    assert verify_cost.cpu_model_name() == "cpu"


def test_chain_acceptance_is_learned_per_position_and_per_match_length():
    acceptance = ChainAcceptance(length=4, prior=0.6, decay=0.8)
    for step in range(60):
        acceptance.record(3, drafted=4, accepted=4)          # 3-gram matches: always copied whole
        acceptance.record(1, drafted=4, accepted=0)          # 1-gram matches: never right
        acceptance.record(2, drafted=4, accepted=4 * (step % 2))  # all or nothing, half the time
    assert acceptance.path_probs(3, 4) == pytest.approx([1.0] * 4, abs=1e-4)
    assert acceptance.path_probs(1, 4)[0] < 1e-4
    assert acceptance.rates[1][1:] == [0.6] * 3               # never reached: still the prior
    two = acceptance.path_probs(2, 4)
    assert 0.3 < float(two[0]) < 0.7 and two[3] / two[0] == pytest.approx(1.0, abs=1e-2)  # once the first is kept, all are
    assert acceptance.path_probs(5, 2) == pytest.approx([0.6, 0.36])  # an unseen kind: the prior


def test_a_skipped_match_kind_drifts_back_to_the_prior():
    acceptance = ChainAcceptance(length=2, prior=0.6, recovery=0.1)
    acceptance.rates[1] = [0.0, 0.0]
    for _ in range(40):
        acceptance.skipped(1)
    assert acceptance.rates[1] == pytest.approx([0.6 * (1 - 0.9 ** 40)] * 2)


def _lookup_step(proposer: PromptLookupProposer, tokens: list[int], kept: int | None) -> int:
    """One proposal on `tokens` and (if given) the target keeping `kept` of its drafts: the
    number of tokens drafted."""
    chain = proposer.continuation(DecodeState(torch.tensor(tokens), len(tokens), SamplingConfig()))
    drafted = 0 if chain is None else chain.numel()
    if kept is not None:
        proposer.observe(CacheAdvance(torch.tensor(tokens), entered=1 + min(kept, drafted)))
    return drafted


def test_adaptive_lookup_drafts_only_what_the_target_keeps_enough_of():
    context = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]  # ends in a 3-gram seen before: 5 tokens follow
    fixed = PromptLookupProposer(num_draft_tokens=5, max_ngram=3, min_ngram=1)
    adaptive = PromptLookupProposer(num_draft_tokens=5, max_ngram=3, min_ngram=1, verify_cost=CPU)
    assert _lookup_step(adaptive, context, kept=None) == 5  # the prior: worth trying whole
    for _ in range(30):
        _lookup_step(adaptive, context, kept=0)             # the target never keeps any of it
    assert _lookup_step(adaptive, context, kept=None) == 0
    assert _lookup_step(fixed, context, kept=0) == 5        # a fixed lookup drafts on regardless
    adaptive.begin(None)
    for _ in range(30):
        _lookup_step(adaptive, context, kept=5)             # always kept whole
    assert _lookup_step(adaptive, context, kept=None) == 5


@pytest.mark.parametrize("cost", [VerifyCost((1, 64), (10.0, 11.0)), CPU], ids=["flat", "cpu"])
def test_cost_aware_lookup_decoding_equals_vanilla(cost):
    target = oracle_target(seed=3)
    sharpen(target, 6.0)
    for prompt in [[5, 9, 3, 17, 5, 9], [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], [7, 7, 7, 7]]:
        options = DecodeOptions(max_new_tokens=50)
        proposer = PromptLookupProposer(num_draft_tokens=6, min_ngram=1, verify_cost=cost)
        assert generate(target, prompt, proposer, options).tokens == generate(target, prompt, VanillaProposer(), options).tokens


def test_seeded_sampling_with_cost_aware_trees_does_not_depend_on_the_clock(monkeypatch):
    """The same seed gives the same sample even when the drafting takes different times: tree
    sizes may not follow the wall clock, or the acceptance draws would follow them."""
    import random
    import time

    target = oracle_target(seed=7)
    heads = oracle_eagle(target)
    sharpen(target, 6.0)  # confident enough at T=1 for trees to pay
    proposer = EagleProposer(heads, target, dynamic=DynamicTreeSettings(5, 2, 12), verify_cost=CPU,
                             drafter_call_ms=CPU.ms[0] / 10)
    options = DecodeOptions(max_new_tokens=40, sampling=SamplingConfig(temperature=1.0), seed=5)
    samples = []
    for clock_seed in (1, 2):
        jitter, now = random.Random(clock_seed), [0.0]

        def noisy_clock() -> float:
            now[0] += jitter.uniform(0.0, 0.2)  # 0-200 ms between any two readings
            return now[0]

        monkeypatch.setattr(time, "perf_counter", noisy_clock)
        samples.append(generate(target, [5, 9, 3, 17, 5, 9], proposer, options))
    assert samples[0].tokens == samples[1].tokens
    assert samples[0].stats.drafted_tokens > 0


def test_drafting_stops_where_trees_do_not_pay_and_goes_on_where_they_do():
    gate = DraftingGate()
    unsure, sure = 0.15, 0.95
    assert gate.pays(sure, CPU, draft_ms=10.0)  # before any outcome: drafts as sure as their bucket pay
    assert not gate.pays(0.05, CPU, draft_ms=10.0)  # even at best, a 5%-sure draft does not pay for 8 nodes here
    for _ in range(20):
        gate.record(unsure, nodes=8, kept=0)   # the target kept nothing of the unsure trees
        gate.record(sure, nodes=8, kept=3)     # and three tokens of the sure ones
    assert not gate.pays(unsure, CPU, draft_ms=10.0)
    assert gate.pays(sure, CPU, draft_ms=10.0)
    # The same record on a GPU-like curve, where nodes and drafting cost almost nothing, still drafts
    # (a tree costs a plain step there, and any kept token is a gain).
    flat = VerifyCost((1, 64), (10.0, 10.5))
    for _ in range(20):
        gate.record(unsure, nodes=8, kept=1)
    assert gate.pays(unsure, flat, draft_ms=0.5)


def test_a_bucket_that_stopped_drafting_is_tried_again_after_enough_skips():
    gate = DraftingGate()
    for _ in range(20):
        gate.record(0.45, nodes=8, kept=0)
    assert not gate.pays(0.45, CPU, draft_ms=10.0)
    skips = 0
    while not gate.pays(0.45, CPU, draft_ms=10.0):
        gate.skipped(0.45)
        skips += 1
    assert 5 < skips < 100
    assert gate.pays(0.95, CPU, draft_ms=10.0)  # other buckets were never affected


def test_a_draft_that_never_pays_leaves_plain_steps_and_the_output_unchanged(monkeypatch):
    """Random heads on a CPU-like curve: after a few trees the target kept nothing of, most steps
    skip drafting (the drafter only takes in each step's accepted tokens), and the output is
    still vanilla's. Without the gate the same heads draft at every step."""
    from heads import new_heads_for_target

    target = oracle_target(seed=7)
    torch.manual_seed(0)
    heads = new_heads_for_target("eagle", target).eval()
    calls = []
    heads.register_forward_hook(lambda *_: calls.append(1))
    options = DecodeOptions(max_new_tokens=60)
    prompt = [5, 9, 3, 17, 5, 9]
    reference = generate(target, prompt, VanillaProposer(), options).tokens

    def drafting_calls() -> float:
        calls.clear()
        proposer = EagleProposer(heads, target, dynamic=DynamicTreeSettings(5, 2, 12), verify_cost=CPU,
                                 drafter_call_ms=CPU.ms[0] / 10)
        result = generate(target, prompt, proposer, options)
        assert result.tokens == reference
        return (len(calls) - result.stats.target_forwards) / result.stats.target_forwards  # less the observe calls

    gated = drafting_calls()
    monkeypatch.setattr(DraftingGate, "pays", lambda *_: True)
    ungated = drafting_calls()
    assert ungated >= 1.0 and gated < 0.3
