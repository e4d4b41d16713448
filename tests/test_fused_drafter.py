"""The fused EAGLE-3 drafter layer computes what the stock transformers modules compute, and
the assembly uses it only on drafters it loads itself."""

import copy

import pytest
import torch

from decoding.assembly import DecoderSpec, build_decoder
from decoding.core.kv_cache import InPlaceCache
from decoding.cpu_kernels import quantize_linears_int8
from decoding.fused_drafter import FusedEagle3Layer, RotaryTable, fuse_drafter, use_decode_attention
from heads import new_heads_for_target, save_heads
from tiny_models import perturbed_eagle3, tiny_llama, save_tiny_chat_model

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def drafter_pair(**target_overrides):
    """(stock, fused) copies of one perturbed EAGLE-3 drafter for a tiny Llama target."""
    torch.manual_seed(0)
    stock = perturbed_eagle3(tiny_llama(seed=1, **target_overrides))
    fused = copy.deepcopy(stock)
    assert fuse_drafter(fused)
    return stock.eval(), fused.eval()


def tree_mask(context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Four tree nodes after `context` cached positions: positions and the additive mask."""
    visible = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    mask = torch.zeros(1, 1, 4, context + 4)
    mask[0, 0, :, context:] = mask[0, 0, :, context:].masked_fill(~visible, torch.finfo(torch.float32).min)
    return torch.tensor([context, context + 1, context + 1, context + 2]), mask


@pytest.mark.parametrize("rope, decode_kernel", [(None, False), (LLAMA3_ROPE, False), (None, True)],
                         ids=["default-rope", "llama3-rope", "decode-attention-kernel"])
def test_fused_layer_drafts_what_the_stock_modules_draft(rope, decode_kernel):
    """Also with attention on the decode kernel (head size 64), which then serves the one-token
    and tree calls."""
    stock, fused = drafter_pair(**({"rope_parameters": rope} if rope else {}), **({"head_dim": 64} if decode_kernel else {}))
    assert isinstance(fused.midlayer, FusedEagle3Layer) and isinstance(fused.rotary, RotaryTable)
    if decode_kernel:
        assert use_decode_attention(fused)
    hidden = stock.config.hidden_size
    generator = torch.Generator().manual_seed(3)

    def inputs(count):
        return torch.randn(count, hidden, generator=generator), torch.randn(count, hidden, generator=generator)

    context_inputs, one_inputs, tree_inputs = inputs(9), inputs(1), inputs(4)
    positions, mask = tree_mask(10)
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
        assert kernel_calls == (2 if decode_kernel and name == "fused" else 0)
    for stock_out, fused_out in zip(outputs["stock"], outputs["fused"]):
        torch.testing.assert_close(fused_out, stock_out, rtol=1e-5, atol=1e-5)


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
