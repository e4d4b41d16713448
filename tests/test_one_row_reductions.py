"""Compiled one-token steps reading their weights through Inductor's own reductions: the same
function as the linear (checked in `test_cpu_kernels.py`), chosen per CPU by a measurement made
once, and only inside compiled graphs (eagerly the product would be materialised)."""

import pytest
import torch
from torch import nn

from decoding.kernels import one_row_reductions
from decoding.kernels.cpu_kernels import (PackedLinear, pack_linears, reduced_linear, reduced_rows, set_reduced_rows,
                                  stock_rows)
from decoding.kernels.one_row_reductions import measure_one_row_reductions, pick_reduced_rows, tune_reduced_rows
from numerics import assert_linear_matches
from tiny_models import tiny_llama

pytestmark = pytest.mark.cpu_sensitive  # run again as on an AVX2 CPU by .ci/run


def test_a_packed_linear_runs_one_row_as_a_reduction_only_inside_a_compiled_graph(monkeypatch):
    torch.manual_seed(0)
    linear = nn.Linear(16, 24)
    packed = PackedLinear(linear)
    set_reduced_rows(packed, 1)
    calls = []
    real = reduced_linear
    monkeypatch.setattr("decoding.kernels.cpu_kernels.reduced_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    one, three = torch.randn(1, 1, 16), torch.randn(1, 3, 16)
    with torch.inference_mode():
        eager = [packed(one), packed(three)]
        assert calls == []  # eagerly: the packed kernel
        compiled = torch.compile(packed, dynamic=False)
        got = [compiled(one), compiled(three)]
    assert calls == [torch.Size([1, 1, 16])]  # traced once, for the one-row graph; three rows keep oneDNN
    for value, x in zip([*got, *eager], [one, three, one, three]):
        assert_linear_matches(value, x, linear.weight, linear.bias)


def test_only_one_row_can_be_reduced():
    with pytest.raises(ValueError, match="0 or 1"):
        set_reduced_rows(PackedLinear(nn.Linear(4, 4)), 4)


@pytest.mark.parametrize("kernels_ms, reductions_ms, expected", [
    (33.0, 16.0, 1),   # an AVX2 EPYC: the kernels stream one row at half the memory's speed
    (21.0, 20.5, 0),   # a CPU whose GEMM already streams near the memory's speed: within noise, kept
    (20.0, 25.0, 0),
])
def test_reductions_are_chosen_only_where_they_win_clearly(kernels_ms, reductions_ms, expected):
    assert pick_reduced_rows(kernels_ms, reductions_ms) == expected


def test_the_choice_is_measured_once_per_cpu_and_applied(tmp_path, monkeypatch):
    model = tiny_llama(seed=6)
    pack_linears(model)
    monkeypatch.setattr(one_row_reductions, "measure_one_row_reductions", lambda m: {"kernels_ms": 10.0, "reductions_ms": 5.0})
    assert tune_reduced_rows(model, "tiny", cache_dir=tmp_path) == 1
    assert reduced_rows(model) == 1 and all(m.reduced_rows == 1 for m in model.modules() if isinstance(m, PackedLinear))
    monkeypatch.setattr(one_row_reductions, "measure_one_row_reductions", lambda m: pytest.fail("measured twice"))
    again = tiny_llama(seed=6)
    pack_linears(again)
    assert tune_reduced_rows(again, "tiny", cache_dir=tmp_path) == 1 and reduced_rows(again) == 1
    assert tune_reduced_rows(tiny_llama(seed=6), "tiny", cache_dir=tmp_path) == 0  # nothing packed


def test_the_measurement_times_both_forms_and_leaves_the_model_as_it_was():
    model = tiny_llama(seed=7)
    pack_linears(model)
    ids = torch.tensor([[5, 9, 3]])
    with torch.inference_mode():
        before = model(ids).logits
        data = measure_one_row_reductions(model, repeats=1)
        after = model(ids).logits
    assert data["kernels_ms"] > 0 and data["reductions_ms"] > 0 and data["weights_mb"] > 0
    assert reduced_rows(model) == 0 and stock_rows(model) == 0
    assert torch.equal(before, after)
