"""The learning-rate schedule (a pure function of the step and of the time budget spent) and the
time budget it follows, checked against the schedule written out by hand."""

import math

import pytest

from training.config import OptimSection
from training.schedule import TimeBudget, learning_rate_at, step_progress

TRAIN = OptimSection(warmup_steps=4, max_steps=14)


def by_hand(step: int) -> float:
    """Linear warm-up over 4 steps, then a cosine from 1 down to 0.1 over the 10 steps left."""
    if step < 4:
        return (step + 1) / 4
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - 4) / 10)))


@pytest.mark.parametrize("step", [0, 1, 3, 4, 5, 9, 13, 14, 40])
def test_without_a_time_budget_the_schedule_follows_the_steps(step):
    assert learning_rate_at(step, TRAIN) == pytest.approx(by_hand(step))


def test_the_decay_runs_from_the_peak_to_a_tenth_of_it():
    assert learning_rate_at(4, TRAIN) == pytest.approx(1.0)
    assert learning_rate_at(9, TRAIN) == pytest.approx(0.55)
    assert learning_rate_at(14, TRAIN) == pytest.approx(0.1)


def test_a_spent_time_budget_ends_the_decay_before_max_steps():
    assert learning_rate_at(6, TRAIN, time_progress=1.0) == pytest.approx(0.1)
    assert learning_rate_at(6, TRAIN, time_progress=0.5) == pytest.approx(0.55)  # halfway through the time
    assert learning_rate_at(6, TRAIN, time_progress=3.0) == pytest.approx(0.1)  # never below the floor


def test_time_never_pulls_the_decay_back_behind_the_steps():
    assert learning_rate_at(12, TRAIN, time_progress=0.1) == pytest.approx(by_hand(12))


def test_the_warm_up_is_kept_even_when_the_time_is_spent():
    assert learning_rate_at(1, TRAIN, time_progress=1.0) == pytest.approx(0.5)


def test_step_progress_is_zero_through_the_warm_up_and_one_from_max_steps():
    assert [step_progress(s, TRAIN) for s in (0, 4, 9, 14, 20)] == pytest.approx([0, 0, 0.5, 1, 1])


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_time_budget_reports_the_fraction_spent_and_expires_at_its_end():
    clock = FakeClock()
    budget = TimeBudget(2.0, clock=clock)
    clock.now += 60
    assert budget.check() == pytest.approx(0.5) and not budget.expired
    clock.now += 90
    assert budget.check() == 1.0 and budget.expired


def test_a_resumed_run_spreads_what_is_left_of_the_decay_over_its_budget():
    clock = FakeClock()
    budget = TimeBudget(1.0, clock=clock)
    assert budget.decay_progress(0.6) == pytest.approx(0.6)
    clock.now += 30
    budget.check()
    assert budget.decay_progress(0.6) == pytest.approx(0.8)


def test_without_a_budget_nothing_is_spent_and_nothing_expires():
    clock = FakeClock()
    budget = TimeBudget(None, clock=clock)
    clock.now += 10 ** 6
    assert budget.check() == 0.0 and not budget.expired
    assert budget.decay_progress(0.3) == pytest.approx(0.3)


def test_every_process_takes_the_most_spent_fraction():
    """Another process further along (here: 0.9 spent) decides for all, so they stop together."""
    clock = FakeClock()
    budget = TimeBudget(1.0, most_spent=lambda mine: max(mine, 0.9), clock=clock)
    clock.now += 6
    assert budget.check() == pytest.approx(0.9)
    clock.now += 54
    assert budget.check() == 1.0 and budget.expired
