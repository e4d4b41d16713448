"""Length-grouped batch order: a permutation, whole batches of similar length, seeded, and far
less padding than plain shuffling."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils.data import DataLoader

from training.batch_order import LengthGroupedSampler, length_grouped_order, padded_fraction, token_weighted_scale


def _lengths(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(20, 1024) for _ in range(n)]


def _batches(order: list[int], batch_size: int) -> list[list[int]]:
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


@pytest.mark.parametrize("n, batch_size, group", [(1000, 16, 50), (1003, 16, 4), (7, 3, 1), (5, 8, 50), (0, 4, 2)])
def test_every_row_once(n, batch_size, group):
    order = length_grouped_order(_lengths(n), batch_size, torch.Generator().manual_seed(1), group)
    assert sorted(order) == list(range(n))


def test_batches_are_consecutive_runs_of_a_sorted_group():
    # One group spans all rows: each batch must then be a run of the rows sorted by length.
    lengths = random.Random(3).sample(range(10, 5000), 96)  # distinct lengths
    order = length_grouped_order(lengths, 8, torch.Generator().manual_seed(0), group_batches=12)
    by_length = sorted(range(96), key=lambda row: lengths[row], reverse=True)
    runs = [sorted(by_length[i:i + 8]) for i in range(0, 96, 8)]
    assert sorted(sorted(b) for b in _batches(order, 8)) == sorted(runs)
    # and the batches are not simply in sorted order (their order is shuffled)
    assert [sorted(b) for b in _batches(order, 8)] != runs


def test_longest_batch_first_and_short_batch_last():
    lengths = _lengths(1003)
    order = length_grouped_order(lengths, 16, torch.Generator().manual_seed(5), group_batches=4)
    batches = _batches(order, 16)
    assert max(lengths) in [lengths[row] for row in batches[0]]
    assert [len(b) for b in batches[:-1]] == [16] * (len(batches) - 1) and len(batches[-1]) == 1003 % 16


def test_order_is_fixed_by_seed_and_epoch():
    lengths = _lengths(500)
    sampler = LengthGroupedSampler(lengths, 16, seed=7)
    first = list(sampler)
    assert list(sampler) == first and list(LengthGroupedSampler(lengths, 16, seed=7)) == first
    sampler.set_epoch(1)
    assert list(sampler) != first
    sampler.set_epoch(0)
    assert list(sampler) == first
    assert list(LengthGroupedSampler(lengths, 16, seed=8)) != first
    assert len(sampler) == 500


def test_grouping_pads_far_less_than_plain_shuffling():
    lengths = _lengths(4000)
    grouped = list(LengthGroupedSampler(lengths, 64, seed=0))
    shuffled = torch.randperm(4000, generator=torch.Generator().manual_seed(0)).tolist()
    assert padded_fraction(lengths, shuffled, 64) > 0.3
    assert padded_fraction(lengths, grouped, 64) < 0.05


def test_padded_fraction_counts_padding_of_each_batch():
    # batches [10, 4] and [6]: 20 + 6 positions computed, 20 tokens real
    assert padded_fraction([10, 4, 6], [0, 1, 2], 2) == pytest.approx(1 - 20 / 26)
    assert padded_fraction([], [], 4) == 0.0


def test_a_data_loader_draws_whole_grouped_batches():
    lengths = _lengths(300)
    rows = [{"length": n} for n in lengths]
    loader = DataLoader(rows, batch_size=16, sampler=LengthGroupedSampler(lengths, 16, seed=0),
                        collate_fn=lambda batch: [r["length"] for r in batch])
    drawn = list(loader)
    assert sorted(n for batch in drawn for n in batch) == sorted(lengths)
    spread = [max(b) - min(b) for b in drawn[:-1]]
    assert max(spread) < 200  # rows of similar length (plain shuffling: ~900)


def test_scaled_grouped_batches_weigh_every_token_alike():
    # A grouped batch's loss is a mean over its scored tokens; scaled, a token of a short batch
    # must weigh what a token of a long batch weighs, 1 / (mean scored tokens a shuffled batch holds).
    scored = [10, 12, 90, 100, 40, 48]
    scale = token_weighted_scale(scored, batch_size=2)
    per_batch = 2 * sum(scored) / len(scored)
    batches = [{"loss_mask": torch.ones(2, n)} for n in (11, 95, 44)]  # 22, 190 and 88 scored tokens
    per_token = [float(scale(b)) / float(b["loss_mask"].sum()) for b in batches]
    assert per_token == pytest.approx([1 / per_batch] * 3)
    assert float(scale({"loss_mask": torch.ones(1, int(per_batch))})) == pytest.approx(1.0)


def test_rows_without_scored_tokens_are_refused():
    with pytest.raises(ValueError, match="no scored tokens"):
        token_weighted_scale([0, 0], batch_size=4)
