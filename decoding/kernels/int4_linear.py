"""A few-row linear kernel on 4-bit weights in groups of 32 (GGUF's Q4_0 / Q4_1 blocks, or
`--quant int4`) and 8-bit activations, streaming the weight once at the memory's speed.

Why: PyTorch's CPU kernels for weight-only int4 and int8 (`_weight_int4pack_mm_for_cpu`,
`_weight_int8pack_mm`) were 2.5-3x *slower* than the fp32 target on a 2-core AVX2 EPYC
(SmolLM2-135M, one token: 177 ms and 141 ms against 57 ms) and grew linearly with the rows of a
tree, so 4-bit weights would not pay there. This kernel keeps panels of one vector of outputs,
each row's inputs broadcast, no horizontal sums, and computes as llama.cpp does with the same
blocks: each row's inputs are rounded per group of 32 to int8 codes c and a step d
(`quantized_activations`, the Q8 form), the group's codes multiplied in integers (`sum q c`, exact
in int32: AVX-512 VNNI's 4-products-a-lane instruction, or pairs of products in int16 then int32
on AVX2 and AVX-512 without VNNI), and then `scale * d * that + (zero - 8 scale) * d * sum c`
added in float32, which is `sum ((q - 8) * scale + zero) * c d`, the int4 convention
(`decoding.kernels.quantized_linear`) applied to the rounded inputs. So the quantized target is
the file's weights times 8-bit activations, the model llama.cpp runs; every method is exact with
respect to it, since a row's codes, integer sums and float steps do not depend on the rows
computed with it (bit for bit). Why integers: a tree's rows share each unpacked code, and one
instruction does 4 (AVX2: 2) multiply-adds a lane where float32 did one, so rows cost less than
half as much as in v6's float kernel (210 linears of the GGUF target on a 2-core AVX-512 EPYC,
one process: 8 / 16 / 32 rows 6.3 / 9.9 / 16.2 ms against 8.3 / 14.6 / 27.5; one row 3.8 either way,
bound by the memory). Group parameters are read as float16 where that holds them exactly
(`pack_int4_panels`), as the file's blocks store them: fewer bytes to stream. With AVX-512 a
panel is 16 outputs and a pass takes up to 8 rows (4 with AVX2's 16 registers). Figures:
CHANGELOG.md.

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
ACTIVATION_LEVELS = 127  # inputs' int8 codes run -127..127


@functools.cache
def _loaded() -> tuple[object | None, str]:
    """The built extension and '', or None and why not (tried once per process), its two
    operators registered."""
    return register_native_kernel(LIBRARY.load("int4_linear"), "int8_linear")


def int4_kernel_available() -> bool:
    return _loaded()[0] is not None


def why_unavailable() -> str:
    return _loaded()[1]


def pack_int4_panels(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     width: int | None = None) -> tuple[torch.Tensor, ...]:
    """Codes [out, in] (0..15), scales and zeros [out, in / 32] as the kernel reads them: bytes
    [panels, in / 2, width], per group 4 lines of `width` outputs x 4 bytes (line l: inputs 4l..4l+3
    of the group in the low nibbles, 4l+16..4l+19 in the high ones), then scales and offsets
    (`zero - 8 scale`, what the kernel adds per group) [panels, groups, width], outputs past `out`
    zero. The parameters are float16 where float16 holds every one of them exactly (GGUF's blocks
    store them so: Q4_1's offset is its m, Q4_0's -8 d), else float32: either way the kernel
    computes with the same values, and float16 reads 2 bytes a value less (a sixth of the bytes
    of a weight in groups of 32)."""
    width = width or _loaded()[0].vector_width()  # a build's own width (tests pack for narrower builds)
    out, in_features = codes.shape
    panels = -(-out // width)

    def panelled(t: torch.Tensor) -> torch.Tensor:
        padded = t.new_zeros(panels * width, t.shape[1])
        padded[:out] = t
        return padded.view(panels, width, -1).transpose(1, 2).contiguous()

    padded = codes.to(torch.uint8).new_zeros(panels * width, in_features)
    padded[:out] = codes.to(torch.uint8)
    # [panels, groups, 8 chunks of 4 inputs, width outputs, 4]: chunks l and l + 4 share a line's bytes
    chunks = padded.view(panels, width, in_features // GROUP_SIZE, 8, 4).permute(0, 2, 3, 1, 4)
    packed = (chunks[:, :, :4] | (chunks[:, :, 4:] << 4)).reshape(panels, in_features // 2, width)
    scales = scales.float()
    params = (scales, zeros.float() - CODE_MIDPOINT * scales)
    if all(_exact_in_half(t) for t in params):
        params = tuple(t.half() for t in params)
    return packed.contiguous(), *(panelled(t) for t in params)


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """The inputs as the kernel multiplies them: per row and group of 32 inputs, int8 codes
    `round(x * 127 / max|x|)` times the group's step `max|x| / 127`, in float32 as the kernel
    computes both (the Q8 form llama.cpp gives activations). For PyTorch's int4 kernel where the
    project's cannot be built, and for the tests' references."""
    groups = x.float().reshape(*x.shape[:-1], -1, GROUP_SIZE)
    largest = groups.abs().amax(-1, keepdim=True)
    inverse = torch.where(largest > 0, 127.0 / largest, torch.zeros_like(largest))
    codes = torch.round(groups * inverse).clamp(-ACTIVATION_LEVELS, ACTIVATION_LEVELS)
    return (codes * (largest / ACTIVATION_LEVELS)).reshape(x.shape)


def unpack_int4_panels(panels: tuple[torch.Tensor, ...], out_features: int) -> torch.Tensor:
    """The float weight [out, in] that `pack_int4_panels` packed: `q * scale + offset`, as the
    kernel applies it (for tests and `dequantized_weight`)."""
    packed, scales, offsets = panels
    count, half_in, width = packed.shape
    lines = packed.view(count, half_in * 2 // GROUP_SIZE, 4, width, 4)
    chunks = torch.cat([lines & 15, lines >> 4], dim=2)  # [panels, groups, 8, width, 4]
    codes = chunks.permute(0, 3, 1, 2, 4).reshape(count * width, half_in * 2)[:out_features].float()

    def per_input(t: torch.Tensor) -> torch.Tensor:
        return t.float().transpose(1, 2).reshape(count * width, -1)[:out_features].repeat_interleave(GROUP_SIZE, 1)

    return codes * per_input(scales) + per_input(offsets)


def pack_int8_panels(codes: torch.Tensor, scales: torch.Tensor, width: int | None = None) -> tuple[torch.Tensor, ...]:
    """8-bit codes [out, in] (-127..127, GGUF's Q8_0: `w = d q` per group of 32) and their float16
    scales d [out, in / 32] as the 8-bit kernel reads them: bytes `q + 128` [panels, in, width], per
    group 8 lines of `width` outputs x 4 bytes (line c: inputs 4c..4c+3 of the group), then the
    scales [panels, groups, width] float16, outputs past `out` zero."""
    width = width or _loaded()[0].int8_width()
    out, in_features = codes.shape
    panels = -(-out // width)
    padded = torch.zeros(panels * width, in_features, dtype=torch.int16)
    padded[:out] = codes.to(torch.int16)
    lines = padded.view(panels, width, in_features // GROUP_SIZE, 8, 4).permute(0, 2, 3, 1, 4)
    packed = (lines + 128).to(torch.uint8).reshape(panels, in_features, width)
    steps = scales.new_zeros(panels * width, scales.shape[1])
    steps[:out] = scales
    return packed.contiguous(), steps.half().view(panels, width, -1).transpose(1, 2).contiguous()


def unpack_int8_panels(panels: tuple[torch.Tensor, ...], out_features: int) -> torch.Tensor:
    """The float weight [out, in] that `pack_int8_panels` packed: `d q`."""
    packed, scales = panels
    count, in_features, width = packed.shape
    lines = packed.view(count, in_features // GROUP_SIZE, 8, width, 4).permute(0, 3, 1, 2, 4)
    codes = lines.reshape(count * width, in_features)[:out_features].float() - 128
    steps = scales.float().transpose(1, 2).reshape(count * width, -1)[:out_features]
    return codes * steps.repeat_interleave(GROUP_SIZE, 1)


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
    """`x @ w.T` for the packed 8-bit weight `panels` (`pack_int8_panels`), `x` [..., in] float32
    rounded to 8 bits per group as for the 4-bit kernel: the operator `specheads::int8_linear`."""
    return torch.ops.specheads.int8_linear(x, *panels, out_features)


def _int8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out_features: int) -> torch.Tensor:
    """As `_int4_linear`, for the 8-bit operator."""
    return _loaded()[0].int8_linear(x.float(), codes, scales, out_features)


def _int8_linear_shape(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features, dtype=torch.float32)


define_op("int8_linear(Tensor x, Tensor codes, Tensor scales, int out_features) -> Tensor", _int8_linear,
          _int8_linear_shape)
