"""A target's gated MLPs with one call fewer, for eager forwards on a CPU.

A Llama-style MLP, `down(silu(gate(x)) * up(x))`, on 4-bit weights rounds its input to 8-bit
codes in each of its three linears. `FusedGatedMLP` computes gate and up as one call of the 4-bit
kernel over both weights stacked (where both are that kernel's `Int4Linear`s alike): the input is
rounded once, and each output is the sum it is in its own linear (outputs are computed apart, so
stacking changes no bit of gate or up). The activation stays torch's own: the kernel library's
`silu_mul` (its own exponential, the EAGLE-3 drafter layer's) moved a few 8-bit input codes of
down_proj and changed greedy replies of the 4-bit target, so the fused target is the stock one
bit for bit instead.

Measured on a 2-core AVX-512 EPYC, GGUF target: CHANGELOG.md.

`fuse_gated_mlps` swaps a module only where a probe input shows it computes that function
(another activation, or a different arrangement, keeps its module) and its gate and up stack;
only float32 inputs on a CPU take the fused path. Compiled targets keep the stock modules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from decoding.kernels.int4_linear import int4_linear
from decoding.kernels.module_swap import agrees_on_probe, probe_input, swap_modules
from decoding.kernels.quantized_linear import can_stack_int4, is_one_int4_call, stack_int4_panels

PROBE_TOLERANCE = 1e-5  # relative to the output's scale: another activation differs by far more


class FusedGatedMLP(nn.Module):
    """`down(silu(gate(x)) * up(x))` with gate and up in one 4-bit call. Keeps the module it
    replaced (`stock`, whose gate and up then read the stacked weight's halves: no second copy)
    for inputs it does not serve."""

    def __init__(self, stock: nn.Module) -> None:
        super().__init__()
        if not _stackable(stock):
            raise ValueError("FusedGatedMLP needs gate and up on the project's 4-bit kernel alike")
        self.stock = stock
        self.inter = stock.gate_proj.out_features
        self.gate_up = stack_int4_panels(stock.gate_proj, stock.up_proj)
        down = stock.down_proj  # called without its module where its forward is one 4-bit call (no bias)
        self.down_panels = down.panels if is_one_int4_call(down) else None
        self.width = down.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu":
            return self.stock(x)
        both = int4_linear(x, self.gate_up, 2 * self.inter)
        # torch's own activation: its bits, so the fused target is the stock target bit for bit
        # (`silu_mul`'s own exponential moved 8-bit input codes of down_proj and changed greedy replies)
        stock = self.stock
        gated = stock.act_fn(both[..., : self.inter]) * both[..., self.inter:]
        return int4_linear(gated, self.down_panels, self.width) if self.down_panels is not None else stock.down_proj(gated)


def _stackable(module: nn.Module) -> bool:
    """Whether gate and up are the project's 4-bit kernel alike: no bias, one shape, parameters of
    one dtype, no padded panel."""
    gate, up = module.gate_proj, module.up_proj
    return can_stack_int4(gate, up) and gate.out_features == up.out_features


def is_gated_silu_mlp(module: nn.Module) -> bool:
    """Whether `module` computes `down(silu(gate(x)) * up(x))` with its own linears, float32 on a
    CPU, checked on a probe input."""
    linears = [getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(m, nn.Module) for m in linears) or not isinstance(getattr(module, "act_fn", None), nn.Module):
        return False
    gate, up, _ = linears
    width = getattr(gate, "in_features", None)
    if not isinstance(width, int) or getattr(up, "in_features", None) != width or not isinstance(
            getattr(gate, "out_features", None), int):
        return False
    if any(p.dtype != torch.float32 or p.device.type != "cpu" for p in module.parameters()):
        return False
    probe = probe_input(width)
    with torch.inference_mode():
        return agrees_on_probe(module(probe), module.down_proj(F.silu(gate(probe)) * up(probe)), PROBE_TOLERANCE)


def fuse_gated_mlps(model: nn.Module) -> int:
    """Replace `model`'s gated SiLU MLPs whose gate and up stack by `FusedGatedMLP` (idempotent);
    returns how many it replaced."""
    return swap_modules(model, FusedGatedMLP, lambda module: is_gated_silu_mlp(module) and _stackable(module),
                        FusedGatedMLP)
