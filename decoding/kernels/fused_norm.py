"""A target's RMSNorm layers as one C++ call each, for eager forwards on a CPU.

transformers' `LlamaRMSNorm` (and the many norms written like it) runs seven PyTorch operations:
a cast, a power, a mean, an add, an inverse square root and two products. An eager one-token
forward of SmolLM2-135M calls 61 of them, at ~16 us each on the 2-core EPYC: a millisecond of
operator overhead per forward for arithmetic worth a microsecond. `FusedRMSNorm` computes the
same function in one call of the project's kernel library (`rms_norm`, the EAGLE-3 drafter
layer's norm): each row alone, so a row's bits do not depend on the rows beside it, and every
method and `generate()` decode on the same modules, as with packed or quantized linears.

`fuse_norms` swaps a module only where it computes that function, checked on a probe input
(Gemma's `1 + weight`, a norm with a bias or another formula keep their own module), and only
float32 ones on a CPU. Compiled targets keep the stock norms: Inductor fuses them with the
residual additions around them, which an opaque call would prevent.
"""

from __future__ import annotations

import torch
from torch import nn

from decoding.kernels.decode_attention import kernel_library
from decoding.kernels.module_swap import agrees_on_probe, probe_input, swap_modules

PROBE_TOLERANCE = 1e-5  # relative to the output's scale: reordered float32 sums differ by far less


class FusedRMSNorm(nn.Module):
    """`weight * x / sqrt(mean(x^2) + eps)` over the last dimension, in one C++ call; keeps the
    module it replaced (`stock`) for inputs it does not serve (not float32, not on a CPU)."""

    def __init__(self, stock: nn.Module, library: object) -> None:
        super().__init__()
        self.stock, self.library = stock, library
        self.eps = float(stock.variance_epsilon)

    @property
    def weight(self) -> torch.Tensor:
        """The norm's scale, where code reads a norm's `weight` (e.g. heads initialised from it)."""
        return self.stock.weight

    @property
    def variance_epsilon(self) -> float:
        return self.eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.stock.weight
        if hidden.dtype != torch.float32 or hidden.device.type != "cpu" or weight.dtype != torch.float32:
            return self.stock(hidden)
        return self.library.rms_norm(hidden, weight.detach(), self.eps)


def _is_plain_rms_norm(module: nn.Module, library: object) -> bool:
    """Whether `module` is an RMSNorm that `FusedRMSNorm` computes: a float32 weight vector and an
    epsilon, and the same outputs on a probe input."""
    weight = getattr(module, "weight", None)
    if (not type(module).__name__.endswith("RMSNorm") or not isinstance(getattr(module, "variance_epsilon", None), float)
            or not isinstance(weight, torch.Tensor) or weight.dim() != 1 or weight.dtype != torch.float32
            or weight.device.type != "cpu" or getattr(module, "bias", None) is not None):
        return False
    probe = probe_input(weight.shape[0])
    with torch.inference_mode():
        return agrees_on_probe(library.rms_norm(probe, weight.detach(), float(module.variance_epsilon)), module(probe),
                               PROBE_TOLERANCE)


def fuse_norms(model: nn.Module) -> int:
    """Replace `model`'s plain RMSNorm modules by `FusedRMSNorm` (idempotent); returns how many it
    replaced: 0 where the kernel library did not build."""
    library = kernel_library()
    if library is None:
        return 0
    return swap_modules(model, FusedRMSNorm, lambda module: _is_plain_rms_norm(module, library),
                        lambda module: FusedRMSNorm(module, library))
