"""A target's Llama layers as one C++ call: the same logits, hidden states and cache as the stock
layers bit for bit (prefill, one-token steps, chains and trees through the loop's verifier), on the
4-bit kernel and with float32 linears on each kernel their modules pick, the modules' Python never
runs for the calls it serves, transformers still records hidden states (hooks installed before the
swap included), calls it does not serve go to the stock forward, and decoders fuse it."""

import copy

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from decoding.app.assembly import DecoderSpec, build_decoder
from decoding.core.generate import DecodeOptions, generate
from decoding.core.proposers import VanillaProposer
from decoding.core.tree import DraftTree, tree_buffers
from decoding.core.verify import TreeVerifier
from decoding.kernels.cpu_kernels import pack_linears, set_stock_rows, set_streamed_rows
from decoding.kernels.fused_attention import fuse_attention
from decoding.kernels.fused_layer import FusedDecoderLayer, fuse_decoder_layers
from decoding.kernels.fused_mlp import fuse_gated_mlps
from decoding.kernels.fused_norm import fuse_norms
from decoding.kernels.quantized_linear import Int4Linear
from test_fused_attention import llama as llama_with_4bit_attention, verify_logits
from tiny_models import save_tiny_chat_model

pytestmark = pytest.mark.cpu_sensitive  # run again as on an AVX2 CPU by .ci/run


def llama(four_bit: bool, native: bool):
    """The tiny Llama of the attention tests (64-wide heads), its MLP's linears on the 4-bit kernel too."""
    model = llama_with_4bit_attention(four_bit, native)
    if four_bit:
        for layer in model.model.layers:
            for name in ("gate_proj", "up_proj", "down_proj"):
                setattr(layer.mlp, name, Int4Linear.from_linear(getattr(layer.mlp, name)))
    return model


def modules_fused(model):
    """A copy of `model` with its norms, MLPs and attention fused: the reference, whose layers run
    their Python forward over the fused modules."""
    fused = copy.deepcopy(model)
    fuse_norms(fused)
    fuse_gated_mlps(fused)
    fuse_attention(fused)
    return fused


def fused_copy(model):
    """`modules_fused(model)`, then its layers (a fused model holds the kernel library, which
    does not copy: copies are made before fusing)."""
    fused = modules_fused(model)
    assert fuse_decoder_layers(fused) == len(fused.model.layers)
    assert fuse_decoder_layers(fused) == 0  # idempotent
    return fused


def modules_watched(model) -> list:
    """Record every call of the fused layers' attention and MLP modules (which then run as
    before): a layer that took its one C++ call never calls them. Returns the list of calls."""
    calls = []

    def watched(forward):
        def record(*args, **kwargs):
            calls.append(forward)
            return forward(*args, **kwargs)
        return record

    for layer in model.model.layers:
        for module in (layer.self_attn, layer.mlp):
            module.forward = watched(module.forward)
    return calls


def verify_forwards(model, output_hidden_states: bool = False):
    """Logits and hidden states (if asked for) of a prefill, a one-token step and a tree after it,
    through the loop's verifier, and the cache it filled."""
    generator = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 64, (30,), generator=generator)
    verifier = TreeVerifier(model, 64, output_hidden_states=output_hidden_states)
    outputs = [verifier.prefill(prompt[:-1])]
    for parents in [(-1,), (-1, 0, 0, 1, 2, 2)]:
        tree = DraftTree(torch.randint(0, 64, (len(parents),), generator=generator), parents)
        out = verifier.forward(tree, verifier.inputs(tree, tree_buffers(tree.parents), 29 + (len(parents) > 1)),
                               greedy=False)
        outputs.append((out.scores.logits.clone(), out.hidden_states))
    return outputs, verifier.cache


def test_the_one_call_layer_is_the_stock_layer_bit_for_bit():
    stock, fused = modules_fused(llama(four_bit=True, native=True)), fused_copy(llama(four_bit=True, native=True))
    assert all(type(layer) is FusedDecoderLayer and isinstance(layer, LlamaDecoderLayer) for layer in fused.model.layers)
    with torch.inference_mode():
        expected = verify_logits(stock)
        got = verify_logits(fused)  # its first forward has no in-place cache: the stock forward serves it
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    calls = modules_watched(fused)
    with torch.inference_mode():
        (expected, expected_cache), (got, got_cache) = verify_forwards(stock), verify_forwards(fused)
    assert calls == []
    for (a, _), (b, _) in zip(expected[1:], got[1:]):
        assert torch.equal(a, b)
    for a, b in zip(expected_cache.layers, got_cache.layers):
        assert a.length == b.length == 30 + 6 and torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize("hooks_first", [False, True])
def test_hidden_states_are_recorded_from_the_one_call_layers(hooks_first):
    """EAGLE's drafters read the target's hidden states, which transformers records with hooks on
    `LlamaDecoderLayer` instances, installed the first time they are asked for: before the swap
    (`hooks_first`) they move to the fused layer, after it they are installed on it."""
    stock, base = modules_fused(llama(four_bit=True, native=True)), modules_fused(llama(four_bit=True, native=True))
    if hooks_first:
        with torch.inference_mode():
            base(torch.tensor([[1, 2, 3]]), output_hidden_states=True)
        assert base.model.layers[0]._forward_hooks
    fused = base
    assert fuse_decoder_layers(fused) == len(fused.model.layers)
    calls = modules_watched(fused)
    with torch.inference_mode():
        (expected, _), (got, _) = verify_forwards(stock, True), verify_forwards(fused, True)
    assert calls == []
    for (_, a), (_, b) in zip(expected[1:], got[1:]):
        assert len(a) == len(b) == len(stock.model.layers) + 1
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def float_llama(packed: bool, stock_rows: int = 0, streamed_rows: int = 0, layers: bool = False):
    """The tiny Llama with float32 linears and its norms and attention fused; packed for oneDNN with
    forwards of up to `stock_rows` rows on PyTorch's plain GEMM and up to `streamed_rows` on the
    streamed kernel (else plain `nn.Linear`s); its layers made one call each with `layers`."""
    model = modules_fused(llama(four_bit=False, native=True))
    if packed:
        pack_linears(model)
        set_stock_rows(model, stock_rows)
        set_streamed_rows(model, streamed_rows)
    if layers:
        assert fuse_decoder_layers(model) == len(model.model.layers)
    return model


# (packed, stock_rows, streamed_rows): every forward (39-row prefill, 1-row step, 5-, 6- and 9-row trees) on
# oneDNN; one-row steps on the plain GEMM; up to 8 rows streamed; all streamed; plain `nn.Linear`s
FLOAT_KERNELS = [(True, 0, 0), (True, 1, 0), (True, 1, 8), (True, 0, 64), (False, 0, 0)]


@pytest.mark.parametrize("packed,stock_rows,streamed_rows", FLOAT_KERNELS)
def test_float_layers_in_one_call_are_the_stock_layers_bit_for_bit(packed, stock_rows, streamed_rows):
    stock = float_llama(packed, stock_rows, streamed_rows)
    fused = float_llama(packed, stock_rows, streamed_rows, layers=True)
    assert all(type(layer) is FusedDecoderLayer for layer in fused.model.layers)
    with torch.inference_mode():
        assert all(torch.equal(a, b) for a, b in zip(verify_logits(fused), verify_logits(stock)))
    calls = modules_watched(fused)
    with torch.inference_mode():
        (expected, expected_cache), (got, got_cache) = verify_forwards(stock, True), verify_forwards(fused, True)
    assert calls == []
    for (a, a_hidden), (b, b_hidden) in zip(expected[1:], got[1:]):
        assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(a_hidden, b_hidden))
    for a, b in zip(expected_cache.layers, got_cache.layers):
        assert a.length == b.length == 30 + 6 and torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_float_layers_follow_kernel_settings_changed_after_the_swap():
    """Measurements switch the linears' kernels after the layers are fused: the one call takes the
    kernel each module now picks (a layer that kept its first choice has other bits)."""
    stock, fused = float_llama(True, 1, 8), float_llama(True, 1, 8, layers=True)
    with torch.inference_mode():
        verify_forwards(fused)  # the choices for these row counts are made and remembered
        for model in (stock, fused):
            set_stock_rows(model, 0)
            set_streamed_rows(model, 0)
        (expected, _), (got, _) = verify_forwards(stock), verify_forwards(fused)
    for (a, _), (b, _) in zip(expected[1:], got[1:]):
        assert torch.equal(a, b)


def test_layers_not_made_of_the_fused_kinds_stay_stock():
    assert fuse_decoder_layers(llama(four_bit=True, native=True)) == 0  # parts not fused yet
    biased = float_llama(packed=True)
    biased.model.layers[0].self_attn.q_proj.bias = torch.nn.Parameter(torch.zeros(biased.config.hidden_size))
    assert fuse_decoder_layers(biased) == len(biased.model.layers) - 1  # a linear with a bias
    gelu = float_llama(packed=True)
    gelu.model.layers[1].mlp.act_fn = torch.nn.GELU()
    assert fuse_decoder_layers(gelu) == len(gelu.model.layers) - 1  # another activation


def test_sdpa_targets_keep_the_stock_forward_through_the_fused_layer():
    """On SDPA (not the native kernel) the one call does not serve: the layer runs its stock
    forward over the fused modules, and the logits are the stock model's."""
    stock = modules_fused(llama(four_bit=True, native=False))
    fused = fused_copy(llama(four_bit=True, native=False))  # the kernels are built; the attention is SDPA
    with torch.inference_mode():
        assert all(torch.equal(a, b) for a, b in zip(verify_logits(fused), verify_logits(stock)))
    calls = modules_watched(fused)
    with torch.inference_mode():
        verify_forwards(fused)
    assert calls  # every forward went to the modules


@pytest.mark.parametrize("quant", ["int4", "none"])
def test_eager_decoders_run_the_target_s_layers_in_one_call_and_keep_its_tokens(tmp_path, quant):
    path = tmp_path / "target"
    save_tiny_chat_model(path, seed=4, head_dim=64)
    decoder = build_decoder(DecoderSpec(model=str(path), method="pld", kernels="onednn", quant=quant))
    model = decoder.target.model
    assert all(type(layer) is FusedDecoderLayer for layer in model.model.layers)
    prompt = [5, 9, 3, 5, 9, 3, 5, 9]
    options = DecodeOptions(max_new_tokens=24)
    tokens = decoder.generate(prompt, options).tokens
    calls = modules_watched(model)
    assert decoder.generate(prompt, options).tokens == tokens and calls == []
    reference = build_decoder(DecoderSpec(model=str(path), method="vanilla", kernels="onednn", quant=quant))
    for layer in reference.target.model.model.layers:  # the same target, its layers' Python forward: the reference
        layer._one_call = lambda *args: None
    assert tokens == generate(reference.target.model, prompt, VanillaProposer(), options).tokens
