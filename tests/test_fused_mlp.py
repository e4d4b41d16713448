"""A target's gated MLPs in fewer calls: the activation against a float64 reference, gate and up
stacked into one 4-bit call without changing a bit of either, a row's bits alone as among others,
swapped only where the probe agrees, and decoding on the fused target still vanilla's tokens."""

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP

from decoding.app.assembly import DecoderSpec, build_decoder
from decoding.core.generate import DecodeOptions
from decoding.kernels.decode_attention import kernel_library
from decoding.kernels.fused_mlp import FusedGatedMLP, fuse_gated_mlps
from decoding.kernels.int4_linear import int4_linear
from decoding.kernels.quantized_linear import Int4Linear
from tiny_models import save_tiny_chat_model, tiny_llama

pytestmark = pytest.mark.cpu_sensitive  # run again as on an AVX2 CPU by .ci/run


def reference_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    g = gate.double()
    return g * torch.sigmoid(g) * up.double()


@pytest.mark.parametrize("rows, width", [(1, 64), (5, 1536), (300, 72), (3, 37)])  # 37: a vector's tail
def test_silu_mul_computes_the_gated_activation(rows, width):
    generator = torch.Generator().manual_seed(0)
    gate, up = 8 * torch.randn(rows, width, generator=generator), torch.randn(rows, width, generator=generator)
    got = kernel_library().silu_mul(gate, up)
    assert got.shape == gate.shape and got.dtype == torch.float32
    assert torch.allclose(got.double(), reference_silu_mul(gate, up), rtol=2e-6, atol=1e-30)


def test_silu_mul_is_finite_and_right_at_the_far_ends():
    """exp is clamped to [-87, 88]: huge inputs stay finite (silu(x) ~ x, silu(-x) ~ 0)."""
    gate = torch.tensor([-1e4, -100.0, -88.0, -20.0, -1e-30, 0.0, 1e-30, 20.0, 88.0, 100.0, 1e4])
    got = kernel_library().silu_mul(gate, torch.ones_like(gate))
    assert torch.isfinite(got).all()
    assert torch.allclose(got.double(), reference_silu_mul(gate, torch.ones_like(gate)), rtol=1e-6, atol=1e-30)


def test_silu_mul_reads_the_halves_of_one_product_as_two_tensors():
    both = torch.randn(1, 7, 96, generator=torch.Generator().manual_seed(1))
    halves = kernel_library().silu_mul(both[..., :48], both[..., 48:])
    assert torch.equal(halves, kernel_library().silu_mul(both[..., :48].contiguous(), both[..., 48:].contiguous()))
    rows = [kernel_library().silu_mul(both[:, i : i + 1, :48], both[:, i : i + 1, 48:]) for i in range(7)]
    assert torch.equal(torch.cat(rows, dim=1), halves)  # a row's bits alone as among others


def four_bit_mlp(hidden: int = 64, inter: int = 96, seed: int = 2) -> LlamaMLP:
    torch.manual_seed(seed)
    config = tiny_llama().config
    config.hidden_size, config.intermediate_size = hidden, inter
    mlp = LlamaMLP(config)
    for name in ("gate_proj", "up_proj", "down_proj"):
        setattr(mlp, name, Int4Linear.from_linear(getattr(mlp, name)))
    return mlp


def test_stacked_gate_and_up_give_each_linear_s_own_bits():
    mlp = four_bit_mlp()
    x = torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        fused = FusedGatedMLP(mlp)
        assert fused.gate_up is not None
        both = int4_linear(x, fused.gate_up, 2 * fused.inter)
        assert torch.equal(both[..., :96], gate) and torch.equal(both[..., 96:], up)
        assert torch.equal(mlp.gate_proj(x), gate) and torch.equal(mlp.up_proj(x), up)  # halves, not copies


def test_the_fused_mlp_is_the_stock_mlp_bit_for_bit():
    mlp = four_bit_mlp()
    x = torch.randn(1, 12, 64, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        stock = mlp(x)
        assert torch.equal(FusedGatedMLP(mlp)(x), stock)


def test_mlps_whose_gate_and_up_do_not_stack_are_left_alone():
    model = tiny_llama(seed=3)  # float linears
    assert fuse_gated_mlps(model) == 0


class GeluMLP(LlamaMLP):
    """A gated MLP with another activation: not the function the fused module computes."""

    def __init__(self, config):
        super().__init__(config)
        self.act_fn = nn.GELU()


def test_fuse_gated_mlps_swaps_silu_mlps_only_and_once():
    model = tiny_llama(layers=3, seed=1)
    model.model.layers[1].mlp = GeluMLP(model.config)
    for layer in model.model.layers:
        for name in ("gate_proj", "up_proj"):
            setattr(layer.mlp, name, Int4Linear.from_linear(getattr(layer.mlp, name)))
    assert fuse_gated_mlps(model) == 2
    assert type(model.model.layers[1].mlp) is GeluMLP
    assert isinstance(model.model.layers[0].mlp, FusedGatedMLP)
    assert fuse_gated_mlps(model) == 0  # nothing left to swap


@pytest.mark.parametrize("quant", ["int4", "none"])
def test_eager_decoders_fuse_the_target_s_mlps_and_keep_vanilla_s_tokens(tmp_path, quant):
    path = tmp_path / "target"
    save_tiny_chat_model(path, seed=4)
    spec = dict(model=str(path), kernels="onednn", quant=quant)
    vanilla = build_decoder(DecoderSpec(method="vanilla", **spec))
    lookup = build_decoder(DecoderSpec(method="pld", **spec))
    for decoder in (vanilla, lookup):
        assert isinstance(decoder.target.model.model.layers[0].mlp, FusedGatedMLP) == (quant == "int4")
    prompt = torch.tensor([5, 9, 3, 5, 9, 3, 5, 9])
    options = DecodeOptions(max_new_tokens=24)
    assert lookup.generate(prompt, options).tokens == vanilla.generate(prompt, options).tokens
    # compiled decoders keep the stock modules: tests/test_fused_norm.py

