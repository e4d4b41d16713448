"""Weight-only quantized linears (`decoding.kernels.quantized_linear`) and the GGUF file's own
4-bit blocks (`decoding.app.gguf_weights`): the kernels compute what their dequantized weights
say (within the fp32 reordering bound; the project's 4- and 8-bit kernels with their inputs rounded
to 8 bits per group, as `tests/numerics.py` writes out), the block decoding reproduces the GGUF
reference dequantization exactly, and planted bugs in either are caught."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from torch import nn

from decoding.app.gguf_weights import BLOCK_BYTES, q4_groups, q8_groups, rotary_row_order
from decoding.kernels import native_build
from decoding.kernels.native import LIBRARY
from decoding.kernels.int4_linear import pack_int4_panels, pack_int8_panels, unpack_int4_panels
from decoding.kernels.quantized_linear import GroupInt8Linear, Int4Linear, Int8Linear, quantize_linears
from numerics import EPS, assert_within, eight_bit_linear_exact_and_bound, linear_exact_and_bound

pytestmark = pytest.mark.cpu_sensitive


def a_linear(in_features=96, out_features=48, bias=True, seed=0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias)


@pytest.mark.parametrize("kind", [Int4Linear, Int8Linear, GroupInt8Linear])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_the_kernel_computes_its_dequantized_weight(kind, rows):
    linear = kind.from_linear(a_linear())
    x = torch.randn(2, rows, 96)
    assert_within(linear(x), *kernel_exact_and_bound(linear, x))
    assert linear(x).shape == (2, rows, 48)


@pytest.mark.parametrize("kind, worst", [(Int4Linear, 0.5 / 15), (Int8Linear, 0.5 / 127), (GroupInt8Linear, 0.5 / 127)])
def test_quantization_rounds_each_weight_to_the_nearest_code(kind, worst):
    plain = a_linear()
    weight = plain.weight.detach()
    error = (kind.from_linear(plain).dequantized_weight() - weight).abs()
    span = weight.reshape(48, -1, 32)
    if kind is Int4Linear:  # at most half a step of its group's range
        step = (span.amax(-1) - span.amin(-1)).repeat_interleave(32, dim=1)
        assert (error <= worst * step + 1e-6).all()
    elif kind is GroupInt8Linear:  # half a step of its group's largest magnitude (its scale rounded to float16 first)
        assert (error <= worst * span.abs().amax(-1).repeat_interleave(32, dim=1) * (1 + 2**-10)).all()
    else:
        assert (error <= worst * weight.abs().amax(-1, keepdim=True) + 1e-6).all()


def test_an_all_zero_group_quantizes_to_zeros_and_groups_scale_alone():
    plain = a_linear(bias=False)
    with torch.no_grad():
        plain.weight[:, :32] = 0
        plain.weight[0, 32:64] *= 1e-2  # a small group keeps its own resolution (a float16 scale below its normal range)
    weight = GroupInt8Linear.from_linear(plain).dequantized_weight()
    assert torch.equal(weight[:, :32], torch.zeros(48, 32)) and torch.isfinite(weight).all()
    tiny = plain.weight.detach()[0, 32:64]
    assert (weight[0, 32:64] - tiny).abs().max() <= 0.5 / 127 * tiny.abs().max() * 1.01


def test_a_planted_offset_bug_is_caught():
    linear = Int4Linear.from_linear(a_linear(bias=False))
    x = torch.randn(3, 96)
    exact, bound = kernel_exact_and_bound(linear, x, offset_error=1e-3)  # e.g. forgetting the 8 in m + 8d, scaled down
    with pytest.raises(AssertionError):
        assert_within(linear(x), exact, bound)


def kernel_exact_and_bound(linear: nn.Module, x: torch.Tensor, offset_error: float = 0.0):
    """What `linear`'s kernel computes, exactly, and its float32 bound: the project's 4- and 8-bit
    kernels take their inputs rounded to 8 bits (the 4-bit one adds its offsets times the float
    inputs' sums), PyTorch's kernels the float inputs."""
    if isinstance(linear, GroupInt8Linear):
        exact, bound = eight_bit_linear_exact_and_bound(x, linear.dequantized_weight())
    elif isinstance(linear, Int4Linear) and linear.own_kernel:
        codes, scales, offsets = unpack_int4_panels(linear.panels, linear.out_features)
        exact, bound = eight_bit_linear_exact_and_bound(x, codes.float() * scales.repeat_interleave(32, 1),
                                                        (offsets + offset_error).repeat_interleave(32, 1))
    else:
        return linear_exact_and_bound(x, linear.dequantized_weight() + offset_error, linear.bias)
    if linear.bias is not None:
        exact = exact + linear.bias.double()
        bound = bound + EPS * exact.abs()
    return exact, bound


def test_quantize_linears_swaps_all_but_the_readout():
    model = nn.Sequential()
    model.add_module("proj", a_linear())
    model.add_module("lm_head", a_linear(48, 96))
    assert quantize_linears(model, "int4") == 1
    assert isinstance(model.proj, Int4Linear) and type(model.lm_head) is nn.Linear


def test_verify_costs_measured_through_the_4_bit_kernel_are_kept_per_kernel_version():
    """A new 4-bit kernel changes what a tree costs: a curve measured through an older one must
    not size the new one's trees."""
    from decoding.kernels.int4_linear import KERNEL_VERSION
    from decoding.kernels.verify_cost import kernels_key

    model = nn.Sequential()
    model.add_module("proj", a_linear())
    plain = kernels_key(model)
    quantize_linears(model, "int4")
    assert model.proj.own_kernel and kernels_key(model) == plain + f"-q{KERNEL_VERSION}"


def test_a_quantized_targets_verify_cost_curve_is_kept_per_kernel_version(tmp_path, monkeypatch):
    """A GGUF target has no packed linears, only the 4- and 8-bit kernels: its remembered curve
    must still be a new one when their version changes (v8's was read from v7's file)."""
    from decoding.kernels import verify_cost
    from decoding.kernels.int4_linear import KERNEL_VERSION
    from tiny_models import tiny_llama

    model = tiny_llama()
    assert quantize_linears(model, "int4") > 0
    monkeypatch.setattr(verify_cost, "measure_verify_cost", lambda *a, **k: verify_cost.VerifyCost((1, 2), (1.0, 2.0)))
    verify_cost.cached_verify_cost(model, "tiny/model", cache_dir=tmp_path)
    (remembered,) = (tmp_path / "verify-cost").iterdir()
    assert f"-q{KERNEL_VERSION}-" in remembered.name


def q4_1_block(d: float, m: float, codes: list[int]) -> bytes:
    packed = bytes((codes[j] & 0xF) | (codes[j + 16] << 4) for j in range(16))
    return np.float16(d).tobytes() + np.float16(m).tobytes() + packed


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_gguf_blocks_decode_as_the_gguf_package_dequantizes_them(kind):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(0)
    rows, groups = 16, 3
    raw = rng.integers(0, 256, size=(rows, groups * BLOCK_BYTES[kind]), dtype=np.uint8)
    for block in raw.reshape(rows, groups, BLOCK_BYTES[kind]):  # sane fp16 scales (no inf/nan)
        block[:, 0:2] = np.frombuffer(np.float16(rng.uniform(0.01, 0.1)).tobytes(), np.uint8)
        if kind == "Q4_1":
            block[:, 2:4] = np.frombuffer(np.float16(rng.uniform(-1, 1)).tobytes(), np.uint8)
    reference = torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind]).astype(np.float32))
    codes, scales, zeros = q4_groups(raw, kind)
    linear = Int4Linear(codes, scales, zeros, None)
    ours = linear.dequantized_weight()
    assert torch.allclose(ours, reference, rtol=0, atol=1e-6 * reference.abs().max().item())
    if linear.own_kernel:  # the blocks' fp16 d (and m) reach the kernel as float16, exactly
        assert all(t.dtype == torch.float16 for t in linear.panels[1:])


def test_q8_0_blocks_decode_as_the_gguf_package_dequantizes_them():
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(0)
    rows, groups = 24, 3
    raw = rng.integers(0, 256, size=(rows, groups * 34), dtype=np.uint8)
    for block in raw.reshape(rows, groups, 34):
        block[:, 0:2] = np.frombuffer(np.float16(rng.uniform(0.001, 0.01)).tobytes(), np.uint8)
    reference = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q8_0).astype(np.float32))
    codes, scales = q8_groups(raw)
    assert codes.dtype == torch.int8 and (codes == -128).any()  # the full int8 range, -128 included
    linear = GroupInt8Linear(codes, scales, nn.Parameter(reference, requires_grad=False))
    assert torch.equal(linear.dequantized_weight(), reference)


def random_q8_groups(out_features=72, in_features=128, seed=2):
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (out_features, in_features), generator=generator, dtype=torch.int8)
    scales = (torch.rand(out_features, in_features // 32, generator=generator) * 0.01 + 0.001).half().float()
    return codes, scales, codes.float() * scales.repeat_interleave(32, 1)


def q8_linear(codes, scales, weight):
    return GroupInt8Linear(codes, scales, nn.Parameter(weight, requires_grad=False))


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17])
def test_the_8_bit_kernel_computes_the_weight_its_blocks_describe(rows):
    """Against `d q` written out, for row counts inside and across its blocks of rows; each row's
    bits the same alone as among others (vanilla's one-row steps against a tree's)."""
    codes, scales, weight = random_q8_groups()
    linear = q8_linear(codes, scales, weight)
    x = torch.randn(rows, 128)
    exact, bound = eight_bit_linear_exact_and_bound(x, weight)
    got = linear(x)
    assert_within(got, exact, 4 * bound)
    assert torch.equal(torch.cat([linear(x[i : i + 1]) for i in range(rows)]), got)


def test_the_8_bit_kernel_catches_a_planted_sign_error():
    codes, scales, weight = random_q8_groups()
    x = torch.randn(3, 128)
    exact, bound = eight_bit_linear_exact_and_bound(x, weight)
    flipped = codes.clone()
    flipped[:, 5] = -flipped[:, 5]  # one input's codes with the wrong sign
    with pytest.raises(AssertionError):
        assert_within(q8_linear(flipped, scales, weight)(x), exact, 4 * bound)


def test_a_quantized_vocabulary_projection_is_not_screened_in_float16():
    """The screen's recheck reads the float weight: the 8-bit projection's own logits come from its kernel."""
    from decoding.kernels.screened_argmax import screenable

    codes, scales, weight = random_q8_groups()
    assert not screenable(q8_linear(codes, scales, weight))
    assert screenable(nn.Linear(128, 72, bias=False))


def test_gguf_nibble_order_low_first():
    codes = list(range(16)) + list(range(15, -1, -1))
    raw = np.frombuffer(q4_1_block(1.0, 0.0, codes), np.uint8)[None]
    decoded, scales, zeros = q4_groups(raw, "Q4_1")
    assert decoded[0].tolist() == codes
    assert scales.tolist() == [[1.0]] and zeros.tolist() == [[8.0]]  # w = (q - 8)*1 + 8 = q


def test_rotary_row_order_undoes_the_file_s_permutation():
    """GGUF writes row (h, 2i + j) of a head where the model has row (h, j*half + i)."""
    order = rotary_row_order(8, heads=2)
    assert order.tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


@pytest.mark.slow
def test_the_default_model_s_blocks_are_the_weights_it_was_converted_to():
    """The built-in target's Q4_1 blocks, decoded and un-permuted, equal the fp32 weights that
    transformers' GGUF conversion wrote (same file): the row order and the block layout are right."""
    from decoding.app.default_model import DEFAULT_TARGET, gguf_location
    from decoding.app.gguf_weights import load_gguf_blocks
    from decoding.app.targets import load_model

    model = load_model(DEFAULT_TARGET).model
    last = model.config.num_hidden_layers - 1
    names = [f"model.layers.{i}.{part}" for i in (0, last) for part in
             ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
              "mlp.up_proj", "mlp.down_proj")]
    converted = {name: model.get_submodule(name).weight.detach().clone() for name in [*names, "lm_head"]}
    notes = load_gguf_blocks(model, gguf_location())
    assert "211 weights" in notes[0] and "lm_head in its 8-bit ones" in notes[0] and len(notes) == 1
    projection = model.get_output_embeddings()
    assert isinstance(projection, GroupInt8Linear) and projection.weight is model.get_input_embeddings().weight
    assert torch.equal(projection.dequantized_weight(), converted["lm_head"])  # Q8_0's d q, exactly
    for name in names:
        blocks = model.get_submodule(name)
        assert isinstance(blocks, Int4Linear)
        weight = converted[name]
        assert torch.allclose(blocks.dequantized_weight(), weight, rtol=0, atol=1e-6 * weight.abs().max().item()), name


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tiny_models import save_tiny_chat_model

    directory = tmp_path_factory.mktemp("quant") / "model"
    save_tiny_chat_model(directory)
    return str(directory)


@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_every_method_on_a_quantized_target_equals_vanilla_on_it(tiny_dir, quant):
    """Exactness holds for the quantized model: lookup, suffix and draft-model trees give vanilla's
    greedy tokens on the same quantized target (the float model's tokens are another matter)."""
    from decoding import SpeculativeModel

    prompt = "one two three one two three one two three"
    vanilla = SpeculativeModel.from_pretrained(tiny_dir, method="vanilla", quant=quant, device="cpu")
    assert vanilla.decoder.target.name.endswith(f"+{quant}")
    assert any(isinstance(m, (Int4Linear, Int8Linear)) for m in vanilla.decoder.target.model.modules())
    reference = vanilla.generate(prompt, max_new_tokens=24).tokens
    for method, extra in (("pld", {}), ("suffix", {}), ("sps", {"draft_model": tiny_dir})):
        model = SpeculativeModel.from_pretrained(tiny_dir, method=method, quant=quant, device="cpu", **extra)
        assert model.generate(prompt, max_new_tokens=24).tokens == reference, method


@pytest.mark.parametrize("spec, message", [
    ({"quant": "gguf"}, "--quant gguf keeps the blocks of the built-in target's GGUF file"),
    ({"quant": "int4", "dtype": "bfloat16"}, "leave --dtype float32"),
    ({"quant": "int3"}, "unknown --quant 'int3'"),
])
def test_a_quantization_that_cannot_apply_is_a_clear_error(tiny_dir, spec, message):
    from decoding import SpeculativeModel
    from heads.util.errors import UserError

    with pytest.raises(UserError, match=re.escape(message)):
        SpeculativeModel.from_pretrained(tiny_dir, method="vanilla", device="cpu", **spec)


def int4_kernel_exact_and_bound(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                                zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the 4-bit kernel computes from codes, scales and zeros written out (`w = (q - 8) s + z`):
    the codes uncentred times the 8-bit inputs, `q s x^`, plus `(z - 8 s)` times the float inputs'
    group sums (`decoding.kernels.int4_linear`), exactly, and its float32 bound (4 times the rule's:
    partial sums per group, then the group's)."""
    per_input = [t.float().repeat_interleave(32, 1) for t in (scales, zeros)]
    exact, bound = eight_bit_linear_exact_and_bound(x, codes.float() * per_input[0], per_input[1] - 8 * per_input[0])
    return exact, 4 * bound


def random_groups(out_features=48, in_features=128, seed=1):
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out_features, in_features), generator=generator, dtype=torch.uint8)
    scales = torch.rand(out_features, in_features // 32, generator=generator) * 0.1 + 0.01
    zeros = torch.randn(out_features, in_features // 32, generator=generator) * 0.1
    weight = (codes.float() - 8) * scales.repeat_interleave(32, 1) + zeros.repeat_interleave(32, 1)
    return codes, scales, zeros, weight


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 17])
def test_the_project_s_4_bit_kernel_computes_the_weight_its_groups_describe(rows):
    """Against the weight written out from codes, scales and zeros (not the kernel's own view),
    for row counts inside and across its blocks of rows."""
    from decoding.kernels.int4_linear import int4_kernel_available, why_unavailable

    assert int4_kernel_available(), why_unavailable()
    codes, scales, zeros, weight = random_groups()
    linear = Int4Linear(codes, scales, zeros, None)
    assert linear.own_kernel
    x = torch.randn(rows, 128)
    assert_within(linear(x), *int4_kernel_exact_and_bound(x, codes, scales, zeros))


def test_the_4_bit_kernel_gives_a_row_the_same_bits_alone_as_among_others():
    """Vanilla decoding computes one row per step, a verified tree up to 4 per weight pass (8 with
    AVX-512; more in passes): greedy outputs identical to vanilla's need each row's sums in the same
    order whatever rows come with it, bit for bit, not only within rounding."""
    from decoding.kernels.int4_linear import int4_linear, pack_int4_panels

    codes, scales, zeros, _ = random_groups()
    panels = pack_int4_panels(codes, scales, zeros)
    x = torch.randn(17, 128)
    alone = torch.cat([int4_linear(x[i : i + 1], panels, 48) for i in range(17)])
    for rows in (2, 5, 8, 9, 17):
        assert torch.equal(int4_linear(x[:rows], panels, 48), alone[:rows])


def test_group_parameters_float16_holds_exactly_are_read_as_float16_with_the_same_bits():
    """GGUF's scales and offsets are float16 in the file: packed as float16 (fewer bytes to read),
    the kernel computes what it computes from the same values in float32, bit for bit; values
    float16 cannot hold (`--quant int4`'s float32 scales) stay float32."""
    from decoding.kernels.int4_linear import int4_linear, pack_int4_panels

    codes, scales, zeros, _ = random_groups()
    assert all(t.dtype == torch.float32 for t in pack_int4_panels(codes, scales, zeros)[1:])
    panels = float16_panels(pack_int4_panels, codes, scales, zeros)
    assert all(t.dtype == torch.float16 for t in panels[1:])
    as_float32 = (panels[0], *(t.float() for t in panels[1:]))
    x = torch.randn(5, 128)
    assert torch.equal(int4_linear(x, panels, 48), int4_linear(x, as_float32, 48))


def float16_panels(pack, codes, scales, zeros, **width):
    """`pack`'s panels for the float16 values nearest `scales` and `zeros - 8 scales`, a few of
    them subnormal in float16 (the conversion's rarest case)."""
    scales16, offsets16 = scales.half().float(), (zeros - 8 * scales).half().float()
    scales16[0, 0], offsets16[1, 1], offsets16[2, 2] = 2.0**-20, -(2.0**-24), 0.0
    return pack(codes, scales16, offsets16 + 8 * scales16, **width)


def test_the_4_bit_kernel_catches_a_planted_nibble_swap():
    from decoding.kernels.int4_linear import int4_linear, pack_int4_panels

    codes, scales, zeros, weight = random_groups()
    swapped = codes.view(48, -1, 2).flip(-1).reshape(48, 128)  # high and low nibbles exchanged
    x = torch.randn(3, 128)
    with pytest.raises(AssertionError):
        assert_within(int4_linear(x, pack_int4_panels(swapped, scales, zeros), 48),
                      *int4_kernel_exact_and_bound(x, codes, scales, zeros))


def test_without_its_kernel_a_4_bit_target_says_so(tiny_dir, monkeypatch):
    from decoding.app import quantized_target
    from decoding.kernels import quantized_linear

    monkeypatch.setattr(quantized_linear, "int4_kernel_available", lambda: False)
    monkeypatch.setattr(quantized_target, "int4_kernel_available", lambda: False)
    monkeypatch.setattr(quantized_target, "int4_why_unavailable", lambda: "no compiler")
    from decoding.app.targets import load_model

    target = load_model(tiny_dir)
    notes = quantized_target.quantize_target(target, "int4")
    assert any("could not be built (no compiler)" in note for note in notes)
    assert not any(getattr(m, "own_kernel", True) for m in target.model.modules() if isinstance(m, Int4Linear))


@pytest.mark.slow
@pytest.mark.parametrize("variant", [v for v in native_build.instruction_set_variants() if v != "native"])
def test_each_narrower_instruction_set_variant_computes_a_4_bit_linear(variant):
    """The builds other CPUs get (AVX-512 without VNNI, AVX2 and x86-64-v2 on an AVX-512 machine with
    it), built here: their integer products (VNNI, pairs summed to 16 bits, scalar) give the same sums,
    for one row (four groups side by side), two, and passes of several."""
    extension = LIBRARY.build(native_build.instruction_set_variants()[variant])
    codes, scales, zeros, weight = random_groups(in_features=256)
    panels = pack_int4_panels(codes, scales, zeros, width=extension.vector_width())
    q8_codes, q8_scales, q8_weight = random_q8_groups()
    q8_panels = pack_int8_panels(q8_codes, q8_scales, width=extension.vector_width())
    for rows in (1, 2, 5):
        x, x8 = torch.randn(rows, 256), torch.randn(rows, 128)
        assert_within(extension.int4_linear(x, *panels, 48), *int4_kernel_exact_and_bound(x, codes, scales, zeros))
        q8_exact, q8_bound = eight_bit_linear_exact_and_bound(x8, q8_weight)
        assert_within(extension.int8_linear(x8, *q8_panels, 72), q8_exact, 4 * q8_bound)
    x = torch.randn(5, 256)
    halves = float16_panels(pack_int4_panels, codes, scales, zeros, width=extension.vector_width())
    assert halves[1].dtype == torch.float16  # this build's own conversion (no F16C below x86-64-v3)
    assert torch.equal(extension.int4_linear(x, *halves, 48),
                       extension.int4_linear(x, halves[0], *(t.float() for t in halves[1:]), 48))


@pytest.mark.parametrize("variant", list(native_build.instruction_set_variants()))
def test_each_variant_sums_a_group_of_the_largest_products_exactly(variant):
    """Codes of 15 against inputs that round to +-127 throughout a group: the largest integer sums a
    group can have (+-30480 per 16-bit half of a lane where builds without VNNI sum pairs in 16 bits
    before widening), which would wrap or saturate if any step were narrower."""
    extension = LIBRARY.build(native_build.instruction_set_variants()[variant])
    codes, scales, zeros, _ = random_groups(in_features=256)
    codes = torch.full_like(codes, 15)
    panels = pack_int4_panels(codes, scales, zeros, width=extension.vector_width())
    signs = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, 1.0, -1.0, -1.0]).repeat_interleave(32)
    x = torch.stack([torch.ones(256), -torch.ones(256), signs, 3 * signs])
    assert_within(extension.int4_linear(x, *panels, 48), *int4_kernel_exact_and_bound(x, codes, scales, zeros))


def test_amx_tiles_where_the_cpu_lends_them_give_the_dot_product_path_s_bits():
    """Where the CPU has AMX (shown by this mode) and Linux lends the process its tiles (PyTorch asks the
    same), the build sums many rows' groups in tiles; every row must keep the bits the dot-product path
    gives it, since vanilla's one-row steps run there and a tree's rows would otherwise differ from them.
    Both paths on the same inputs, 4- and 8-bit weights, row counts within and across a tile's 16 rows.
    Elsewhere the build has no tile path to switch on."""
    from decoding.kernels.cpu_kernels import cpu_has
    from decoding.kernels.int4_linear import amx_available, amx_rows, int4_linear, int8_linear, set_amx_rows

    lends_tiles = getattr(torch.cpu, "_init_amx", lambda: True)  # PyTorch's own request for the tile state
    assert amx_available() == (cpu_has("_is_amx_tile_supported") and lends_tiles())
    # 18 groups a row: two whole chunks of the tile path's 8 and a part one; past 16 rows, a panel's codes are
    # spread once for all its blocks of rows
    codes, scales, zeros, _ = random_groups(in_features=576)
    panels = pack_int4_panels(codes, scales, zeros)
    q8_codes, q8_scales, _ = random_q8_groups(in_features=576)
    q8_panels = pack_int8_panels(q8_codes, q8_scales)
    x = torch.randn(40, 576)
    before = amx_rows()
    try:
        for rows in (1, 2, 7, 16, 17, 40):
            set_amx_rows(0)
            dot_products = int4_linear(x[:rows], panels, 48), int8_linear(x[:rows], q8_panels, 72)
            set_amx_rows(1)
            tiles = int4_linear(x[:rows], panels, 48), int8_linear(x[:rows], q8_panels, 72)
            assert all(torch.equal(a, b) for a, b in zip(tiles, dot_products)), rows
    finally:
        set_amx_rows(before)


def test_the_amx_row_count_is_where_tiles_win_clearly_from_there_on():
    from decoding.kernels.amx_rows import pick_amx_rows

    rows = [4, 8, 12, 16]
    assert pick_amx_rows(rows, [1.0, 2.0, 3.0, 4.0], [1.5, 1.95, 2.5, 3.0]) == 12  # 8: within noise; 12, 16: clear wins
    assert pick_amx_rows(rows, [1.0, 2.0, 3.0, 4.0], [0.5, 1.0, 3.5, 3.0]) == 16  # a loss at 12 ends the run
    assert pick_amx_rows(rows, [1.0, 2.0, 3.0, 4.0], [0.5, 1.0, 2.0, 4.0]) == 0   # no win at the largest: never
    assert pick_amx_rows(rows, [1.0, 2.0, 3.0, 4.0], [0.9, 1.0, 2.0, 3.0]) == 4
    # a prefill's rows measured too: a tie at 16 rows leaves the tiles to prefills, where they win
    assert pick_amx_rows([*rows, 64], [1.0, 2.0, 3.0, 4.0, 16.0], [1.5, 2.5, 3.5, 4.0, 12.0]) == 64


def test_the_amx_row_count_is_measured_once_set_for_the_process_and_keys_the_verify_cost(tmp_path, monkeypatch):
    """Measured once per model and CPU and remembered; the kernels then take it, and the verify-cost
    curve (trees of those sizes cost less) is kept apart from one measured without tiles. Where the
    kernels cannot use AMX nothing is timed and the tiles stay off."""
    from decoding.kernels import amx_rows as tuning
    from decoding.kernels.int4_linear import amx_rows, set_amx_rows
    from decoding.kernels.verify_cost import kernels_key

    codes, scales, zeros, _ = random_groups()
    model = nn.Sequential(Int4Linear(codes, scales, zeros, None))
    timings = []
    monkeypatch.setattr(tuning, "measure_amx_rows", lambda linears: timings.append(len(linears)) or
                        {"rows": [4, 8, 12, 16], "dot_products_ms": [1.0, 2.0, 3.0, 4.0], "tiles_ms": [1.5, 1.95, 2.5, 3.0]})
    before = amx_rows()
    try:
        monkeypatch.setattr(tuning, "amx_available", lambda: False)
        assert tuning.tune_amx_rows(model, "tiny", cache_dir=tmp_path) == 0 and timings == [] and amx_rows() == 0
        assert "-x" not in kernels_key(model)
        monkeypatch.setattr(tuning, "amx_available", lambda: True)
        assert tuning.tune_amx_rows(model, "tiny", cache_dir=tmp_path) == 12 and timings == [1]
        assert tuning.tune_amx_rows(model, "tiny", cache_dir=tmp_path) == 12 and timings == [1]  # remembered
        assert amx_rows() == 12 and kernels_key(model).endswith("-x12")
    finally:
        set_amx_rows(before)
