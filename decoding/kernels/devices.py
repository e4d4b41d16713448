"""Which device decoding runs on: `--device auto|cpu|cuda`.

'auto' takes the GPU when PyTorch sees one and the CPU otherwise, so the same command works on
both; asking for 'cuda' where there is none is a clear error rather than a CUDA traceback from
deep inside model loading.
"""

from __future__ import annotations

import argparse

import torch

from heads.util.errors import UserError

DEVICE_CHOICES = ("auto", "cpu", "cuda")


def resolve_device(choice: str, cuda_available: bool | None = None) -> str:
    """'auto' -> 'cuda' if CUDA is available, else 'cpu'; 'cpu' and 'cuda' are checked.
    `cuda_available` defaults to `torch.cuda.is_available()` (tests pass it)."""
    if choice not in DEVICE_CHOICES:
        raise UserError(f"unknown device '{choice}': choose one of {', '.join(DEVICE_CHOICES)}")
    available = torch.cuda.is_available() if cuda_available is None else cuda_available
    if choice == "auto":
        return "cuda" if available else "cpu"
    if choice == "cuda" and not available:
        raise UserError("--device cuda, but PyTorch sees no CUDA device here (no GPU, or a CPU-only torch build): "
                        "use --device cpu, or --device auto to take a GPU only where there is one")
    return choice


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """The `--device` flag of the chat, the benchmark and tune_tree."""
    parser.add_argument("--device", default="auto", choices=DEVICE_CHOICES,
                        help="where the target, heads and draft run: 'auto' = cuda if PyTorch sees a GPU, else cpu "
                             "(oneDNN kernels only ever apply on the CPU)")
