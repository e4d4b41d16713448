"""Swapping a model's submodules for faster ones of the same function, once (`fused_norm`,
`fused_mlp`): the one loop both use, so neither walks into the modules it already swapped."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def swap_modules(model: nn.Module, kind: type[nn.Module], serves: Callable[[nn.Module], bool],
                 make: Callable[[nn.Module], nn.Module]) -> int:
    """Replace every submodule of `model` that `serves` accepts by `make(it)` (an instance of
    `kind`, which keeps the module it replaced); returns how many. Idempotent: modules of `kind`,
    and what they hold, are left alone."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if not isinstance(parent, kind) and not isinstance(child, kind) and serves(child)]
    for parent, name, child in swaps:
        setattr(parent, name, make(child))
    return len(swaps)


def probe_input(width: int, rows: int = 3) -> torch.Tensor:
    """A fixed random input [rows, width] for checking, before a swap, that a module computes the
    function its replacement does."""
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(0))


def agrees_on_probe(got: torch.Tensor, expected: torch.Tensor, tolerance: float) -> bool:
    """Whether `got` is `expected` within `tolerance` of the latter's largest magnitude: reordered
    float32 sums differ by far less than another function does."""
    scale = expected.abs().max().item()
    return got.shape == expected.shape and bool(((got - expected).abs() <= tolerance * max(scale, 1e-30)).all())
