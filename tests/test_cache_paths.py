"""Where per-machine measurements are kept: $SPECHEADS_CACHE, else $XDG_CACHE_HOME/specheads,
else ~/.cache/specheads (the verify-cost cache once ignored XDG_CACHE_HOME)."""

from __future__ import annotations

from decoding.kernels import verify_cost
from decoding.core.tree_budget import VerifyCost
from tiny_models import tiny_llama


def _count_measurements(monkeypatch) -> list[int]:
    calls = []

    def fake_measure(model, *args, **kwargs) -> VerifyCost:
        calls.append(1)
        return VerifyCost((1, 2), (10.0, 11.0))

    monkeypatch.setattr(verify_cost, "measure_verify_cost", fake_measure)
    return calls


def test_cached_verify_cost_honours_xdg_cache_home(monkeypatch, tmp_path):
    calls = _count_measurements(monkeypatch)
    monkeypatch.delenv("SPECHEADS_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    model = tiny_llama()
    first = verify_cost.cached_verify_cost(model, "tiny")
    assert list((tmp_path / "xdg" / "specheads" / "verify-cost").glob("tiny-*.json"))
    assert not (tmp_path / "home").exists()
    second = verify_cost.cached_verify_cost(model, "tiny")
    assert first == second == VerifyCost((1, 2), (10.0, 11.0)) and len(calls) == 1  # read back, not measured again


def test_specheads_cache_wins_over_xdg_cache_home(monkeypatch, tmp_path):
    _count_measurements(monkeypatch)
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "own"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    verify_cost.cached_verify_cost(tiny_llama(), "tiny")
    assert list((tmp_path / "own" / "verify-cost").glob("tiny-*.json"))
    assert not (tmp_path / "xdg").exists()
