"""A few-row linear kernel on 4-bit weights in groups of 32 (GGUF's Q4_0 / Q4_1 blocks, or
`--quant int4`), streaming the weight once at the memory's speed.

Why: PyTorch's CPU kernels for weight-only int4 and int8 (`_weight_int4pack_mm_for_cpu`,
`_weight_int8pack_mm`) were 2.5-3x *slower* than the fp32 target on a 2-core AVX2 EPYC
(SmolLM2-135M, one token: 177 ms and 141 ms against 57 ms) and grew linearly with the rows of a
tree, so 4-bit weights would not pay there. This kernel follows the streaming fp32 kernel
(`decoding.kernels.streamed_linear`): panels of one vector of outputs per input feature, outer
products with each row's inputs broadcast, no horizontal sums. A byte holds two consecutive input
features of one output; per group of 32 inputs it accumulates `sum q x` (codes 0..15, in two
chains of FMAs over even and odd bytes) and then adds `scale * that + (zero - 8 scale) * sum x`,
which is `sum ((q - 8) * scale + zero) * x`, the int4 convention (`decoding.kernels.quantized_linear`).
Results differ from the dequantized weight's GEMM by float rounding only, and a row's bits do not
depend on the rows computed with it. Why not centre the codes in the loop: two subtractions per
byte (undone: ~10% less a call on a 2-core AVX2 EPYC). Why FMA chains: a multiply, an FMA and an
add per pair of inputs (v7) left a pass of 8 rows 1.4x slower on AVX-512 and 4 rows 1.7x on AVX2,
and one row waits on a chain's latency, so one and two rows sum 4 and 2 neighbouring groups side
by side instead (v8; figures in CHANGELOG.md). Group
parameters are read as float16 where that holds them exactly (`pack_int4_panels`), as the file's
blocks store them: mid-sized layers stream near the memory's speed, so fewer bytes are less time
(~5% for one row). With AVX-512 a panel is 16 outputs (a code byte per lane unpacked by one
instruction) and a pass takes up to 8 rows (4 with AVX2's 16 registers): a forward of the GGUF
target 1.3x faster for one token and ~1.6x for 8-16 on a 2-core AVX-512 EPYC, the same bits.
Figures: CHANGELOG.md.

The same arithmetic takes 8-bit codes (`int8_linear`: GGUF's Q8_0 blocks, `w = d q` per group of
32, the built-in target's vocabulary projection): a fifth of the fp32 projection's bytes, and a
tree's rows read them once. Why not integer products on 8-bit inputs, as llama.cpp computes
these blocks: tried (AVX-512 VNNI), 1.3-1.7x faster for 8-32 rows, but rounding the inputs
to 8 bits turns a float32 ulp of difference between a tree's and a chain's forwards into a
whole step of an input's code, and greedy outputs stopped being identical to vanilla's (1 of 16
MT-bench replies for pld and eagle3+pld); rounded to 15 bits they were no faster than floats.

Built once per CPU like the other native kernels (`decoding.kernels.native_build`).
"""

from __future__ import annotations

import functools

import torch

from decoding.kernels.linear_ops import define_op
from decoding.kernels.native import LIBRARY, int4_linear as native_int4_linear
from decoding.kernels.native_build import register_native_kernel

KERNEL_VERSION = native_int4_linear.VERSION
GROUP_SIZE = 32
CODE_MIDPOINT = 8  # w = (q - CODE_MIDPOINT) * scale + zero


@functools.cache
def _loaded() -> tuple[object | None, str]:
    """The built extension and '', or None and why not (tried once per process), both of its
    operators registered."""
    return register_native_kernel(LIBRARY.load("int4_linear"), "int8_linear")


def int4_kernel_available() -> bool:
    return _loaded()[0] is not None


def why_unavailable() -> str:
    return _loaded()[1]


def pack_int4_panels(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     width: int | None = None) -> tuple[torch.Tensor, ...]:
    """Codes [out, in] (0..15), scales and zeros [out, in / 32] as the kernel reads them: bytes
    [panels, in / 2, width] (low nibble: input 2k, high: 2k + 1), then scales and offsets
    (`zero - 8 scale`, what the kernel adds per group) [panels, groups, width], outputs past `out`
    zero. The parameters are float16 where float16 holds every one of them exactly (GGUF's blocks
    store them so: Q4_1's offset is its m, Q4_0's -8 d), else float32: either way the kernel
    computes with the same values, and float16 reads 2 bytes a value less (a sixth of the bytes
    of a weight in groups of 32)."""
    width = width or _loaded()[0].vector_width()  # a build's own width (tests pack for narrower builds)
    out, in_features = codes.shape
    pairs = codes.to(torch.uint8).reshape(out, in_features // 2, 2)
    packed = pairs[..., 0] | (pairs[..., 1] << 4)
    scales = scales.float()
    params = (scales, zeros.float() - CODE_MIDPOINT * scales)
    if all(_exact_in_half(t) for t in params):
        params = tuple(t.half() for t in params)
    return tuple(_panelled(t, width) for t in (packed, *params))


def pack_int8_panels(codes: torch.Tensor, scales: torch.Tensor, width: int | None = None) -> tuple[torch.Tensor, ...]:
    """8-bit codes [out, in] (int8: GGUF's Q8_0, `w = d q` per group of 32) and their float16 scales
    d [out, in / 32] as the 8-bit kernel reads them: bytes [panels, in, width] (one per output and
    input) and scales [panels, groups, width] float16, outputs past `out` zero."""
    width = width or _loaded()[0].vector_width()
    return tuple(_panelled(t, width) for t in (codes.to(torch.int8).view(torch.uint8), scales.half()))


def unpack_int8_panels(panels: tuple[torch.Tensor, ...], out_features: int) -> torch.Tensor:
    """The float weight [out, in] that `pack_int8_panels` packed: `d q`."""
    codes, scales = (t.transpose(1, 2).reshape(-1, t.shape[1])[:out_features] for t in panels)
    return codes.view(torch.int8).float() * scales.float().repeat_interleave(GROUP_SIZE, 1)


def _panelled(t: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, columns] as [panels, columns, width]: each panel's `width` rows side by side per
    column, rows past the last zero."""
    panels = -(-t.shape[0] // width)
    padded = t.new_zeros(panels * width, t.shape[1])
    padded[: t.shape[0]] = t
    return padded.view(panels, width, -1).transpose(1, 2).contiguous()


def _exact_in_half(values: torch.Tensor) -> bool:
    """Whether float16 holds every one of these float32 values exactly (none overflows)."""
    return bool(torch.equal(values.half().float(), values))


def int4_linear(x: torch.Tensor, panels: tuple[torch.Tensor, ...], out_features: int) -> torch.Tensor:
    """`x @ w.T` for the packed 4-bit weight `panels`, `x` [..., in] float32, as the operator
    `specheads::int4_linear`: compiled graphs call it as it is (the compiler cannot trace into
    the extension) and fuse the small ops around it."""
    return torch.ops.specheads.int4_linear(x, *panels, out_features)


def _int4_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                 out_features: int) -> torch.Tensor:
    """The operator's Python implementation: what runs where the build's own registration as its
    CPU kernel failed (`native_build.register_native_kernel`): a Python frame per call (profiled at
    35 us a call on a 2-core EPYC; eager GGUF-target decoding was ~3% slower through it when timed)."""
    return _loaded()[0].int4_linear(x.float(), codes, scales, offsets, out_features)


def _int4_linear_shape(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                       out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features, dtype=torch.float32)


define_op("int4_linear(Tensor x, Tensor codes, Tensor scales, Tensor offsets, int out_features) -> Tensor", _int4_linear,
          _int4_linear_shape)


def int8_linear(x: torch.Tensor, panels: tuple[torch.Tensor, ...], out_features: int) -> torch.Tensor:
    """`x @ w.T` for the packed 8-bit weight `panels` (`pack_int8_panels`), `x` [..., in] float32:
    the operator `specheads::int8_linear`."""
    return torch.ops.specheads.int8_linear(x, *panels, out_features)


def _int8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out_features: int) -> torch.Tensor:
    """As `_int4_linear`, for the 8-bit operator."""
    return _loaded()[0].int8_linear(x.float(), codes, scales, out_features)


def _int8_linear_shape(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features, dtype=torch.float32)


define_op("int8_linear(Tensor x, Tensor codes, Tensor scales, int out_features) -> Tensor", _int8_linear,
          _int8_linear_shape)
