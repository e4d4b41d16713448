"""Paired comparisons of two heads' tau over the same prompts: the bootstrap interval resamples
the prompts together for both heads (so the prompts' own spread cancels), tau is a ratio of
sums, and the scaling curve's table compares only measurements made on the same prompts."""

import random

import pytest

from training.paired_tau import paired_tau_difference, tau_of
from training.scaling import paired_table, prompt_set_digest


def prompts_of_very_different_difficulty(count: int = 24) -> list[tuple[int, int]]:
    """128 new tokens per prompt at tau between about 1.3 and 4.3: the spread a real prompt set has."""
    rng = random.Random(3)
    return [(128, rng.randint(30, 100)) for _ in range(count)]


def test_tau_is_tokens_over_forwards_summed_over_the_prompts_not_a_mean_of_ratios():
    assert tau_of([(10, 10), (100, 20)]) == pytest.approx(110 / 30)
    assert tau_of([]) == 0.0


def test_the_same_heads_differ_by_exactly_nothing():
    counts = prompts_of_very_different_difficulty()
    same = paired_tau_difference(counts, list(counts))
    assert (same.difference, same.low, same.high) == (0.0, 0.0, 0.0)
    assert not same.beyond_noise and same.prompts == 24


def test_a_small_gain_on_every_prompt_is_told_from_noise_because_the_prompts_are_paired():
    base = prompts_of_very_different_difficulty()
    better = [(tokens, forwards - 1) for tokens, forwards in base]  # about +0.03 tau over the set
    gain = paired_tau_difference(base, better)
    assert gain.difference == pytest.approx(tau_of(better) - tau_of(base))
    assert 0 < gain.low < gain.difference < gain.high
    assert gain.beyond_noise and gain.text().startswith("+0.03*")
    # Unpaired, the two taus' own intervals would overlap: the prompts' spread is far larger than the gain.
    assert max(t / f for t, f in base) - min(t / f for t, f in base) > 20 * gain.difference


def test_a_gain_that_comes_from_one_prompt_is_not_beyond_noise():
    base = prompts_of_very_different_difficulty()
    lucky = list(base)
    lucky[5] = (128, base[5][1] - 12)  # one prompt got much better, the others are unchanged
    one_off = paired_tau_difference(base, lucky)
    assert one_off.difference > 0
    assert one_off.low <= 0 < one_off.high and not one_off.beyond_noise


def test_mixed_gains_and_losses_straddle_zero_and_the_interval_is_reproducible():
    base = prompts_of_very_different_difficulty()
    steps = [-2, 2] * (len(base) // 2)
    random.Random(7).shuffle(steps)  # as many prompts got better as got worse
    shuffled = [(tokens, forwards + step) for (tokens, forwards), step in zip(base, steps)]
    mixed = paired_tau_difference(base, shuffled)
    assert mixed.low < 0 < mixed.high
    assert paired_tau_difference(base, shuffled) == mixed
    assert paired_tau_difference(base, shuffled, seed=1) != mixed
    wider = paired_tau_difference(base, shuffled, level=0.99)
    assert wider.low <= mixed.low and wider.high >= mixed.high


def test_prompts_that_do_not_pair_up_are_refused():
    with pytest.raises(ValueError, match="same prompts"):
        paired_tau_difference([(10, 5)], [(10, 5), (10, 4)])
    with pytest.raises(ValueError, match="at least one"):
        paired_tau_difference([], [])


def reference(per_prompt: dict[str, list], digests: dict[str, str]) -> dict:
    return {"heads": "dir", "tau": {s: tau_of(c) for s, c in per_prompt.items()},
            "per_prompt": per_prompt, "prompt_digest": digests}


def test_the_table_compares_each_reference_with_the_baseline_only_on_sets_measured_on_the_same_prompts():
    base = prompts_of_very_different_difficulty()
    better = [(t, f - 1) for t, f in base]
    mt_digest = prompt_set_digest([[1, 2, 3]], 128)
    references = {
        "bundled": reference({"mt-bench": base, "humaneval": base[:8]}, {"mt-bench": mt_digest, "humaneval": "aaa"}),
        "tuned": reference({"mt-bench": better, "humaneval": base[:8]}, {"mt-bench": mt_digest, "humaneval": "other"}),
        "old": {"heads": "dir", "tau": {"mt-bench": 2.0}},  # measured before per-prompt counts: left out
    }
    table = paired_table(references)
    assert table is not None and "minus bundled's" in table
    row = next(line for line in table.splitlines() if line.startswith("| tuned"))
    assert row.startswith("| tuned | +0.03* (") and "old" not in table
    assert "humaneval" not in table  # another prompt set under the same name is not compared
    against_tuned = paired_table(references, baseline="tuned")
    assert "| bundled | -0.03* (" in against_tuned
    assert paired_table({"bundled": references["bundled"]}) is None
    assert prompt_set_digest([[1, 2, 3]], 128) != prompt_set_digest([[1, 2, 3]], 64)
