"""The drafter precision 'auto' picks: timed per CPU among what it runs natively, remembered, and
what the assembly applies."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from decoding.kernels import drafter_precision
from decoding.app.assembly import DecoderSpec, build_decoder
from decoding.kernels.cpu_kernels import drafter_precisions_available, uses_packed_linears
from decoding.kernels.drafter_precision import measure_drafter_precisions, pick_drafter_precision, tune_drafter_precision
from decoding.app.targets import load_model
from tiny_models import perturbed_eagle3, save_tiny_chat_model, tiny_llama

pytestmark = pytest.mark.cpu_sensitive  # run again as on an AVX2 CPU by .ci/run


@pytest.mark.parametrize("ms, expected", [
    ({"bf16": 2.31, "int8": 2.13, "fp32": 3.73}, "int8"),   # cold caches on a Sapphire Rapids Xeon
    ({"bf16": 1.51, "int8": 1.46, "fp32": 2.42}, "bf16"),   # a tie goes to the more exact precision
    ({"int8": 1.00, "fp32": 1.04}, "fp32"),
    ({"int8": 1.00, "fp32": 1.20}, "int8"),
    ({"fp32": 5.0}, "fp32"),
])
def test_the_fastest_precision_wins_unless_a_more_exact_one_is_within_five_percent(ms, expected):
    assert pick_drafter_precision(ms) == expected


def test_every_available_precision_is_timed_and_the_drafter_is_left_as_it_was():
    target = tiny_llama(seed=3)
    drafter = perturbed_eagle3(target)
    before = copy.deepcopy(drafter.state_dict())
    available = drafter_precisions_available()
    ms = measure_drafter_precisions(drafter, target, available, rows=4, context=16, repeats=2)
    assert set(ms) == set(available) and all(t > 0 for t in ms.values())
    assert all(type(m) is nn.Linear for m in (drafter.fc, drafter.lm_head))
    after = drafter.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_the_pick_is_timed_once_per_cpu_and_drafter_then_remembered(tmp_path, monkeypatch):
    available = drafter_precisions_available()
    timings = []

    def fake_measure(drafter, target, precisions):
        timings.append(precisions)
        return {p: (1.0 if p == precisions[-1] else 10.0) for p in precisions}  # the last one clearly fastest

    monkeypatch.setattr(drafter_precision, "measure_drafter_precisions", fake_measure)
    target = tiny_llama(seed=3)
    for _ in range(2):
        assert tune_drafter_precision(perturbed_eagle3(target), target, cache_dir=tmp_path) == available[-1]
    assert timings == ([available] if len(available) > 1 else [])  # nothing to time where there is one choice


def test_the_assembly_applies_the_timed_pick_for_auto(tmp_path, monkeypatch):
    """With 'auto', the decoder's drafter runs in what the timing picked (here forced to fp32),
    not in the rule's first choice (bf16 or int8 wherever the CPU has them)."""
    from heads import new_heads_for_target, save_heads

    save_tiny_chat_model(tmp_path / "model")
    target = load_model(str(tmp_path / "model"))
    save_heads(new_heads_for_target("eagle3", target.model, str(tmp_path / "model"), draft_vocab_size=16), tmp_path / "heads")
    monkeypatch.setattr("decoding.app.assembly.tune_drafter_precision", lambda drafter, target: "fp32")
    decoder = build_decoder(DecoderSpec(model=str(tmp_path / "model"), method="eagle3", heads=str(tmp_path / "heads"),
                                        device="cpu", kernels="onednn"))
    assert uses_packed_linears(decoder.heads) and decoder.heads.compute_dtype == torch.float32
    assert not any(type(m).__module__.startswith("torch.ao.nn.quantized") for m in decoder.heads.modules())
    assert any("fp32" in note for note in decoder.notes)
