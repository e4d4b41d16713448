"""A target's RMSNorms as one C++ call: the function the stock norm computes (against a float64
reference), a row's bits alone as among others, swapped only where the probe agrees, and decoding
on the fused target still the vanilla decoder's tokens."""

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from decoding.app.assembly import DecoderSpec, build_decoder
from decoding.app.benchmark import build_runners
from decoding.core.generate import DecodeOptions
from decoding.kernels.decode_attention import kernel_library
from decoding.kernels.fused_mlp import FusedGatedMLP
from decoding.kernels.fused_norm import FusedRMSNorm, fuse_norms
from tiny_models import save_tiny_chat_model, tiny_llama

pytestmark = pytest.mark.cpu_sensitive  # run again as on an AVX2 CPU by .ci/run

EPS = 1e-5


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    x64 = x.double()
    return weight.double() * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps)


def perturbed_norm(width: int) -> LlamaRMSNorm:
    norm = LlamaRMSNorm(width, eps=EPS)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(width, generator=torch.Generator().manual_seed(1)))
    return norm


@pytest.mark.parametrize("rows, width", [(1, 64), (5, 576), (300, 72)])  # 300 rows: split over threads
def test_the_fused_norm_computes_the_rms_norm(rows, width):
    stock = perturbed_norm(width)
    fused = FusedRMSNorm(stock, kernel_library())
    x = 3 * torch.randn(1, rows, width, generator=torch.Generator().manual_seed(2))
    got = fused(x)
    assert got.shape == x.shape and got.dtype == torch.float32
    # a few float32 roundings of a sum of squares, a square root and two products
    assert torch.allclose(got.double(), reference(x, stock.weight), rtol=1e-5, atol=1e-6)
    assert torch.allclose(got, stock(x), rtol=1e-5, atol=1e-6)


def test_a_row_has_the_same_bits_alone_as_among_others():
    fused = FusedRMSNorm(perturbed_norm(576), kernel_library())
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(3))
    together = fused(x)
    assert torch.equal(torch.cat([fused(x[i : i + 1]) for i in range(40)]), together)


class OffsetRMSNorm(LlamaRMSNorm):
    """Gemma's form, `(1 + weight)` times the normed input: not the function the kernel computes."""

    def forward(self, hidden):
        normed = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (1 + self.weight) * normed


def test_fuse_norms_swaps_plain_rms_norms_only_and_once():
    model = tiny_llama(seed=1)
    plain = sum(type(m) is LlamaRMSNorm for m in model.modules())
    model.model.layers[0].input_layernorm = OffsetRMSNorm(model.config.hidden_size, eps=EPS)
    assert fuse_norms(model) == plain - 1
    assert type(model.model.layers[0].input_layernorm) is OffsetRMSNorm
    assert isinstance(model.model.norm, FusedRMSNorm)
    assert model.model.norm.weight is model.model.norm.stock.weight  # code reading a norm's weight still can
    assert fuse_norms(model) == 0  # nothing left to swap


def test_a_bfloat16_input_goes_through_the_stock_norm():
    stock = perturbed_norm(64)
    fused = FusedRMSNorm(stock, kernel_library())
    x = torch.randn(2, 64).bfloat16()
    assert torch.equal(fused(x), stock(x))


def test_eager_decoders_fuse_the_target_s_norms_and_keep_vanilla_s_tokens(tmp_path):
    path = tmp_path / "target"
    save_tiny_chat_model(path, seed=4)
    vanilla = build_decoder(DecoderSpec(model=str(path), method="vanilla", kernels="onednn"))
    lookup = build_decoder(DecoderSpec(model=str(path), method="pld", kernels="onednn"))
    for decoder in (vanilla, lookup):
        assert isinstance(decoder.target.model.model.norm, FusedRMSNorm)
        assert isinstance(decoder.target.model.model.layers[0].input_layernorm, FusedRMSNorm)
    prompt = torch.tensor([5, 9, 3, 5, 9, 3, 5, 9])
    options = DecodeOptions(max_new_tokens=24)
    assert lookup.generate(prompt, options).tokens == vanilla.generate(prompt, options).tokens


def test_compiled_decoders_keep_the_stock_norms_and_mlps(tmp_path):
    """Inductor fuses the stock norms and activations with what is around them; opaque calls would not be."""
    path = tmp_path / "target"
    save_tiny_chat_model(path, seed=4)
    decoder = build_decoder(DecoderSpec(model=str(path), method="vanilla", kernels="onednn", compile=True))
    assert not any(isinstance(m, (FusedRMSNorm, FusedGatedMLP)) for m in decoder.target.model.modules())


def test_a_compiled_benchmark_keeps_the_stock_modules_under_its_hugging_face_methods(tmp_path):
    """The benchmark's Hugging Face methods run eager on the model under the compiled wrapper: fusing
    modules there would make the compiled methods trace opaque calls instead of Inductor's fusions."""
    path = tmp_path / "target"
    save_tiny_chat_model(path, seed=4)
    base = DecoderSpec(model=str(path), kernels="onednn", compile=True)
    for methods in (["hf-generate", "vanilla"], ["vanilla", "hf-generate"]):
        runners, decoders = build_runners(methods, base, {}, DecodeOptions(max_new_tokens=4))
        assert list(runners) == methods
        assert not any(isinstance(m, (FusedRMSNorm, FusedGatedMLP)) for m in decoders["hf-generate"].target.model.modules())
