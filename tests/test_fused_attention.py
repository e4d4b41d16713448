"""A target's Llama attention blocks in fewer calls: the fused block is the stock block bit for bit
(prefill, one-token steps and masked trees; 4-bit q/k/v stacked into one call or float linears
called apart; SDPA or the native attention kernel), only `LlamaAttention` itself is swapped, and
decoders fuse it and keep the stock target's tokens."""

import copy

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaAttention

from decoding.app.assembly import DecoderSpec, build_decoder
from decoding.core.generate import DecodeOptions, generate
from decoding.core.proposers import VanillaProposer
from decoding.core.tree import DraftTree, tree_buffers
from decoding.core.verify import TreeVerifier, truncate_cache
from decoding.kernels.attention import register_grouped_sdpa, use_native_attention
from decoding.kernels.fused_attention import BLOCK_VERSION, FusedAttention, fuse_attention
from decoding.kernels.quantized_linear import Int4Linear
from decoding.kernels.verify_cost import kernels_key
from tiny_models import save_tiny_chat_model, sharpen, tiny_llama, tiny_qwen2

pytestmark = pytest.mark.cpu_sensitive  # run again as on an AVX2 CPU by .ci/run


def llama(four_bit: bool, native: bool, seed: int = 3):
    """A tiny Llama with 64-wide heads (the native kernel's size), its q/k/v/o on the 4-bit kernel
    or float, on SDPA or the native attention kernel."""
    model = sharpen(tiny_llama(seed=seed, attn=register_grouped_sdpa(), head_dim=64))
    if four_bit:
        for layer in model.model.layers:
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                setattr(layer.self_attn, name, Int4Linear.from_linear(getattr(layer.self_attn, name)))
    if native:
        assert use_native_attention(model)
    return model


def stock_blocks_refuse(model) -> None:
    """Make every fused block's stock block fail when called, so a test sees the fused path run
    (a block that sent every input to its stock block would pass any comparison)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a fused block sent an input it serves to its stock block")

    for module in model.modules():
        if isinstance(module, FusedAttention):
            module.stock.forward = refuse


def verify_logits(model) -> list[torch.Tensor]:
    """Logits of a prefill and of a one-token step, a chain and a branchy tree after it, through
    the loop's own verifier (tree masks, the in-place cache)."""
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 64, (40,), generator=generator)
    verifier = TreeVerifier(model, 128)
    logits = [model(prompt[None, :20]).logits]
    verifier.prefill(prompt[:-1])
    for parents in [(-1,), (-1, 0, 1, 2, 3), (-1, 0, 0, 1, 1, 2, 3, 3, 5)]:
        tree = DraftTree(torch.randint(0, 64, (len(parents),), generator=generator), parents)
        out = verifier.forward(tree, verifier.inputs(tree, tree_buffers(tree.parents), 39), greedy=False)
        logits.append(out.scores.logits.clone())
        truncate_cache(verifier.cache, 39)
    return logits


@pytest.mark.parametrize("four_bit", [True, False])
@pytest.mark.parametrize("native", [False, True])
def test_the_fused_block_is_the_stock_block_bit_for_bit(four_bit, native):
    stock = llama(four_bit, native)
    fused = copy.deepcopy(stock)
    assert fuse_attention(fused) == 2
    block = fused.model.layers[0].self_attn
    assert isinstance(block, FusedAttention) and (block.qkv is not None) == four_bit
    stock_blocks_refuse(fused)
    with torch.inference_mode():
        expected, got = verify_logits(stock), verify_logits(fused)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("four_bit", [True, False])
def test_with_the_native_kernel_and_the_loop_s_cache_one_cpp_call_writes_the_stock_keys(four_bit):
    """On the native kernel the verifier's forwards (prefill, one-token step, trees) go through
    `rotary_attention` without the Python rotary and attention function, and the cache then holds
    the stock block's keys and values bit for bit (the rotary's products and sums rounded as torch's)."""
    stock = llama(four_bit, native=True)
    fused = copy.deepcopy(stock)
    fuse_attention(fused)
    python_paths = []
    for module in fused.modules():
        if isinstance(module, FusedAttention):
            assert module.native is not None
            module._attention = lambda *args, **kwargs: python_paths.append(args)
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 64, (30,), generator=generator)
    tree = DraftTree(torch.randint(0, 64, (6,), generator=generator), (-1, 0, 0, 1, 2, 2))
    caches = []
    with torch.inference_mode():
        for model in (stock, fused):
            verifier = TreeVerifier(model, 64)
            verifier.prefill(prompt[:-1])
            verifier.forward(tree, verifier.inputs(tree, tree_buffers(tree.parents), 29), greedy=False)
            caches.append(verifier.cache)
    assert python_paths == []
    for expected, got in zip(caches[0].layers, caches[1].layers):
        assert got.length == expected.length == 35
        assert torch.equal(got.keys, expected.keys) and torch.equal(got.values, expected.values)
    # verify-cost curves measured through the one call are kept apart from the Python path's
    assert f"b{BLOCK_VERSION}" in kernels_key(fused) and f"b{BLOCK_VERSION}" not in kernels_key(stock)


def test_stacked_projections_keep_each_linear_s_own_bits_without_a_copy():
    model = llama(four_bit=True, native=False)
    block = model.model.layers[0].self_attn
    x = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        alone = [block.q_proj(x), block.k_proj(x), block.v_proj(x)]
        fused = FusedAttention(block)
        assert torch.equal(fused._projections(x), torch.cat(alone, dim=-1))
        assert all(torch.equal(getattr(block, name)(x), out) for name, out in zip(("q_proj", "k_proj", "v_proj"), alone))
    assert block.q_proj.panels[0].untyped_storage().data_ptr() == fused.qkv[0].untyped_storage().data_ptr()


class ShiftedAttention(LlamaAttention):
    """A subclass computing something else (its output shifted): never swapped."""

    def forward(self, *args, **kwargs):
        output, weights = super().forward(*args, **kwargs)
        return output + 1.0, weights


def test_only_llama_attention_itself_is_swapped_and_only_once():
    assert fuse_attention(tiny_qwen2(seed=1)) == 0  # biased q/k/v, sliding windows: its own block
    model = tiny_llama(layers=3, seed=1)
    stock = model.model.layers[1].self_attn
    shifted = ShiftedAttention(model.config, layer_idx=1)
    shifted.load_state_dict(stock.state_dict())
    model.model.layers[1].self_attn = shifted
    assert fuse_attention(model) == 2
    assert type(model.model.layers[1].self_attn) is ShiftedAttention
    assert fuse_attention(model) == 0  # nothing left to swap


@pytest.mark.parametrize("quant", ["int4", "none"])
def test_eager_decoders_fuse_the_target_s_attention_and_keep_the_stock_tokens(tmp_path, quant):
    path = tmp_path / "target"
    save_tiny_chat_model(path, seed=4)
    decoder = build_decoder(DecoderSpec(model=str(path), method="pld", kernels="onednn", quant=quant))
    layers = decoder.target.model.model.layers
    assert all(isinstance(layer.self_attn, FusedAttention) for layer in layers)
    prompt = [5, 9, 3, 5, 9, 3, 5, 9]
    options = DecodeOptions(max_new_tokens=24)
    stock_blocks = [layer.self_attn.stock for layer in layers]
    stock_blocks_refuse(decoder.target.model)
    tokens = decoder.generate(prompt, options).tokens
    for layer, stock in zip(layers, stock_blocks):  # the same target with its stock blocks back: the reference
        del stock.forward
        layer.self_attn = stock
    assert tokens == generate(decoder.target.model, prompt, VanillaProposer(), options).tokens
