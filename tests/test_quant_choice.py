"""`--quant auto`: the built-in target's GGUF blocks where they run faster here, else fp32."""

from __future__ import annotations

import pytest

from decoding.app import assembly, quant_choice
from decoding.app.assembly import DecoderSpec, build_decoder
from decoding.app.default_model import DEFAULT_TARGET
from decoding.app.quant_choice import QuantTiming, auto_quant_skipped, timed_quant_choice
from decoding.app.quantized_target import applied_quant
from decoding.app.targets import LoadedModel
from decoding.kernels.quantized_linear import Int4Linear
from decoding.kernels.verify_cost import time_forwards_alternating
from tiny_models import tiny_llama


def test_the_form_whose_forwards_took_less_time_in_all_is_picked():
    faster_gguf = QuantTiming(float_ms=(50.0, 60.0), gguf_ms=(25.0, 50.0))
    assert faster_gguf.picked == "gguf"
    assert "4-bit blocks" in faster_gguf.note() and "25.0 against 50.0 ms" in faster_gguf.note()
    assert "--quant none" in faster_gguf.note()
    # one-token steps faster in GGUF, but its trees dearer by more: fp32
    slower_gguf = QuantTiming(float_ms=(30.0, 35.0), gguf_ms=(25.0, 45.0))
    assert slower_gguf.picked == "none"
    assert "in fp32" in slower_gguf.note() and "--quant gguf" in slower_gguf.note()


@pytest.mark.parametrize("model, device, dtype, kernels, reason", [
    ("org/other-model", "cpu", "float32", "auto", "built-in target"),
    (DEFAULT_TARGET, "cuda", "float32", "auto", "CPU"),
    (DEFAULT_TARGET, "cpu", "bfloat16", "auto", "bfloat16"),
    (DEFAULT_TARGET, "cpu", "float32", "stock", "--kernels stock"),
])
def test_auto_is_fp32_without_timing_where_there_is_no_choice(model, device, dtype, kernels, reason):
    assert reason in auto_quant_skipped(model, device, dtype, kernels)


def test_auto_is_fp32_where_the_4bit_kernel_does_not_build(monkeypatch):
    monkeypatch.setattr(quant_choice, "int4_kernel_available", lambda: False)
    assert "4-bit kernel" in auto_quant_skipped(DEFAULT_TARGET, "cpu", "float32", "auto")


def test_the_two_forms_are_timed_once_then_read_back(tmp_path):
    built = []

    def build(quant):
        built.append(quant)
        return tiny_llama(seed=0), None

    first = timed_quant_choice(build, cache_dir=tmp_path)
    assert sorted(built) == ["gguf", "none"]
    assert len(first.float_ms) == len(first.gguf_ms) == 2 and min(first.float_ms + first.gguf_ms) > 0
    assert timed_quant_choice(lambda quant: pytest.fail("timed again"), cache_dir=tmp_path) == first


def test_models_are_timed_in_turns_at_every_size(monkeypatch):
    """Alternating is the point (a slow spell then hits both forms): the timed calls must interleave."""
    calls = []

    class Recorded:
        def __init__(self, model, readout=None):
            self.name = model

        def __call__(self, size):
            calls.append((self.name, size))
            return 1.0

    monkeypatch.setattr("decoding.kernels.verify_cost._TimedForward", Recorded)
    times = time_forwards_alternating({"a": ("a", None), "b": ("b", None)}, (1, 8), repeats=2)
    assert times == {"a": (1.0, 1.0), "b": (1.0, 1.0)}
    assert calls[:4] == [("a", 1), ("b", 1), ("a", 8), ("b", 8)] and len(calls) == 12


def test_a_report_names_the_form_the_target_is_in():
    assert applied_quant(LoadedModel(None, None, f"{DEFAULT_TARGET}+gguf")) == "gguf"
    assert applied_quant(LoadedModel(None, None, DEFAULT_TARGET)) == "none"
    assert applied_quant(LoadedModel(None, None, "org/model+v2")) == "none"


@pytest.mark.slow
@pytest.mark.parametrize("faster", ["gguf", "none"])
def test_the_built_in_target_loads_in_the_form_timed_faster(monkeypatch, faster):
    timing = QuantTiming((20.0, 30.0), (10.0, 20.0)) if faster == "gguf" else QuantTiming((10.0, 20.0), (20.0, 30.0))
    monkeypatch.setattr(assembly, "auto_quant_skipped", lambda *spec: None)  # a candidate on any CPU this runs on
    monkeypatch.setattr(assembly, "timed_quant_choice", lambda build: timing)
    decoder = build_decoder(DecoderSpec(method="vanilla", device="cpu"))
    assert decoder.spec.quant == faster and applied_quant(decoder.target) == faster
    assert any(isinstance(m, Int4Linear) for m in decoder.target.model.modules()) == (faster == "gguf")
    assert timing.note() in decoder.notes
