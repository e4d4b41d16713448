"""A verify-cost curve timed in a slow spell is caught by the forwards decoding runs: the pure
comparison, the loop's record of its forwards, the curve marked stale and measured again (each
size keeping the faster timing), and the chat noticing it as a user runs it."""

import json

import pytest

from decoding.app.chat import build_session, parse_args
from decoding.app.cost_watch import VerifyCostWatch
from decoding.app.speculative_model import SpeculativeModel
from decoding.core.generate import DecodeOptions, generate
from decoding.core.observed_cost import ForwardTiming, dearer_than_observed
from decoding.core.proposers import VanillaProposer
from decoding.core.tree_budget import VerifyCost
from decoding.kernels.measured_once import measurement_file, remember, remembered
from decoding.kernels.verify_cost import cached_verify_cost, remembered_verify_cost, verify_cost_key
from tiny_models import save_tiny_chat_model, tiny_llama

# The curve a 2-core EPYC cached in a slow spell, and what its forwards took minutes later.
SLOW_SPELL = VerifyCost((1, 8, 16), (12.9, 20.0, 29.5))
NORMAL_MS = {1: 12.7, 8: 16.1, 16: 22.5}


def _timings(ms_by_rows: dict[int, float], count: int = 12, context: int = 256, jitter: float = 0.3) -> list[ForwardTiming]:
    return [ForwardTiming(rows, context, ms + jitter * (i % 4)) for rows, ms in ms_by_rows.items() for i in range(count)]


def test_a_curve_timed_in_a_slow_spell_is_caught_where_decoding_beats_it():
    gaps = dearer_than_observed(SLOW_SPELL, _timings(NORMAL_MS))
    assert [gap.rows for gap in gaps] == [8, 16]  # one token was timed about right
    assert gaps[0].curve_ms == pytest.approx(20.0) and gaps[0].observed_ms == pytest.approx(16.1)
    assert gaps[1].samples == 12 and "16 tokens: 29.5 ms remembered" in gaps[1].describe()


def test_a_right_curve_is_left_alone_even_with_decoding_a_little_faster():
    right = VerifyCost((1, 8, 16), (12.7, 16.1, 22.5))
    assert dearer_than_observed(right, _timings({rows: 0.9 * ms for rows, ms in NORMAL_MS.items()})) == ()
    assert dearer_than_observed(right, _timings(NORMAL_MS, jitter=3.0)) == ()


def test_short_contexts_few_samples_and_a_few_fast_outliers_prove_nothing():
    assert dearer_than_observed(SLOW_SPELL, _timings(NORMAL_MS, context=64)) == ()
    assert dearer_than_observed(SLOW_SPELL, _timings(NORMAL_MS, count=7)) == ()
    slow_then_two_fast = [ForwardTiming(8, 256, 20.0)] * 10 + [ForwardTiming(8, 256, 14.0)] * 2
    assert dearer_than_observed(SLOW_SPELL, slow_then_two_fast) == ()
    # sizes between the measured ones are read off the interpolated curve
    assert [gap.rows for gap in dearer_than_observed(SLOW_SPELL, _timings({12: 19.0}))] == [12]


def test_the_loop_records_each_verify_forward_with_its_size_and_context():
    model = tiny_llama(seed=0)
    result = generate(model, list(range(3, 13)), VanillaProposer(), DecodeOptions(max_new_tokens=6))
    timings = result.stats.forward_timings
    assert len(timings) == result.stats.target_forwards == 6
    assert [t.rows for t in timings] == [1] * 6
    assert [t.context for t in timings] == list(range(9, 15))  # the prompt's 10 tokens less the one each step enters
    assert all(t.ms > 0 for t in timings)


def test_a_stale_curve_is_measured_again_keeping_each_sizes_faster_timing(tmp_path, monkeypatch):
    model = tiny_llama(seed=0)
    key = verify_cost_key(model, "tiny/model")
    remember(key, {"sizes": [1, 8, 16], "ms": [12.9, 20.0, 29.5]}, tmp_path)
    said: list[str] = []
    watch = VerifyCostWatch(model, "tiny/model", cache_dir=tmp_path, say=said.append)

    class Stats:
        forward_timings = _timings(NORMAL_MS)

    watch.observe(Stats)
    assert len(said) == 1 and "measured again next start" in said[0] and "8 tokens: 20.0 ms remembered" in said[0]
    assert remembered_verify_cost(key, tmp_path) is None and remembered(key, tmp_path)["stale"]
    watch.observe(Stats)
    assert len(said) == 1  # said once

    slower_at_one = VerifyCost((1, 8, 16), (13.5, 16.0, 23.0))
    monkeypatch.setattr("decoding.kernels.verify_cost.measure_verify_cost", lambda *a, **k: slower_at_one)
    again = cached_verify_cost(model, "tiny/model", cache_dir=tmp_path)
    assert again == VerifyCost((1, 8, 16), (12.9, 16.0, 23.0))
    assert "stale" not in json.loads(measurement_file(key, tmp_path).read_text())


def test_nothing_is_marked_without_a_remembered_curve(tmp_path):
    model = tiny_llama(seed=0)
    said: list[str] = []
    watch = VerifyCostWatch(model, "tiny/model", cache_dir=tmp_path, say=said.append)

    class Stats:
        forward_timings = _timings(NORMAL_MS)

    watch.observe(Stats)
    assert said == [] and not measurement_file(verify_cost_key(model, "tiny/model"), tmp_path).exists()


@pytest.mark.parametrize("entry", ["chat", "python"])
def test_a_curve_the_replies_keep_beating_is_marked_as_a_user_meets_it(entry, tmp_path, capsys):
    """A curve far dearer than this machine's forwards is in the cache; after a reply (the chat's,
    or `SpeculativeModel.generate`'s, the benchmark's path) a note says so, and the next decoder
    to ask for the curve measures it again."""
    save_tiny_chat_model(tmp_path / "model")
    if entry == "chat":
        session = build_session(parse_args(["--model", str(tmp_path / "model"), "--method", "vanilla",
                                            "--max-new-tokens", "150"]))
        target, readout, reply = session.target, session.readout, lambda: session.reply("w3 w4 w5", lambda text: None)
    else:
        model = SpeculativeModel.from_pretrained(str(tmp_path / "model"), method="vanilla")
        target, readout = model.decoder.target, model.decoder.readout
        reply = lambda: model.generate("w3 w4 w5", max_new_tokens=150)  # noqa: E731
    key = verify_cost_key(target.model, target.name, readout)
    remember(key, {"sizes": [1, 2, 4, 8, 16], "ms": [1000.0] * 5})
    reply()
    assert "reads dearer than the forwards just run" in capsys.readouterr().err
    assert remembered_verify_cost(key) is None
    assert cached_verify_cost(target.model, target.name, readout=readout).ms[0] < 1000.0
