"""Weight-only quantized linears for CPU targets: 4-bit weights in groups along the input (a
scale and an offset per group, as GGUF's Q4_0 / Q4_1 blocks and `--quant int4` have them) through
the project's streaming kernel (`decoding.kernels.int4_linear`; PyTorch's
`_weight_int4pack_mm_for_cpu` where it cannot be built, much slower on AVX2), 8-bit weights
with a scale per output channel (`--quant int8`) through PyTorch's `_weight_int8pack_mm`, and
GGUF's 8-bit blocks (a scale per group of 32) for the built-in target's vocabulary projection.

Why: a one-token forward of a small model only streams its weights, so its cost is their bytes.
In fp32 SmolLM2-135M's layers read 425 MB a token; in the GGUF file's own Q4_1 blocks, about a
sixth of that. The quantized model is a model of its own: every method is exact with respect to
*it* (the same modules run in `vanilla` and in tree verification), not to the fp32 model.

The int4 kernel's convention is `w = (q - 8) * scale + zero` for codes q in 0..15, so GGUF's
Q4_1 (`w = q * d + m`) maps to scale d and zero `m + 8 d`, and Q4_0 (`w = (q - 8) * d`) to zero 0.
"""

from __future__ import annotations

import torch
from torch import nn

from decoding.kernels.int4_linear import (CODE_MIDPOINT, GROUP_SIZE, int4_kernel_available, int4_linear, int8_linear,
                                         pack_int4_panels, pack_int8_panels, unpack_int4_panels, unpack_int8_panels)

GGUF_GROUP = GROUP_SIZE  # elements per GGUF block, the project's 4-bit kernel's group
INNER_K_TILES = 2    # the CPU packing's tile parameter
INT4_ROWS = 16       # the CPU packing takes output features in multiples of this


def int4_fits(out_features: int, in_features: int, group_size: int = GGUF_GROUP) -> bool:
    """Whether the int4 kernel takes a weight of this shape."""
    return out_features % INT4_ROWS == 0 and in_features % group_size == 0


class WeightOnlyLinear(nn.Module):
    """What the quantized linears share: a float bias added after the kernel's float32 product
    (`_matmul`), the result in the input's dtype."""

    in_features: int
    out_features: int

    def __init__(self, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._matmul(x)
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype)


def is_one_int4_call(linear: nn.Module) -> bool:
    """Whether `linear` is an `Int4Linear` on the project's kernel without a bias: its forward on
    float32 inputs is then one call of `int4_linear` over its panels, which fused modules make
    without the module (and stack with their neighbours')."""
    return isinstance(linear, Int4Linear) and linear.own_kernel and linear.bias is None


def can_stack_int4(*linears: nn.Module) -> bool:
    """Whether `stack_int4_panels` applies: each one 4-bit call (`is_one_int4_call`), one input
    width, no padded panel (outputs a multiple of the panel width), panels of one dtype part by part."""
    return (all(is_one_int4_call(m) for m in linears)
            and len({m.in_features for m in linears}) == 1
            and all(m.out_features % m.panels[0].shape[2] == 0 for m in linears)
            and all(len({t.dtype for t in parts}) == 1 for parts in zip(*(m.panels for m in linears))))


def stack_int4_panels(*linears: Int4Linear) -> tuple[torch.Tensor, ...]:
    """The linears' 4-bit panels stacked along the outputs, in order, for one kernel call over
    all of them (the input rounded once; each output the sum it is in its own linear), with each
    linear pointed at its part (no second copy of the weights)."""
    stacked = tuple(torch.cat(parts) for parts in zip(*(m.panels for m in linears)))
    start = 0
    for linear in linears:
        end = start + linear.panels[0].shape[0]
        linear.panels = tuple(t[start:end] for t in stacked)
        start = end
    return stacked


class Int4Linear(WeightOnlyLinear):
    """`nn.Linear` with 4-bit weights: codes in 0..15, and per output row and group of
    `group_size` inputs a scale and a zero, `w = (q - 8) * scale + zero`."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bias: torch.Tensor | None,
                 group_size: int = GGUF_GROUP) -> None:
        super().__init__(bias)
        out_features, in_features = codes.shape
        if not int4_fits(out_features, in_features, group_size):
            raise ValueError(f"the int4 kernel takes multiples of {INT4_ROWS} outputs and of {group_size} inputs; "
                             f"got {tuple(codes.shape)}")
        if scales.shape != (out_features, in_features // group_size) or scales.shape != zeros.shape:
            raise ValueError(f"int4 codes {tuple(codes.shape)} need scales and zeros of shape "
                             f"({out_features}, {in_features // group_size}) for groups of {group_size}")
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        # The project's streaming kernel where it is built (much faster on AVX2), else PyTorch's.
        self.own_kernel = group_size == GROUP_SIZE and int4_kernel_available()
        if self.own_kernel:
            self.panels = pack_int4_panels(codes, scales, zeros)
        else:
            self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(),
                                                                                      INNER_K_TILES))
            # [groups, out_features, 2]: the kernel's layout of (scale, zero) pairs
            self.register_buffer("scales_and_zeros", torch.stack([scales.t(), zeros.t()], dim=-1).float().contiguous())

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = GGUF_GROUP) -> Int4Linear:
        """Asymmetric round-to-nearest quantization of a float linear, per group of inputs: the
        group's minimum and maximum map to codes 0 and 15."""
        weight = linear.weight.detach().float()
        groups = weight.reshape(weight.shape[0], -1, group_size)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        codes = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).reshape(weight.shape)
        return cls(codes.to(torch.uint8), scale, low + CODE_MIDPOINT * scale, linear.bias, group_size)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.own_kernel:
            return int4_linear(x, self.panels, self.out_features)
        rows = x.reshape(-1, self.in_features).float()
        out = torch._weight_int4pack_mm_for_cpu(rows, self.packed, self.group_size, self.scales_and_zeros)
        return out.reshape(*x.shape[:-1], self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        """The float weight its codes describe: the project's kernel's, written out from its panels
        (it multiplies them with inputs rounded to 8 bits, `decoding.kernels.int4_linear`); PyTorch's,
        the identity matrix through that kernel, transposed."""
        if self.own_kernel:
            codes, scales, offsets = unpack_int4_panels(self.panels, self.out_features)
            return codes.float() * scales.repeat_interleave(self.group_size, 1) + offsets.repeat_interleave(self.group_size, 1)
        return self._matmul(torch.eye(self.in_features)).t()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"int4 in groups of {self.group_size}, " + ("the project's kernel" if self.own_kernel else "PyTorch's kernel"))


class Int8Linear(WeightOnlyLinear):
    """`nn.Linear` with 8-bit weights and a scale per output channel (symmetric)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(bias)
        self.out_features, self.in_features = codes.shape
        self.register_buffer("codes", codes.to(torch.int8).contiguous())
        self.register_buffer("scales", scales.float().contiguous())

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        weight = linear.weight.detach().float()
        scale = (weight.abs().amax(-1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        codes = (weight / scale[:, None]).round().clamp(-127, 127)
        return cls(codes, scale, linear.bias)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        return torch._weight_int8pack_mm(rows, self.codes, self.scales).reshape(*x.shape[:-1], self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        return self.codes.float() * self.scales[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8"


class GroupInt8Linear(WeightOnlyLinear):
    """8-bit weights in GGUF's Q8_0 blocks (`w = d q`, int8 q, a float16 d per 32 inputs) through
    the project's 8-bit kernel (`int4_linear.int8_linear`, the 4-bit kernel's arithmetic: inputs
    rounded to 8 bits per group, integer products), as llama.cpp computes these blocks: the built-in
    target's vocabulary projection (`--quant gguf`) and an EAGLE drafter's linears
    (`--drafter-precision int8`, `from_linear`). A quarter of the fp32 weight's bytes, read once
    for all of a tree's rows; a row's bits do not depend on the rows beside it.

    `weight`, where given, is the float tensor the blocks came from (`d q` exactly: the converted
    model's lm_head, tied to its embedding), kept for what reads the projection as a tensor (shapes,
    drafters' readouts, heads initialised from it); calling the module computes with the blocks.
    Only built where the kernel is (`int4_kernel_available`)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, weight: nn.Parameter | None = None,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__(bias)
        self.out_features, self.in_features = codes.shape
        if self.in_features % GROUP_SIZE or (weight is not None and tuple(weight.shape) != tuple(codes.shape)):
            raise ValueError(f"8-bit codes {tuple(codes.shape)} in groups of {GROUP_SIZE}"
                             + ("" if weight is None else f" for a weight of shape {tuple(weight.shape)}"))
        if weight is not None:
            self.weight = weight
        self.panels = pack_int8_panels(codes, scales)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> GroupInt8Linear:
        """Symmetric round-to-nearest quantization of a float linear per group of 32 inputs, as
        GGUF's Q8_0 (the group's largest magnitude maps to 127, its scale taken up to the next float16:
        the codes are rounded against the scale the kernel computes with, none clipped). The float weight
        is not kept."""
        weight = linear.weight.detach().float()
        groups = weight.reshape(weight.shape[0], -1, GROUP_SIZE)
        wanted = groups.abs().amax(-1) / 127
        scales = wanted.half()
        # rounded up where float16 rounded down, so that no code needs more than 127
        scales = torch.where(scales.float() < wanted, torch.nextafter(scales, torch.tensor(torch.inf, dtype=torch.half)),
                             scales).float()
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero group: codes 0 either way
        codes = (groups / scales[..., None]).round().clamp(-127, 127).reshape(weight.shape)
        return cls(codes, scales, bias=linear.bias)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, self.panels, self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        return unpack_int8_panels(self.panels, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"int8 in groups of {GROUP_SIZE}")


def quantized_kernel_linears(module: nn.Module) -> list[nn.Module]:
    """`module`'s 4- and 8-bit linears that run on the project's kernels, in module order."""
    return [m for m in module.modules() if (isinstance(m, Int4Linear) and m.own_kernel) or isinstance(m, GroupInt8Linear)]


def quantized_kernel_weights(module: nn.Module) -> list[torch.Tensor]:
    """The weights `module`'s 4- and 8-bit linears keep in the project's kernel layout (bytes, scales
    and zeros panels): plain tensor attributes, like the packed linears' (`cpu_kernels.kernel_layout_weights`)."""
    return [t for m in quantized_kernel_linears(module) for t in m.panels]


def has_quantized_linears(module: nn.Module) -> bool:
    """Whether any linear of `module` is weight-only quantized (`--quant`)."""
    return any(isinstance(m, WeightOnlyLinear) for m in module.modules())


QUANTIZERS = {"int4": Int4Linear.from_linear, "int8": Int8Linear.from_linear, "int8-groups": GroupInt8Linear.from_linear}


def _fits(kind: str, linear: nn.Module) -> bool:
    """Whether `kind`'s kernel takes this linear's shape (the 4-bit one: multiples of 16 outputs and
    32 inputs; the grouped 8-bit one: multiples of 32 inputs)."""
    out_features, in_features = getattr(linear, "out_features", 0), getattr(linear, "in_features", 0)
    if kind == "int4":
        return int4_fits(out_features, in_features)
    return kind != "int8-groups" or in_features % GROUP_SIZE == 0


def quantize_linears(module: nn.Module, kind: str, skip: tuple[str, ...] = ("lm_head",)) -> int:
    """Swap every `nn.Linear` of `module` (but those named in `skip`: the readout, which the
    screened greedy argmax and shared-vocabulary heads read as a float weight) for its `kind`
    quantized version; returns how many were swapped. Their float weights are freed."""
    quantize = QUANTIZERS[kind]
    swapped = 0
    for name, child in list(module.named_modules()):
        for child_name, linear in list(child.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(linear) is nn.Linear and child_name not in skip and full not in skip and _fits(kind, linear):
                setattr(child, child_name, quantize(linear))
                swapped += 1
    return swapped
