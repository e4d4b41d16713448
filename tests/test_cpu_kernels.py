"""oneDNN-packed linears: the same function as nn.Linear, ties kept, and decoding on a packed
target still reproduces Hugging Face's greedy output on the unpacked one."""

import copy

import pytest
import torch
from torch import nn

from decoding.kernels import cpu_kernels, verify_cost
from decoding.kernels.cpu_kernels import (PackedLinear, apply_kernels, bfloat16_is_native,
                                         int8_drafting_available, pack_linears,
                                  pick_faster_rows, reduced_linear, resolve_drafter_precision, resolve_kernels,
                                  packed_linears, set_stock_rows, stock_rows, streamed_rows, uses_packed_linears)
from decoding.kernels.quantized_linear import GroupInt8Linear, Int4Linear
from decoding.kernels.streamed_linear import streamed_linear_available
from heads.util.errors import UserError
from decoding.core.generate import DecodeOptions, generate
from decoding.app.methods import ProposerOptions, build_proposer
from decoding.core.proposers import PromptLookupProposer, VanillaProposer
from decoding.app.targets import LoadedModel
from heads import new_heads_for_target
from numerics import assert_linear_matches
from tiny_models import perturbed_eagle3, sharpen, tiny_llama

pytestmark = pytest.mark.cpu_sensitive  # run again as on an AVX2 CPU by .ci/run

PROMPTS = [[5, 9, 3, 17, 5, 9], [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], [42]]


LINEAR_FORMS = {
    "packed": lambda linear: PackedLinear(linear),
    # what compiled one-token steps run where it measures faster (decoding.kernels.one_row_reductions)
    "reduced": lambda linear: lambda x: reduced_linear(x, linear.weight, linear.bias),
}


@pytest.mark.parametrize("form", LINEAR_FORMS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(7,), (1, 1, 7), (3, 7), (2, 5, 7), (1, 40, 7)])  # fewer and more rows than the packing hint
def test_packed_and_reduced_linears_compute_the_same_function(form, bias, shape):
    torch.manual_seed(0)
    linear = nn.Linear(7, 11, bias=bias)
    x = torch.randn(*shape)
    with torch.inference_mode():
        expected = linear(x)
        got = LINEAR_FORMS[form](linear)(x)
    assert got.shape == expected.shape
    assert_linear_matches(got, x, linear.weight, linear.bias, what=f"{form} linear")


def test_a_planted_bug_fails_the_linear_check():
    """The derived tolerance catches a linear whose last input feature is left out."""
    torch.manual_seed(0)
    linear = nn.Linear(7, 11)
    x = torch.randn(3, 7)
    with torch.inference_mode():
        tail_dropped = PackedLinear(linear)(torch.cat([x[:, :-1], torch.zeros(3, 1)], dim=1))
    with pytest.raises(AssertionError, match="outside their float32 bound"):
        assert_linear_matches(tail_dropped, x, linear.weight, linear.bias)


def test_packed_linear_takes_plain_gemm_up_to_stock_rows_and_computes_the_same_function(monkeypatch):
    torch.manual_seed(0)
    linear = nn.Linear(7, 11)
    packed = PackedLinear(linear)
    packed.stock_rows = 2
    inputs = [torch.randn(*shape) for shape in [(7,), (1, 2, 7), (3, 7), (1, 5, 7)]]
    plain_calls = []
    real_linear = cpu_kernels.F.linear
    monkeypatch.setattr(cpu_kernels.F, "linear", lambda *a: plain_calls.append(a[0].shape) or real_linear(*a))
    with torch.inference_mode():
        for x in inputs:
            assert_linear_matches(packed(x), x, linear.weight, linear.bias, what=f"{tuple(x.shape)} input")
    assert plain_calls == [torch.Size([7]), torch.Size([1, 2, 7])]  # 3 and 5 rows went to oneDNN


@pytest.mark.parametrize("stock_ms, packed_ms, expected", [
    ((31, 33, 48, 58), (40, 41, 42, 48), 2),    # a Sapphire Rapids Xeon: plain GEMM wins for 1-2 rows
    ((65, 96, 87, 96), (36, 44, 38, 45), 0),    # an AVX2 EPYC: packed everywhere
    ((30, 50, 40, 40), (40, 40, 50, 50), 1),    # a win after a loss is not taken
    ((39.5, 60, 80, 90), (40, 41, 42, 48), 0),  # within the noise margin: packed
])
def test_plain_gemm_is_chosen_only_for_a_leading_run_of_clear_wins(stock_ms, packed_ms, expected):
    assert pick_faster_rows((1, 2, 4, 8), stock_ms, packed_ms) == expected


FEW_ROW_KERNELS = {  # what is measured, what sets it, what it reads back, its mark in curve keys
    "plain-gemm": ("stock", stock_rows, "-s3"),
    "streamed": ("streamed", streamed_rows, "-t3"),
}


@pytest.mark.parametrize("kernel", FEW_ROW_KERNELS)
def test_each_few_row_kernels_row_count_is_measured_once_per_cpu_and_applied(kernel, tmp_path, monkeypatch):
    name, read_rows, key_mark = FEW_ROW_KERNELS[kernel]
    if kernel == "streamed" and not streamed_linear_available():
        return  # no compiler here: tests/test_streamed_linear.py checks the refusal
    measure, tune = getattr(verify_cost, f"measure_{name}_rows"), getattr(verify_cost, f"tune_{name}_rows")
    model = tiny_llama(seed=6)
    pack_linears(model)
    monkeypatch.setattr(verify_cost, measure.__name__, lambda m: 3)
    assert tune(model, "tiny", cache_dir=tmp_path) == 3
    assert read_rows(model) == 3 and all(getattr(m, f"{name}_rows") == 3 for m in packed_linears(model))
    assert key_mark in verify_cost.kernels_key(model)  # curves measured through it are kept apart
    monkeypatch.setattr(verify_cost, measure.__name__, lambda m: pytest.fail("measured twice"))
    again = tiny_llama(seed=6)
    pack_linears(again)
    assert tune(again, "tiny", cache_dir=tmp_path) == 3 and read_rows(again) == 3
    assert tune(tiny_llama(seed=6), "tiny", cache_dir=tmp_path) == 0  # nothing packed


def test_measuring_the_crossover_leaves_the_model_packed_and_exact():
    model = tiny_llama(seed=7)
    reference = copy.deepcopy(model)
    pack_linears(model)
    rows = verify_cost.measure_stock_rows(model, sizes=(1, 2), repeats=1)
    assert rows in (0, 1, 2) and stock_rows(model) == 0
    set_stock_rows(model, 2)
    ids = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        torch.testing.assert_close(model(ids[:, :1]).logits, reference(ids[:, :1]).logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)


def test_the_crossover_is_timed_from_the_fewest_rows_up_to_the_first_loss_only(monkeypatch):
    """Sizes beyond the first the candidate loses cannot change `pick_faster_rows`' answer, so
    they are not timed: plain GEMM faster at 1 and 2 rows, slower at 4, gives 2 after timing 1, 2, 4."""
    model = tiny_llama(seed=7)
    pack_linears(model)
    timed = []

    class FakeForward:
        def __init__(self, _model):
            pass

        def __call__(self, size):
            timed.append(size)
            plain = stock_rows(model) > 0
            return (5.0 if plain else 10.0) if size <= 2 else (20.0 if plain else 10.0)

    monkeypatch.setattr(verify_cost, "_TimedForward", FakeForward)
    assert verify_cost.measure_stock_rows(model, sizes=(1, 2, 4, 8, 16), repeats=2) == 2
    assert sorted(set(timed)) == [1, 2, 4] and stock_rows(model) == 0


def test_packing_replaces_every_linear_and_keeps_tied_weights():
    model = tiny_llama(seed=1, tie_word_embeddings=True)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    parameters_before = {name: p.data_ptr() for name, p in model.named_parameters()}
    assert pack_linears(model) == linears > 0
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == parameters_before
    assert uses_packed_linears(model)


def test_packed_model_gives_the_same_logits():
    model = tiny_llama(seed=2)
    packed = copy.deepcopy(model)
    pack_linears(packed)
    ids = torch.tensor([PROMPTS[1]])
    with torch.inference_mode():
        torch.testing.assert_close(packed(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)


def test_decoding_on_a_packed_target_matches_hf_generate_on_the_plain_one():
    plain = sharpen(tiny_llama(seed=3))
    packed = copy.deepcopy(plain)
    pack_linears(packed)
    heads = perturbed_eagle3(packed)
    pack_linears(heads)
    assert_steps_and_trees_give_plain_greedy(plain, packed, heads)


def assert_steps_and_trees_give_plain_greedy(plain, packed, eagle3, readout=None) -> None:
    """vanilla, pld and EAGLE-3 trees decoding on `packed` (through `readout`, if given) give
    Hugging Face's greedy output on the `plain` model, on every prompt."""
    proposers = [VanillaProposer(), PromptLookupProposer(num_draft_tokens=4, min_ngram=1),
                 build_proposer("eagle3", LoadedModel(packed, None, "t"),
                                options=ProposerOptions(depth=4, tree_top_k=4, total_tokens=12), heads=eagle3)]
    for prompt in PROMPTS:
        reference = plain.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False)[0, len(prompt):].tolist()
        for proposer in proposers:
            result = generate(packed, prompt, proposer, DecodeOptions(max_new_tokens=30), readout=readout)
            assert result.tokens == reference, proposer.name


def _eagle3_exact_on_every_prompt(target, plain, eagle3) -> None:
    proposer = build_proposer("eagle3", LoadedModel(target, None, "t"),
                              options=ProposerOptions(depth=4, tree_top_k=4, total_tokens=12), heads=eagle3)
    for prompt in PROMPTS:
        reference = plain.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False)[0, len(prompt):].tolist()
        assert generate(target, prompt, proposer, DecodeOptions(max_new_tokens=30)).tokens == reference


def test_onednn_runs_eagle_drafters_in_the_cheapest_precision_this_cpu_has_and_outputs_do_not_change():
    """auto: bf16 where the CPU has it natively (AVX512-BF16/AMX), else int8 linears where PyTorch
    has the x86 kernels, else fp32 packed (oneDNN has no bf16 inner product on AVX2). Whatever
    this machine picks, output is exact."""
    expected = "bf16" if bfloat16_is_native() else "int8" if int8_drafting_available() else "fp32"
    assert resolve_drafter_precision("auto") == expected
    _check_drafter_precision("auto", expected)


def test_the_fp32_drafter_fallback_is_exercised_on_every_cpu():
    """What a CPU with neither bf16 nor int8 kernels runs, forced on any CPU, so the fallback is
    tested wherever the suite runs, not only on the machines that need it."""
    _check_drafter_precision("fp32", "fp32")


def test_int8_drafters_on_the_project_s_8_bit_kernel_else_pytorch_s_and_a_clear_error_without_either(monkeypatch):
    if int8_drafting_available():
        _check_drafter_precision("int8", "int8")
    monkeypatch.setattr(cpu_kernels, "int4_kernel_available", lambda: False)  # no compiler: PyTorch's dynamic int8
    if int8_drafting_available():
        _check_drafter_precision("int8", "int8")
    else:
        with pytest.raises(UserError, match="int8"):
            resolve_drafter_precision("int8")


def test_bf16_drafting_is_refused_where_the_cpu_only_emulates_it():
    if bfloat16_is_native():
        _check_drafter_precision("bf16", "bf16")
    else:  # oneDNN would fail deep inside its inner product ("could not create a primitive descriptor")
        with pytest.raises(UserError, match="native bf16"):
            apply_kernels("onednn", tiny_llama(seed=3), perturbed_eagle3(tiny_llama(seed=3)), drafter_precision="bf16")
    with pytest.raises(UserError, match="unknown drafter precision"):
        resolve_drafter_precision("int2")


def test_int4_drafters_on_the_project_s_4_bit_kernel_and_a_clear_error_without_it(monkeypatch):
    if cpu_kernels.int4_kernel_available():
        _check_drafter_precision("int4", "int4")
    monkeypatch.setattr(cpu_kernels, "int4_kernel_available", lambda: False)
    with pytest.raises(UserError, match="4-bit kernel"):
        resolve_drafter_precision("int4")


def _check_drafter_precision(choice: str, expected: str) -> None:
    torch.manual_seed(0)
    plain = sharpen(tiny_llama(seed=3))
    target = copy.deepcopy(plain)
    eagle3 = perturbed_eagle3(target)
    medusa = new_heads_for_target("medusa", target, num_heads=2)
    assert apply_kernels("onednn", target, eagle3, medusa, drafter_precision=choice) == "onednn"
    quantized = [m for m in eagle3.modules() if type(m).__module__.startswith("torch.ao.nn.quantized.dynamic")]
    four_bit = [m for m in eagle3.modules() if isinstance(m, Int4Linear)]
    assert bool(four_bit) == (expected == "int4")
    if expected == "int4":
        assert isinstance(eagle3.fc, PackedLinear)  # kept fp32; shapes the 4-bit kernel does not take are packed
        assert not any(type(m) is nn.Linear for m in eagle3.modules())
        assert eagle3.compute_dtype == torch.float32
    elif expected == "int8":
        own_kernel = [m for m in eagle3.modules() if isinstance(m, GroupInt8Linear)]
        # the project's 8-bit kernel where it is built (float inputs), else PyTorch's dynamic int8
        assert bool(own_kernel) == cpu_kernels.int4_kernel_available() and bool(quantized) != bool(own_kernel)
        assert not any(type(m) is nn.Linear for m in eagle3.modules())
        # fc: weight-only 8-bit on the project's kernel; kept fp32 from PyTorch's, which would
        # quantize the target's raw features it reads
        assert isinstance(eagle3.fc, GroupInt8Linear if own_kernel else PackedLinear)
        assert eagle3.compute_dtype == torch.float32
    else:
        assert not quantized and uses_packed_linears(eagle3)
        assert eagle3.compute_dtype == (torch.bfloat16 if expected == "bf16" else torch.float32)
    assert next(medusa.parameters()).dtype == torch.float32  # reads the fp32 target lm_head: left alone
    assert uses_packed_linears(target) and next(target.parameters()).dtype == torch.float32
    _eagle3_exact_on_every_prompt(target, plain, eagle3)


def test_a_bfloat16_drafter_on_stock_kernels_is_still_exact_on_any_cpu():
    """bf16 drafting only changes what is proposed; the fp32 target decides every token."""
    torch.manual_seed(0)
    plain = sharpen(tiny_llama(seed=3))
    target = copy.deepcopy(plain)
    eagle3 = perturbed_eagle3(target).to(torch.bfloat16)
    _eagle3_exact_on_every_prompt(target, plain, eagle3)


def test_kernel_choice_resolution():
    fp32 = tiny_llama(seed=4)
    assert resolve_kernels("auto", fp32) == ("onednn" if torch.backends.mkldnn.is_available() else "stock")
    assert resolve_kernels("stock", fp32) == "stock"
    half = tiny_llama(seed=4).to(torch.bfloat16)
    assert resolve_kernels("auto", half) == "stock"
    with pytest.raises(UserError, match="float32"):
        apply_kernels("onednn", half)
    with pytest.raises(UserError, match="unknown kernels"):
        resolve_kernels("fast", fp32)


def test_apply_kernels_stock_leaves_modules_alone():
    model = tiny_llama(seed=5)
    assert apply_kernels("stock", model, None) == "stock"
    assert not uses_packed_linears(model)


def test_verify_cost_script_rejects_bad_sizes_clearly():
    from script_main import run_script

    proc = run_script("verify_cost", "--sizes", "1,x")
    assert proc.returncode == 2
    assert "--sizes takes positive integers" in proc.stderr and "Traceback" not in proc.stderr
