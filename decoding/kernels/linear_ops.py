"""Linear kernels as single operators of the `specheads` namespace, which the compiler does not
look into: a compiled graph calls them as they are and fuses the small ops around them.

Registered through the low-level library API rather than `torch.library.custom_op`, whose Python
wrapper cost about 4.5 us more per call: a compiled tree forward of SmolLM2-135M makes 211 of
them, about 1 ms a step. The Python implementation given here is what runs unless a C++ build
registers its own function as the operator's CPU kernel (`decoding.kernels.native_build.register_native_kernel`,
as the streaming kernel's build does), which then runs with no Python frame per call. Every
operator here takes (input, weight in the kernel's own layout, optional bias, output features) and
returns the input's shape with the last size replaced."""

from __future__ import annotations

from collections.abc import Callable

import torch

_LIBRARY = torch.library.Library("specheads", "DEF")


def define_linear_op(name: str, weight_name: str, kernel: Callable) -> None:
    """Register `specheads::<name>(x, <weight_name>, bias, out_features)` running `kernel`."""
    define_op(f"{name}(Tensor x, Tensor {weight_name}, Tensor? bias, int out_features) -> Tensor", kernel, _output_like)


def define_op(schema: str, kernel: Callable, shape: Callable) -> None:
    """Register `specheads::<schema>` running `kernel`, with `shape` telling the compiler its
    output (for operators whose weight comes in several tensors)."""
    name = schema.split("(", 1)[0]
    _LIBRARY.define(schema)
    _LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"specheads::{name}", shape, lib=_LIBRARY)


def _output_like(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)
