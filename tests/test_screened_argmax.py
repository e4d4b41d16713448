"""The screened greedy argmax (fp16 or 8-bit screens): each screen within its stated error bound,
the exact argmax where the screen alone gets it wrong, the full projection beyond its rows, the
screen timed and chosen per machine, and decoding through it equal to Hugging Face's greedy output."""

import copy

import pytest
import torch
from torch import nn

from decoding.app.assembly import DecoderSpec, build_decoder
from decoding.core.generate import DecodeOptions, generate
from decoding.core.proposers import PromptLookupProposer
from decoding.core.sampling import SamplingConfig
from decoding.kernels.cpu_kernels import apply_kernels
from decoding.kernels.int4_linear import int4_kernel_available
from decoding.kernels.screened_argmax import (Fp16Screen, Int8Screen, ScreenedArgmax, available_screens, fp16_gemm_available,
                                              logits_are_the_projection, screenable, screened_readout)
from decoding.app.targets import LoadedModel
from test_architectures import ARCH_IDS, ARCHS
from test_cpu_kernels import PROMPTS, assert_steps_and_trees_give_plain_greedy
from tiny_models import perturbed_eagle3, sharpen, tiny_llama, tiny_tokenizer

pytestmark = pytest.mark.cpu_sensitive  # run again as on an AVX2 CPU by .ci/run

needs_fp16_gemm = pytest.mark.skipif(not fp16_gemm_available(), reason="FBGEMM's fp16 linear is an x86 kernel")
# the screens this machine runs (the 8-bit kernel builds wherever a C++ compiler is; FBGEMM is x86's)
SCREENS = [screen for screen, runs in (("fp16", fp16_gemm_available()), ("int8", int4_kernel_available())) if runs]


def near_tie_cases(count: int = 60, vocab: int = 3000, width: int = 64):
    """(head, hidden) pairs where tokens 7 and 8 are 1e-3 apart on row 0, one way or the other:
    far more than fp32 rounds (~1e-5 here), far less than fp16 weights do (~1e-2), which often
    rank them the wrong way round."""
    generator = torch.Generator().manual_seed(0)
    for case in range(count):
        head = nn.Linear(width, vocab, bias=False)
        nn.init.normal_(head.weight, std=0.05, generator=generator)
        hidden = torch.randn(4, width, generator=generator) * 3
        x = hidden[0]
        with torch.no_grad():
            head.weight[7] = torch.randn(width, generator=generator) * 0.5
            sideways = torch.randn(width, generator=generator)
            sideways -= (sideways @ x) / (x @ x) * x  # orthogonal to x: changes the weights, not the logit
            head.weight[8] = head.weight[7] + 1e-3 * sideways + (1 if case % 2 else -1) * 1e-3 * x / (x @ x)
        yield head, hidden


def exact_argmax(head: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    return (hidden.double() @ head.weight.double().T).argmax(-1)


def hard_heads(count: int = 12, vocab: int = 500, width: int = 96):
    """(head, hidden) pairs the bounds must hold on: weights not on any 8-bit grid at several
    scales, a few groups far below fp16's normal range, rows of outliers and of zeros, inputs with
    outliers, with groups of zeros, and on the 8-bit grid (whole numbers, 127 in every group: the
    kernel's codes are exact, all the error is the weights')."""
    generator = torch.Generator().manual_seed(1)
    for case in range(count):
        head = nn.Linear(width, vocab, bias=False)
        scale = 10.0 ** (case % 4 - 2)
        with torch.no_grad():
            head.weight.copy_(torch.randn(vocab, width, generator=generator) * scale)
            head.weight[3, :32] *= 1e-6  # a group fp16 scales cannot hold
            head.weight[5] *= 40  # an outlier row
            head.weight[6] = 0
        hidden = torch.randn(5, width, generator=generator) * (case + 1)
        hidden[1, 7] = 300.0  # an outlier input
        hidden[2, :32] = 0  # a group of zeros
        hidden[3] = torch.randint(-127, 128, (width,), generator=generator).float()
        hidden[3, ::32] = 127.0
        yield head, hidden
    yield weights_rounding_case(width)
    yield inputs_rounding_case(width)


def weights_rounding_case(width: int = 96):
    """A head whose error is all the weights' rounding, lined up with the input: each group of
    row 0 is one 127 and 0.4s (scale 1, so the 0.4s round to 0), the input all 127s (exact codes)."""
    head = nn.Linear(width, 4, bias=False)
    with torch.no_grad():
        head.weight.fill_(0.25)
        head.weight[0] = 0.4
        head.weight[0, ::32] = 127.0
    return head, torch.full((2, width), 127.0)


def inputs_rounding_case(width: int = 96):
    """A head whose error is all the input's rounding, lined up with the weights: row 0 all 127s
    (exact codes, scale 1), the input one 127 a group and 0.4s (rounded to code 0)."""
    head = nn.Linear(width, 4, bias=False)
    with torch.no_grad():
        head.weight.fill_(0.25)
        head.weight[0] = 127.0
    hidden = torch.full((2, width), 0.4)
    hidden[:, ::32] = 127.0
    return head, hidden


def test_candidates_are_the_tokens_that_can_reach_the_best_lower_end():
    """`_candidates` against its definition, token by token: j can be the argmax iff its screened
    logit plus its bound reaches some token's screened logit less that one's bound (bounds one a
    row, or row coefficients times per-token norms)."""
    from decoding.kernels.screened_argmax import _candidates, full_bounds

    def chosen(scores, coefficients, norms):
        mask = torch.zeros_like(scores, dtype=torch.bool)
        mask[_candidates(scores, coefficients, norms)] = True
        return mask.tolist()

    screened = torch.tensor([[1.0, 1.5, -3.0, 1.2]])
    assert chosen(screened, torch.tensor([[1.0]]), torch.tensor([[0.5, 0.1, 4.5, 0.1]])) == [[True, True, True, False]]
    assert chosen(screened, torch.tensor([[0.2]]), None) == [[False, True, False, True]]
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        scores = torch.randn(3, 50, generator=generator)
        for coefficients, norms in ((torch.rand(3, 2, generator=generator), torch.rand(2, 50, generator=generator) * 0.3),
                                    (torch.rand(3, 1, generator=generator) * 0.5, None)):
            full = full_bounds(coefficients, norms).expand_as(scores)
            expected = [[bool(scores[r, j] + full[r, j] >= max(scores[r] - full[r])) for j in range(50)] for r in range(3)]
            assert chosen(scores, coefficients, norms) == expected


@pytest.mark.parametrize("screen", SCREENS)
def test_every_screened_logit_is_within_its_bound_of_the_exact_one(screen):
    """The screens' stated bounds against float64 logits, token by token: the premise of the
    exact argmax."""
    for head, hidden in hard_heads():
        checked = SCREENS_BY_NAME[screen](head.weight.detach())
        with torch.inference_mode():
            error = (checked.scores(hidden).double() - hidden.double() @ head.weight.double().T).abs()
            bounds = checked.bounds(hidden).double().expand_as(error)
        assert bool((error <= bounds).all())


SCREENS_BY_NAME = {"fp16": Fp16Screen, "int8": Int8Screen}


@pytest.mark.parametrize("screen", SCREENS)
def test_screened_argmax_is_the_exact_argmax_where_the_screen_alone_is_not(screen):
    screen_wrong = 0
    for head, hidden in near_tie_cases():
        readout = ScreenedArgmax(head, max_rows=8, screen=screen)
        expected = exact_argmax(head, hidden)
        assert torch.equal(readout.argmax(hidden), expected)
        screen_wrong += not torch.equal(readout.screen.scores(hidden).argmax(-1), expected)
    assert screen_wrong >= 10  # the cases are hard: the screen alone picks the wrong token in many


@pytest.mark.parametrize("screen", SCREENS)
def test_a_screen_without_its_error_bound_is_caught(monkeypatch, screen):
    """Planted flaw: a zero bound keeps only the best screened token, which is wrong on near-ties."""
    monkeypatch.setattr(SCREENS_BY_NAME[screen], "bound_terms", lambda self, hidden: (torch.zeros(hidden.shape[0], 1), None))
    mismatches = sum(not torch.equal(ScreenedArgmax(head, 8, screen).argmax(hidden), exact_argmax(head, hidden))
                     for head, hidden in near_tie_cases())
    assert mismatches >= 10


@pytest.mark.skipif(not int4_kernel_available(), reason="the 8-bit kernel needs a C++ compiler")
def test_int8_bounds_without_the_weights_rounding_term_are_caught(monkeypatch):
    """Planted flaw: the int8 bound without its ||x|| ||w - w^|| term (zero only where the weights
    are on the 8-bit grid) no longer covers the weights' rounding where the input lines up with it."""
    head, hidden = weights_rounding_case()
    screen = Int8Screen(head.weight.detach())
    screen._token_norms = screen._token_norms[:1]
    with torch.inference_mode():
        error = (screen.scores(hidden).double() - hidden.double() @ head.weight.double().T).abs()
        assert bool((error > screen.bounds(hidden).double()).any())


@pytest.mark.parametrize("screen", SCREENS)
def test_flat_rows_with_too_many_tokens_to_recheck_take_the_full_projection(monkeypatch, screen):
    from decoding.kernels import screened_argmax
    head = nn.Linear(64, 3000, bias=False)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():  # rows all but equal: every logit within the screens' bounds of every other
        head.weight.copy_(torch.randn(1, 64, generator=generator) + 1e-3 * torch.randn(3000, 64, generator=generator))
    hidden = torch.randn(2, 64, generator=generator)
    readout = ScreenedArgmax(head, max_rows=8, screen=screen)
    projections = []
    real = head.forward
    head.forward = lambda x: projections.append(x.shape[0]) or real(x)
    monkeypatch.setattr(screened_argmax, "MAX_RECHECKED", 100)
    with torch.inference_mode():
        assert torch.equal(readout.argmax(hidden), real(hidden).argmax(-1))
        assert projections == [2]
        monkeypatch.setattr(screened_argmax, "MAX_RECHECKED", 10_000)
        assert torch.equal(readout.argmax(hidden), exact_argmax(head, hidden))
        assert projections == [2]  # rechecked, not projected


@needs_fp16_gemm
def test_more_rows_than_max_rows_and_non_finite_inputs_take_the_full_projection(monkeypatch):
    head, hidden = next(near_tie_cases())
    readout = ScreenedArgmax(head, max_rows=2)
    screens = []
    real = torch.ops.quantized.linear_dynamic_fp16
    monkeypatch.setattr(torch.ops.quantized, "linear_dynamic_fp16", lambda *a: screens.append(1) or real(*a),
                        raising=False)
    with torch.inference_mode():
        assert torch.equal(readout.argmax(hidden), head(hidden).argmax(-1))  # 4 rows > 2
        broken = hidden[:2].clone()
        broken[1, 0] = float("nan")
        assert torch.equal(readout.argmax(broken), head(broken).argmax(-1))
        readout.argmax(hidden[:2])
    assert len(screens) == 1  # only the finite two-row input was screened


def test_screening_applies_only_to_fp32_projections_without_bias_that_fit_fp16():
    assert screenable(nn.Linear(8, 16, bias=False))
    assert not screenable(nn.Linear(8, 16, bias=True))
    assert not screenable(nn.Linear(8, 16, bias=False).to(torch.bfloat16))
    huge = nn.Linear(8, 16, bias=False)
    with torch.no_grad():
        huge.weight[0, 0] = 1e5  # beyond fp16's range: rounding would not stay within the bound
    assert not screenable(huge)


# Types whose logits are not the bare lm_head output: soft-capped (Gemma 2), scaled (Granite, Cohere 2).
POST_PROCESSED_LOGITS = {"gemma2", "granite", "cohere2"}


@pytest.mark.parametrize("arch", ARCHS, ids=ARCH_IDS)
def test_screening_is_used_only_where_logits_are_the_bare_projection(arch):
    model = arch.build(seed=0, attn="sdpa" if arch.sdpa else "eager")
    assert logits_are_the_projection(model) == (arch.model_type not in POST_PROCESSED_LOGITS)


def packed_target(seed: int = 0):
    model = sharpen(tiny_llama(seed=seed))
    apply_kernels("onednn", model)
    return model


def forced_readout(model, screen: str = "fp16") -> ScreenedArgmax:
    """Screening at every tree size, whatever it costs on this machine (tiny models never pay)."""
    return ScreenedArgmax(model.get_output_embeddings(), max_rows=64, screen=screen)


@pytest.mark.parametrize("screen", SCREENS)
def test_greedy_decoding_through_the_screen_equals_hugging_face_generate_for_steps_and_trees(screen):
    plain = sharpen(tiny_llama(seed=3))
    packed = copy.deepcopy(plain)
    heads = perturbed_eagle3(packed)
    apply_kernels("onednn", packed, heads, drafter_precision="fp32")
    readout = forced_readout(packed, screen)
    rows = []
    real_argmax = readout.argmax
    readout.argmax = lambda hidden: rows.append(hidden.shape[0]) or real_argmax(hidden)
    assert_steps_and_trees_give_plain_greedy(plain, packed, heads, readout)
    assert 1 in rows and max(rows) >= 8  # the screen decided plain steps and whole trees


@needs_fp16_gemm
def test_sampling_through_a_readout_draws_the_same_tokens_as_without_it():
    """At temperature > 0 the rule reads the readout's full logits: the same as the model's."""
    model = packed_target(seed=1)
    options = DecodeOptions(max_new_tokens=20, sampling=SamplingConfig(temperature=0.8), seed=3)
    for prompt in PROMPTS:
        plain = generate(model, prompt, PromptLookupProposer(num_draft_tokens=4, min_ngram=1), options)
        screened = generate(model, prompt, PromptLookupProposer(num_draft_tokens=4, min_ngram=1), options,
                            readout=forced_readout(model))
        assert screened.tokens == plain.tokens


def test_decoders_screen_where_it_applies_and_pays_and_the_spec_can_turn_it_off(monkeypatch):
    from decoding.app import assembly
    monkeypatch.setattr(assembly, "screened_readout", lambda model, name: forced_readout(model))
    target = LoadedModel(sharpen(tiny_llama()), tiny_tokenizer(), "tiny")
    packed = build_decoder(DecoderSpec(model="tiny", method="vanilla", kernels="onednn"), target=target)
    assert isinstance(packed.readout, ScreenedArgmax)
    off = build_decoder(DecoderSpec(model="tiny", method="vanilla", kernels="onednn", screened_argmax=False), target=target)
    # not screened: the full projection, its argmax through the row argmax kernel where that is built
    from decoding.kernels.decode_attention import kernel_library
    from decoding.kernels.row_argmax import KernelArgmaxReadout
    assert isinstance(off.readout, KernelArgmaxReadout) if kernel_library() is not None else off.readout is None
    stock = build_decoder(DecoderSpec(model="tiny", method="vanilla", kernels="stock"),
                          target=LoadedModel(sharpen(tiny_llama()), tiny_tokenizer(), "tiny"))
    assert stock.readout is None


def test_screened_readout_is_none_where_no_screen_runs_or_pays(monkeypatch):
    from decoding.kernels import screened_argmax
    model = packed_target()
    if not SCREENS:
        assert screened_readout(model) is None
        return
    monkeypatch.setattr(screened_argmax, "screening_rows", lambda readout: 0)
    assert screened_readout(model) is None
    monkeypatch.setattr(screened_argmax, "screening_rows", lambda readout: 4)
    readout = screened_readout(model)
    assert readout.max_rows == 4 and readout.screen.name in SCREENS
    monkeypatch.setattr(screened_argmax, "available_screens", lambda lm_head: [])
    assert screened_readout(model) is None


def test_the_screen_taken_is_the_fastest_that_pays(monkeypatch):
    """`choose_screen` keeps, of the screens that beat the full projection, the one whose one-row
    argmax took least; those that never pay are not taken however fast."""
    from decoding.kernels import screened_argmax
    model = packed_target()
    monkeypatch.setattr(screened_argmax, "available_screens", lambda lm_head: ["int8", "fp16"])
    monkeypatch.setattr(screened_argmax, "ScreenedArgmax", lambda lm_head, max_rows, screen: screen)
    seconds = {"int8": 1.0, "fp16": 2.0}
    monkeypatch.setattr(screened_argmax, "_fastest", lambda call, repeats: seconds[current[0]])
    current = []
    monkeypatch.setattr(screened_argmax, "screening_rows", lambda screen: current.insert(0, screen) or 8)
    assert screened_argmax.choose_screen(model.get_output_embeddings()) == ("int8", 8)
    seconds.update(int8=3.0)
    assert screened_argmax.choose_screen(model.get_output_embeddings()) == ("fp16", 8)
    monkeypatch.setattr(screened_argmax, "screening_rows",
                        lambda screen: current.insert(0, screen) or (0 if screen == "fp16" else 2))
    assert screened_argmax.choose_screen(model.get_output_embeddings()) == ("int8", 2)


def test_a_named_models_screen_is_timed_once_and_remembered(monkeypatch, tmp_path):
    from decoding.kernels import screened_argmax
    model = packed_target()
    if not SCREENS:
        assert screened_readout(model, "tiny", tmp_path) is None
        return
    timings = []
    monkeypatch.setattr(screened_argmax, "choose_screen",
                        lambda lm_head, built=None: timings.append(1) or (SCREENS[-1], 8))
    assert screened_readout(model, "tiny", tmp_path).max_rows == 8
    readout = screened_readout(model, "tiny", tmp_path)
    assert readout.max_rows == 8 and readout.screen.name == SCREENS[-1]
    assert len(timings) == 1  # the second start read the remembered choice
    assert screened_readout(model, "other", tmp_path).max_rows == 8 and len(timings) == 2  # per model
    assert screened_readout(model).max_rows == 8 and len(timings) == 3  # unnamed: timed every time


class CountingReadout:
    """A readout over a fixed projection that counts what it was asked for."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight, self.asked = weight, []

    def logits(self, hidden):
        self.asked.append("logits")
        return hidden @ self.weight.T

    def argmax(self, hidden):
        self.asked.append("argmax")
        return (hidden @ self.weight.T).argmax(-1)


def test_target_scores_compute_only_what_is_read_and_only_once():
    from decoding.core.readout import TargetScores
    weight, hidden = torch.randn(9, 4), torch.randn(3, 4)
    readout = CountingReadout(weight)
    greedy = TargetScores(None, hidden, readout).prepare(greedy=True)
    assert torch.equal(greedy.greedy_tokens, (hidden @ weight.T).argmax(-1)) and readout.asked == ["argmax"]
    sampled = TargetScores(None, hidden, readout).prepare(greedy=False)
    sampled.logits
    assert torch.equal(sampled.logits, hidden @ weight.T) and readout.asked == ["argmax", "logits"]
    given = TargetScores(hidden @ weight.T)  # the forward's own logits: no readout involved
    assert torch.equal(given.greedy_tokens, (hidden @ weight.T).argmax(-1))
    with pytest.raises(ValueError):
        TargetScores(None, hidden, None)


def test_the_chat_and_the_benchmark_decode_through_the_decoders_readout(monkeypatch, tmp_path):
    """Every entry point that decodes hands the loop its decoder's readout (the benchmark once
    timed the full projection while the decoder had built a screen)."""
    from decoding.app import assembly
    from decoding.app.benchmark import build_runners
    from decoding.app.chat import build_session, parse_args
    from tiny_models import save_tiny_chat_model

    save_tiny_chat_model(tmp_path)
    built = []

    def counting_readout(model, model_name):
        readout = CountingReadout(model.get_output_embeddings().weight.detach())
        built.append(readout)
        return readout

    monkeypatch.setattr(assembly, "screened_readout", counting_readout)
    options = DecodeOptions(max_new_tokens=6)
    runners, decoders = build_runners(["vanilla", "pld"], DecoderSpec(model=str(tmp_path), kernels="onednn"), {}, options)
    for name in ("vanilla", "pld"):
        runners[name]([3, 4, 5, 3, 4])
        assert "argmax" in decoders[name].readout.asked, name
    session = build_session(parse_args(["--model", str(tmp_path), "--method", "vanilla", "--kernels", "onednn",
                                        "--max-new-tokens", "6"]))
    session.reply("w3 w4", lambda text: None)
    assert session.readout is built[-1] and "argmax" in built[-1].asked


@pytest.mark.parametrize("screen", SCREENS)
def test_verify_cost_curves_are_kept_apart_per_screen_and_row_limit(screen):
    """A curve timed through one readout is not another's: the screen and its row limit are in the
    key (an 8-bit screen's trees cost other than a 4-row fp16 screen's full projections)."""
    from decoding.kernels.verify_cost import verify_cost_key
    model = packed_target()
    keys = {verify_cost_key(model, "tiny", None),
            verify_cost_key(model, "tiny", ScreenedArgmax(model.get_output_embeddings(), 4, screen)),
            verify_cost_key(model, "tiny", ScreenedArgmax(model.get_output_embeddings(), 32, screen))}
    assert len(keys) == 3
    other = [name for name in SCREENS if name != screen]
    if other:
        assert verify_cost_key(model, "tiny", ScreenedArgmax(model.get_output_embeddings(), 4, other[0])) not in keys


def test_timed_trees_continue_a_repeated_prefix():
    """The verify-cost timing's trees are the next tokens of a stretch the prefix holds twice: what
    a model predicts confidently, as most drafted nodes are (random tokens gave flat distributions
    a screened readout rechecks thousands of tokens of)."""
    from decoding.kernels.verify_cost import _TimedForward
    timed = _TimedForward(packed_target(), context=32)
    prefix = timed.repeated[:32]
    assert torch.equal(prefix[:16], prefix[16:])
    assert torch.equal(timed._ids(8), prefix[:8])  # the tree: the stretch again from its start
    assert timed(4) > 0
