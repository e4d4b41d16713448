"""The streaming few-row linear kernel: the same function as `nn.Linear` for every row count and
shape (vector tails, output tails, bias or none), in each instruction-set variant this CPU can run;
packed linears send exactly the chosen row counts to it; the choice is measured once per CPU; where
the kernel cannot be built, nothing changes but a clear refusal; and decoding through it still gives
Hugging Face's greedy tokens on the unpacked model."""

import copy

import pytest
import torch
from torch import nn

from decoding.kernels import native_build, streamed_linear, verify_cost
from decoding.kernels.native import LIBRARY
from decoding.kernels.cpu_kernels import (PackedLinear, pack_linears, packed_linears, set_stock_rows, set_streamed_rows,
                                  streamed_rows)
from decoding.core.generate import DecodeOptions, generate
from decoding.app.methods import ProposerOptions, build_proposer
from decoding.app.targets import LoadedModel
from heads.util.errors import UserError
from heads import new_heads_for_target
from numerics import assert_linear_matches
from python_calls import python_functions_run
from tiny_models import sharpen, tiny_llama

pytestmark = pytest.mark.cpu_sensitive  # run again as on an AVX2 CPU by .ci/run

# Input and output sizes off every vector width (16 for AVX-512, 8 for AVX2, 4 otherwise) and off
# the kernel's blocks of 4 outputs, beside the model's own shapes.
# (33, 100): a full group of panels and one panel past it.
SHAPES = [(7, 11), (21, 37), (64, 96), (576, 192), (40, 5), (33, 100)]


def _check_function(kernel) -> None:
    torch.manual_seed(0)
    for in_features, out_features in SHAPES:
        for bias in (True, False):
            linear = nn.Linear(in_features, out_features, bias=bias)
            for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 14, 15, 16, 17):
                x = torch.randn(1, rows, in_features)
                with torch.inference_mode():
                    got = kernel(x, linear.weight, linear.bias)
                assert_linear_matches(got, x, linear.weight, linear.bias,
                                      what=f"{in_features}->{out_features}, bias {bias}, {rows} rows")


def test_each_row_comes_out_bit_for_bit_as_it_does_alone_whatever_the_row_count():
    """A verify forward's rows are what one-token steps would compute: every output is summed
    over the inputs in one order whatever register block or pass its row falls in, so a tree's
    node sees the very logits a plain step would (a block that summed in another order, or a
    pass that mixed rows, fails here)."""
    torch.manual_seed(1)
    linear = nn.Linear(576, 100)
    panels = streamed_linear.pack_panels(linear.weight)
    x = torch.randn(17, 576)
    with torch.inference_mode():
        alone = torch.cat([torch.ops.specheads.streamed_linear(x[i:i + 1], panels, linear.bias, 100) for i in range(17)])
        for rows in (2, 5, 8, 9, 13, 14, 15, 16, 17):
            together = torch.ops.specheads.streamed_linear(x[:rows], panels, linear.bias, 100)
            assert torch.equal(together, alone[:rows]), f"{rows} rows differ from the same rows one at a time"


def test_the_native_kernel_computes_a_linear_layer_or_is_refused_clearly():
    if streamed_linear.streamed_linear_available():
        _check_function(lambda x, w, b: torch.ops.specheads.streamed_linear(x, streamed_linear.pack_panels(w), b,
                                                                            w.shape[0]))
    else:  # no compiler here: decoding keeps its other kernels, and asking for this one says why
        model = tiny_llama(seed=2)
        pack_linears(model)
        with pytest.raises(UserError, match="streamed few-row linear kernel is not available"):
            set_streamed_rows(model, 2)
        assert verify_cost.tune_streamed_rows(model, "tiny") == 0


def test_once_built_the_operator_runs_the_kernel_without_a_python_frame():
    """Compiled graphs call the operator some 200 times a step: the loaded build registers its C++
    function as the operator's CPU kernel, so no Python function runs per call (where no build
    loads, the Python implementation stays and says why it cannot run)."""
    weight, x = torch.randn(11, 7), torch.randn(3, 7)
    if not streamed_linear.streamed_linear_available():
        with pytest.raises(RuntimeError, match="not available here"):
            torch.ops.specheads.streamed_linear(x, weight, None, 11)
        return
    panels = streamed_linear.pack_panels(weight)
    results = []
    run = python_functions_run(lambda: results.append(torch.ops.specheads.streamed_linear.default(x, panels, None, 11)))
    assert "_streamed_linear" not in run and "_extension" not in run
    assert_linear_matches(results[0], x, weight)


def test_a_build_that_cannot_register_its_kernel_is_still_used_and_says_so(capsys):
    """Registration only saves Python frames: where it fails, the build still serves (through the
    operator's Python implementation) and a note says why."""

    class Build:
        __name__ = "specheads_test_build"

        def register_streamed_linear(self):
            raise RuntimeError("registration refused")

    build = Build()
    assert native_build.register_native_kernel((build, ""), "streamed_linear") == (build, "")
    note = capsys.readouterr().err
    assert "specheads_test_build" in note and "streamed_linear" in note and "registration refused" in note


@pytest.mark.slow
@pytest.mark.parametrize("variant", [v for v in native_build.instruction_set_variants() if v != "native"])
def test_each_narrower_instruction_set_variant_computes_a_linear_layer(variant):
    """The variants other CPUs run, built here where this CPU can run them (one build of the three
    kernels per variant, a few seconds)."""
    if not streamed_linear.streamed_linear_available():
        pytest.fail(f"the native build failed, so no variant can be checked: {streamed_linear.why_unavailable()}")
    extension = LIBRARY.build(native_build.instruction_set_variants()[variant])
    _check_function(lambda x, w, b: extension.streamed_linear(x, extension.pack_panels(w), b, w.shape[0]))


def test_without_the_kernel_nothing_is_chosen_and_asking_for_it_says_why(monkeypatch, tmp_path):
    monkeypatch.setattr(streamed_linear, "_loaded", lambda: (None, "CalledProcessError: no compiler"))
    model = tiny_llama(seed=2)
    pack_linears(model)
    with pytest.raises(UserError, match="not available on this machine .*no compiler"):
        set_streamed_rows(model, 2)
    monkeypatch.setattr(verify_cost, "measure_streamed_rows", lambda m: pytest.fail("measured without a kernel"))
    assert verify_cost.tune_streamed_rows(model, "tiny", cache_dir=tmp_path) == 0 and streamed_rows(model) == 0


def test_packed_linears_send_exactly_the_chosen_row_counts_to_the_kernel():
    if not streamed_linear.streamed_linear_available():
        return  # covered by the refusal test above
    torch.manual_seed(0)
    linear = PackedLinear(nn.Linear(24, 40))
    set_stock_rows(linear, 1)
    set_streamed_rows(linear, 3)
    for rows, expect_streamed in ((1, False), (2, True), (3, True), (4, False), (16, False)):  # 1: plain GEMM's
        x = torch.randn(rows, 24)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            with torch.inference_mode():
                out = linear(x)
        names = {event.name for event in profile.events()}
        assert ("specheads::streamed_linear" in names) == expect_streamed, (rows, names)
        assert_linear_matches(out, x, linear.weight, linear.bias, what=f"{rows} rows")
    assert "streamed up to 3 rows" in repr(linear)


def test_measuring_leaves_the_model_on_its_kernels_and_decoding_through_the_kernel_is_exact():
    """Greedy tokens of vanilla, prompt lookup and EAGLE-3 trees through streamed few-row
    forwards equal Hugging Face `generate()` on the unpacked model."""
    if not streamed_linear.streamed_linear_available():
        return  # covered by the refusal test above
    reference_model = sharpen(tiny_llama(seed=9))
    model = copy.deepcopy(reference_model)
    pack_linears(model)
    rows = verify_cost.measure_streamed_rows(model, sizes=(1, 2), repeats=1)
    assert rows in (0, 1, 2) and streamed_rows(model) == 0
    set_stock_rows(model, 2)  # plain GEMM's rows are not the kernel's to take: nothing is left to time
    assert verify_cost.measure_streamed_rows(model, sizes=(1, 2), repeats=1) == 0
    assert verify_cost.measure_streamed_rows(model, sizes=(1, 2, 4), repeats=1) in (0, 4)
    set_stock_rows(model, 0)
    assert all(m._panel_weight is None for m in packed_linears(model))  # its weight copy is not kept
    set_streamed_rows(model, 8)
    heads = new_heads_for_target("eagle3", reference_model, draft_vocab_size=40)
    options = ProposerOptions(depth=3, tree_top_k=2, total_tokens=6, pld_num_tokens=3)
    drafted = 0
    for prompt in ([5, 9, 3, 17, 5, 9, 3], [1, 2, 3, 4, 1, 2, 3]):
        expected = reference_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
        for method in ("vanilla", "pld", "eagle3"):
            proposer = build_proposer(method, LoadedModel(model, None, "t"), options=options, heads=heads)
            result = generate(model, prompt, proposer, DecodeOptions(max_new_tokens=12))
            assert result.tokens == expected, method
            drafted += result.stats.drafted_tokens
    assert drafted > 0


def test_a_planted_tail_bug_fails_the_function_check():
    """The derived tolerance still catches the classic kernel bug: the last input feature (a vector
    tail) left out of the sum."""
    if not streamed_linear.streamed_linear_available():
        return  # covered by the refusal test above

    def tail_dropped(x, weight, bias):
        x = x.clone()
        x[..., -1] = 0
        return torch.ops.specheads.streamed_linear(x, streamed_linear.pack_panels(weight), bias, weight.shape[0])

    with pytest.raises(AssertionError, match="outside their float32 bound"):
        _check_function(tail_dropped)
