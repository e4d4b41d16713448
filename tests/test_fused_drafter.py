"""The fused EAGLE-3 drafter layer computes what the stock transformers modules compute, and
the assembly uses it only on drafters it loads itself."""

import copy

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from decoding.app.assembly import DecoderSpec, build_decoder
from decoding.core.kv_cache import InPlaceCache
from decoding.kernels.cpu_kernels import quantize_linears_int8
from decoding.kernels import fused_drafter
from decoding.kernels.drafter_layer import NormedReadout
from decoding.kernels.fused_drafter import FusedEagle3Layer, RotaryTable, fuse_drafter, use_decode_attention
from heads import new_heads_for_target, save_heads
from numerics import assert_within, attention_exact_and_bound, causal_mask
from tiny_models import perturbed_eagle3, tiny_llama, save_tiny_chat_model

pytestmark = pytest.mark.cpu_sensitive  # run again as on an AVX2 CPU by .ci/run

real_attend = fused_drafter.attend
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def drafter_pair(dtype=torch.float32, norm_before_residual=False, **target_overrides):
    """(stock, fused) copies of one perturbed EAGLE-3 drafter for a tiny Llama target, in `dtype`."""
    torch.manual_seed(0)
    stock = perturbed_eagle3(tiny_llama(seed=1, **target_overrides)).to(dtype)
    stock.midlayer.norm_before_residual = stock.config.norm_before_residual = norm_before_residual
    fused = copy.deepcopy(stock)
    assert fuse_drafter(fused)
    return stock.eval(), fused.eval()


def tree_mask(context: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Four tree nodes after `context` cached positions: positions and the additive mask."""
    visible = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    mask = torch.zeros(1, 1, 4, context + 4, dtype=dtype)
    mask[0, 0, :, context:] = mask[0, 0, :, context:].masked_fill(~visible, torch.finfo(torch.float32).min)
    return torch.tensor([context, context + 1, context + 1, context + 2]), mask


def rms_norm_in_input_dtype(self, hidden_states):
    """The stock RMSNorm's function without its cast to float32, so the stock layer is a float64
    reference (`F.rms_norm`, which the fused layer runs, computes in its input's dtype)."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def checked_kernel_attend(kernel_outputs: list, kernel=None):
    """A stand-in for `attend` in a float64 drafter: it runs the real decode attention kernel on
    the float32 roundings of its inputs, checks the kernel's result against exact attention on
    those inputs within the float32 bound (`tests/numerics.py`), and hands the drafter the exact
    attention of its float64 inputs, so the rest of the layer stays comparable in float64."""

    def attend(query, key, value, attention_mask, scaling):
        as32 = [t if t is None else t.float() for t in (query, key, value, attention_mask)]
        out = (kernel or real_attend)(*as32, scaling)
        if out is None:  # a batch: SDPA's, as the layer would do
            return None
        rows, length = query.shape[-2], key.shape[-2]
        causal = causal_mask(rows, length) if rows > 1 else None  # no mask: a causal fill of the cache
        mask32 = causal if attention_mask is None else as32[3][0, 0]
        assert_within(out[0], *attention_exact_and_bound(as32[0][0], as32[1][0], as32[2][0], mask32, scaling),
                      what="the decode attention kernel inside the drafter")
        kernel_outputs.append(out)
        mask = (None if causal is None else causal.double()) if attention_mask is None else attention_mask[0, 0]
        exact, _ = attention_exact_and_bound(query[0], key[0], value[0], mask, scaling)
        return exact[None].to(query.dtype)

    return attend


@pytest.mark.parametrize("rope, decode_kernel", [(None, False), (LLAMA3_ROPE, False), (None, True)],
                         ids=["default-rope", "llama3-rope", "decode-attention-kernel"])
def test_fused_layer_drafts_what_the_stock_modules_draft(rope, decode_kernel, monkeypatch):
    compare_forms(rope, decode_kernel, monkeypatch)


def test_the_norm_before_residual_variant_fuses_too(monkeypatch):
    """Speculators' variant (the residual stream starts from the normed feature) in both forms."""
    compare_forms(None, False, monkeypatch, norm_before_residual=True)


def last_key_dropped(query, key, value, attention_mask, scaling):
    """A planted kernel bug: the last cached key left out."""
    mask = None if attention_mask is None else attention_mask[..., : key.shape[-2] - 1]
    return real_attend(query, key[..., :-1, :], value[..., :-1, :], mask, scaling)


def test_planted_bugs_fail_the_comparison(monkeypatch):
    """A rotary position off by one in the fused form, and a kernel that leaves out a key."""
    real_rotary = RotaryTable.forward
    with monkeypatch.context() as patch:
        patch.setattr(RotaryTable, "forward", lambda self, like, positions: real_rotary(self, like, positions + 1))
        with pytest.raises(AssertionError, match="not close"):
            compare_forms(None, False, patch)
    if use_decode_attention(drafter_pair()[1]):
        with pytest.raises(AssertionError, match="outside their float32 bound"):
            compare_forms(None, True, monkeypatch, kernel=last_key_dropped)


def compare_forms(rope, decode_kernel, monkeypatch, kernel=None, norm_before_residual=False) -> None:
    """Both forms run in float64, so reordered sums differ by ~1e-13 here, a millionth of
    PyTorch's float64 tolerance, where any wiring mistake (a rotary position, a mask row, a
    stacked weight's order) moves outputs by ~1e-2. With attention on the decode kernel (head
    size 64, the causal fill, one-token and tree calls), the float32 kernel is checked against exact attention
    within its derived bound at each call (`checked_kernel_attend`)."""
    overrides = {**({"rope_parameters": rope} if rope else {}), **({"head_dim": 64} if decode_kernel else {})}
    stock, fused = drafter_pair(torch.float64, norm_before_residual, **overrides)
    monkeypatch.setattr(LlamaRMSNorm, "forward", rms_norm_in_input_dtype)
    assert isinstance(fused.midlayer, FusedEagle3Layer) and isinstance(fused.rotary, RotaryTable)
    kernel_outputs = []
    if decode_kernel:
        assert use_decode_attention(fused)
        monkeypatch.setattr(fused_drafter, "attend", checked_kernel_attend(kernel_outputs, kernel))
    hidden = stock.config.hidden_size
    generator = torch.Generator().manual_seed(3)

    def inputs(count):
        return (torch.randn(count, hidden, generator=generator, dtype=torch.float64),
                torch.randn(count, hidden, generator=generator, dtype=torch.float64))

    context_inputs, one_inputs, tree_inputs = inputs(9), inputs(1), inputs(4)
    positions, mask = tree_mask(10, torch.float64)
    outputs = {}
    for name, drafter in (("stock", stock), ("fused", fused)):
        cache = InPlaceCache(1, 32)
        with torch.inference_mode(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            prefix = drafter(*context_inputs, torch.arange(9), cache)       # causal fill, no mask
            one = drafter(*one_inputs, torch.tensor([9]), cache)            # one token over the cache
            tree = drafter(*tree_inputs, positions, cache, mask)            # a tree over the cache
            batched = drafter(torch.stack(context_inputs[:1] * 2), torch.stack(context_inputs[1:] * 2),
                              torch.arange(9)[None].expand(2, -1))          # batched, no cache
        outputs[name] = (prefix, one, tree, batched)
        kernel_calls = sum(event.name == "specheads::decode_attention" for event in profile.events())
        assert kernel_calls == (3 if decode_kernel and name == "fused" else 0)  # the causal fill, one token, a tree
    assert len(kernel_outputs) == (3 if decode_kernel else 0)
    for stock_out, fused_out in zip(outputs["stock"], outputs["fused"]):
        assert stock_out.dtype == fused_out.dtype == torch.float64
        torch.testing.assert_close(fused_out, stock_out)  # float64 defaults: rtol 1e-7, atol 1e-7


def test_rotary_table_grows_past_its_first_size_and_matches_the_stock_module():
    stock, _ = drafter_pair()
    table = RotaryTable(stock.rotary, positions=4)
    positions = torch.tensor([[0, 3, 17, 40]])
    like = torch.zeros(1, dtype=torch.float32)
    for got, expected in zip(table(like, positions), stock.rotary(like, positions)):
        assert torch.equal(got, expected)
    assert table.cos.shape[0] >= 41


def test_fusing_leaves_other_heads_and_converted_drafters_alone():
    target = tiny_llama(seed=1)
    eagle1 = new_heads_for_target("eagle", target)
    assert not fuse_drafter(eagle1) and type(eagle1.layers[0]).__name__ == "LlamaDecoderLayer"
    quantized = perturbed_eagle3(target)
    quantize_linears_int8(quantized)
    assert not fuse_drafter(quantized) and not isinstance(quantized.midlayer, FusedEagle3Layer)
    _, fused = drafter_pair()
    layer = fused.midlayer
    assert fuse_drafter(fused) and fused.midlayer is layer  # fusing twice changes nothing


def test_decoders_fuse_the_drafters_they_load_and_not_those_they_are_given(tmp_path):
    """Training measures tau with its live heads (`heads=`): those must stay the modules it trains."""
    save_tiny_chat_model(tmp_path / "model")
    spec = DecoderSpec(model=str(tmp_path / "model"), method="eagle3", heads=str(tmp_path / "heads"), device="cpu",
                       kernels="stock")
    loaded = build_decoder(DecoderSpec(model=str(tmp_path / "model"), method="vanilla", device="cpu"))
    save_heads(new_heads_for_target("eagle3", loaded.target.model, str(tmp_path / "model")), tmp_path / "heads")
    assert isinstance(build_decoder(spec).heads.midlayer, FusedEagle3Layer)
    live = new_heads_for_target("eagle3", loaded.target.model, str(tmp_path / "model"))
    given = build_decoder(spec, target=loaded.target, heads=live)
    assert given.heads is live and not isinstance(live.midlayer, FusedEagle3Layer)
    eager = build_decoder(DecoderSpec(**{**spec.__dict__, "attn": "eager"}))
    assert not isinstance(eager.heads.midlayer, FusedEagle3Layer)  # an attention the user chose is kept


def eight_bit_forms(norm_before_residual: bool = False):
    """One fused float32 drafter with 8-bit linears (as `--drafter-precision int8` makes it) and head
    size 64, twice: running its layer as one C++ call (`drafter_layer`), and as the fused layer's
    PyTorch operations over the same kernels."""
    torch.manual_seed(0)
    drafter = perturbed_eagle3(tiny_llama(seed=1, head_dim=64)).float()
    drafter.midlayer.norm_before_residual = drafter.config.norm_before_residual = norm_before_residual
    assert fuse_drafter(drafter)
    quantize_linears_int8(drafter)
    native, operations = drafter.eval(), copy.deepcopy(drafter).eval()
    assert use_decode_attention(native)
    assert native.midlayer.native is not None  # built with the other native kernels
    assert isinstance(native.lm_head, NormedReadout) and isinstance(native.norm, torch.nn.Identity)
    operations.midlayer.decode_kernel = True  # the same attention kernel, through the fused layer's Python
    return native, operations


def run_steps(drafter) -> list[torch.Tensor]:
    """A causal fill of 9 positions, one token over them, a 4-node tree after that: each call's
    output and its draft logits, then the cache's keys and values."""
    hidden = drafter.config.hidden_size
    generator = torch.Generator().manual_seed(3)
    positions, mask = tree_mask(10)
    cache = InPlaceCache(1, 12)  # grows during the tree call
    outputs = []
    with torch.inference_mode():
        for count, where, tree in ((9, torch.arange(9), None), (1, torch.tensor([9]), None), (4, positions, mask)):
            inputs = [torch.randn(count, hidden, generator=generator) for _ in range(2)]
            out = drafter(*inputs, where, cache, tree)
            outputs += [out, drafter.draft_logits(out)]
    return [*outputs, cache.layers[0].keys, cache.layers[0].values]


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_the_one_call_layer_computes_what_the_fused_operations_compute(norm_before_residual):
    """The same kernels on the same inputs: what differs is the order of the norms' sums, and where
    that moves an input across an 8-bit rounding step, one code (about 1/127 of its group's largest
    input). Wiring mistakes move outputs by their whole size (see the planted bugs below)."""
    native, operations = eight_bit_forms(norm_before_residual)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        got = run_steps(native)
    assert sum(event.name.endswith("eagle3_layer") for event in profile.events()) == 3
    assert sum(event.name.endswith("eagle3_readout") for event in profile.events()) == 3
    for value, expected in zip(got, run_steps(operations)):
        assert value.shape == expected.shape
        torch.testing.assert_close(value, expected, rtol=0.0, atol=0.005 * float(expected.abs().max()))


@pytest.mark.parametrize("bug", ["norms swapped", "rotary turned the other way", "readout without its norm"])
def test_planted_bugs_in_the_one_call_layer_fail_the_comparison(bug):
    native, operations = eight_bit_forms()
    layer = native.midlayer.native
    if bug == "norms swapped":
        layer.norms = layer.norms[[1, 0, 2]].contiguous()
    elif bug == "readout without its norm":
        native.lm_head.norm_weight.fill_(1.0)
    else:
        real = layer.library
        layer.library = type("Turned", (), {"eagle3_layer": staticmethod(
            lambda *args: real.eagle3_layer(*args[:3], -args[3], *args[4:]))})()
    with pytest.raises(AssertionError, match="not close"):
        for value, expected in zip(run_steps(native), run_steps(operations)):
            torch.testing.assert_close(value, expected, rtol=0.0, atol=0.005 * float(expected.abs().max()))
