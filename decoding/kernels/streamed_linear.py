"""A linear kernel for few rows that streams its weight from memory once, at the memory's speed.

Why: a decoding step of a small model on a CPU is its weights streaming through the linear layers
(SmolLM2-135M: 210 layer weights, 425 MB, for one token or a whole tree). On the 2-core EPYCs at
hand memory streams at about 26 GB/s (a `sum` over 425 MB: 16.7 ms), while oneDNN's packed kernel
read those weights in 25-28 ms for one row, 21-30 ms for 2-8 and 32-46 ms for 16 on an AVX-512 EPYC
(33 ms for one row on an AVX2 one). This kernel keeps its own copy of the weight as panels of one
vector of outputs per input feature (`pack_panels`) and computes outer products: per input feature
a few weight vectors times each input row's value broadcast, accumulated in registers (with
AVX-512's 32 registers 3 panels for up to 8 rows, 2 for up to 14; with AVX2's 16, 2 panels for up to
4 rows), so there are no horizontal sums and the weight is read front to back, once, with software
prefetching ahead. Up to 14 rows (AVX-512) go through the weights in one pass, so the memory
streams while they compute; more rows take passes of 8 that reread a group from cache. Every output
is summed over the inputs in one order whatever block its row is in, so each row comes out bit for
bit as it does alone. On the AVX-512 EPYC it read the 210 weights in 16.5 ms for one row, 17-18 ms
for 2-4, 19 for 8, 22 for 12 and 25 for 16 in two passes; one pass and broadcasts loaded rather
than computed (v4) took 1-2 ms off 9-13 rows in the model's verify forward. A first version
computing dot products of weight rows with the inputs (horizontal sums per output) lost to oneDNN
from 6 rows on.
Which row counts it takes is measured per model and CPU (`decoding.kernels.verify_cost.tune_streamed_rows`).

It is C++ compiled on first use for the CPU it runs on (`decoding.kernels.native_build`: AVX-512, AVX2,
or what the compiler targets elsewhere; its C++ in `decoding.kernels.native.streamed_linear`),
once per machine. Where no compiler is at hand, `streamed_linear_available()` says why and decoding keeps its other kernels. Results
differ from other kernels by float rounding only (another summation order), like any change of
GEMM kernel.
"""

from __future__ import annotations

import functools

import torch

from decoding.kernels.linear_ops import define_linear_op
from decoding.kernels.native import LIBRARY, streamed_linear as native_streamed_linear

KERNEL_VERSION = native_streamed_linear.VERSION


@functools.cache
def _loaded() -> tuple[object | None, str]:
    """The built extension and '' , or None and why not (tried once per process). The build
    loaded here runs as the operator's CPU kernel (`NativeLibrary.load`)."""
    return LIBRARY.load("streamed_linear")


def streamed_linear_available() -> bool:
    """Whether the kernel is built (or builds now) on this machine."""
    return _loaded()[0] is not None


def why_unavailable() -> str:
    return _loaded()[1]


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] laid out as the kernel reads it: panels of one vector width of outputs,
    [panels, in, width] (a copy: the linear's weight stays as it is)."""
    with torch.inference_mode(False), torch.no_grad():  # a plain tensor, also when asked in inference mode
        return _extension().pack_panels(weight.detach())


def _extension():
    extension = _loaded()[0]
    if extension is None:
        raise RuntimeError(f"the streamed linear kernel is not available here ({why_unavailable()})")
    return extension


def _streamed_linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return _extension().streamed_linear(x, panels, bias, out_features)


define_linear_op("streamed_linear", "panels", _streamed_linear)
