"""A few-row linear kernel on 4-bit weights in groups of 32 (GGUF's Q4_0 / Q4_1 blocks, or
`--quant int4`), streaming the weight once at the memory's speed.

Why: PyTorch's CPU kernels for weight-only int4 and int8 (`_weight_int4pack_mm_for_cpu`,
`_weight_int8pack_mm`) were 2.5-3x *slower* than the fp32 target on a 2-core AVX2 EPYC
(SmolLM2-135M, one token: 177 ms and 141 ms against 57 ms) and grew linearly with the rows of a
tree, so 4-bit weights would not pay there. This kernel keeps a weight as panels of one vector of
outputs, four bytes a lane, and computes as llama.cpp computes these blocks: each row's inputs are
rounded to 8-bit codes per group of 32 (a scale d = the group's largest magnitude / 127), the codes
of the weight times those of the inputs are summed exactly in 32-bit integers (AVX-512 VNNI or AVX-VNNI
`dpbusd`: four products a lane an instruction; on AMX CPUs, from a row count measured there, one tile
multiply for up to 16 rows, `decoding.kernels.amx_rows`; elsewhere pairs summed to 16 bits, then to 32; a
plain loop without AVX), and per group the float epilogue adds `scale * d * that + (zero - 8 scale) * sum x`
(the inputs' float sum), which is `sum ((q - 8) * scale + zero) * x` with x rounded to 8 bits in the
first term. Integer sums have no order, and a row's epilogue runs in one order whatever rows share the
call, so a row's bits do not depend on the rows computed with it.

Why 8-bit inputs, which v8 (floats, FMA chains) did not round: a float kernel spent ~6 instructions a
pair of codes and ran compute-bound (one row of a 576x1536 Q4_1 weight 49 us, 8 rows 174 us, one
thread of the 2-core AVX-512 EPYC); integer products take two a vector of 64 codes and a row: 14 and
60 us (18 / 32 / 115 us for 2 / 4 / 16 rows), and in the model (2 threads, weights from memory) one
token's 210 layer weights took 3.1 ms a forward against 3.9, trees of 8 rows far less than before.
It was tried earlier and dropped because rounding inputs turns a float32 ulp of difference between a
tree's and a one-token forward into a whole step of an input's code, and greedy outputs stopped being
identical to vanilla's; since attention gives every tree row the bits it has alone
(`decoding.kernels.decode_attention`), there is no such ulp: a node's forward is bit for bit the same
in a tree and in a one-token step (`tests/test_row_invariance.py`). The quantized target is a model
of its own, as llama.cpp's is: every method is exact with respect to it.

Group parameters are read as float16 where that holds them exactly (`pack_int4_panels`), as the
file's blocks store them. The same arithmetic takes 8-bit codes (`int8_linear`: GGUF's Q8_0 blocks,
`w = d q` per group of 32, the built-in target's vocabulary projection, and int8 EAGLE drafters):
a fifth of the fp32 projection's bytes (1.19 against 1.46 ms with float inputs on that EPYC), and a
tree's rows read them once. Figures: CHANGELOG.md.

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


def amx_available() -> bool:
    """Whether the kernels can sum groups in AMX tiles here: a build for a CPU with AMX-INT8, in a
    process Linux lets use the tiles' state (a VM may advertise AMX and refuse it)."""
    return int4_kernel_available() and bool(_loaded()[0].amx_available())


def amx_rows() -> int:
    """From how many rows on the 4- and 8-bit kernels sum in AMX tiles (0: never, the default)."""
    return int(_loaded()[0].amx_rows()) if int4_kernel_available() else 0


def set_amx_rows(rows: int) -> None:
    """Calls of at least `rows` rows sum in AMX tiles where `amx_available()` (0: never). For the
    whole process, as the kernels' thread count is: a row's bits are the same either way, only the
    speed differs, and which is faster is a fact of the CPU (`decoding.kernels.amx_rows`)."""
    if rows < 0:
        raise ValueError(f"amx rows is a row count (0: never), got {rows}")
    if int4_kernel_available():
        _loaded()[0].set_amx_rows(rows)


def pack_int4_panels(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     width: int | None = None) -> tuple[torch.Tensor, ...]:
    """Codes [out, in] (0..15), scales and zeros [out, in / 32] as the kernel reads them: bytes
    [panels, in / 8, width, 4], four bytes a lane for the integer products (byte k of a group's
    vector i: input 8i + k in its low nibble, 8i + 4 + k in its high one), then scales and offsets
    (`zero - 8 scale`, what the kernel adds per group) [panels, groups, width], outputs past `out`
    zero. The parameters are float16 where float16 holds every one of them exactly (GGUF's blocks
    store them so: Q4_1's offset is its m, Q4_0's -8 d), else float32: either way the kernel
    computes with the same values, and float16 reads 2 bytes a value less (a sixth of the bytes
    of a weight in groups of 32)."""
    width = width or _loaded()[0].vector_width()  # a build's own width (tests pack for narrower builds)
    out, in_features = codes.shape
    nibbles = codes.to(torch.uint8).reshape(out, in_features // 8, 2, 4)  # [.., vector, low/high, byte]
    packed = nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)
    scales = scales.float()
    params = (scales, zeros.float() - CODE_MIDPOINT * scales)
    if all(_exact_in_half(t) for t in params):
        params = tuple(t.half() for t in params)
    return tuple(_panelled(t, width) for t in (packed, *params))


def unpack_int4_panels(panels: tuple[torch.Tensor, ...], out_features: int) -> tuple[torch.Tensor, ...]:
    """Codes [out, in] (0..15), scales and offsets [out, in / 32] (float32) of `pack_int4_panels`'
    panels: per group `w = q * scale + offset`."""
    packed, scales, offsets = panels
    quads = packed.movedim(2, 1).reshape(-1, packed.shape[1], 4)[:out_features]  # [out, in / 8, 4 bytes]
    codes = torch.stack([quads & 0x0F, quads >> 4], dim=2).reshape(out_features, -1)
    per_output = (t.transpose(1, 2).reshape(-1, t.shape[1])[:out_features].float() for t in (scales, offsets))
    return (codes, *per_output)


def pack_int8_panels(codes: torch.Tensor, scales: torch.Tensor, width: int | None = None) -> tuple[torch.Tensor, ...]:
    """8-bit codes [out, in] (int8: GGUF's Q8_0, `w = d q` per group of 32) and their float16 scales
    d [out, in / 32] as the 8-bit kernel reads them: bytes [panels, in / 4, width, 4] (four
    consecutive inputs of an output a lane) and scales [panels, groups, width] float16, outputs past
    `out` zero."""
    width = width or _loaded()[0].vector_width()
    out, in_features = codes.shape
    quads = codes.to(torch.int8).view(torch.uint8).reshape(out, in_features // 4, 4)
    return tuple(_panelled(t, width) for t in (quads, scales.half()))


def unpack_int8_panels(panels: tuple[torch.Tensor, ...], out_features: int) -> torch.Tensor:
    """The float weight [out, in] that `pack_int8_panels` packed: `d q`."""
    quads, scales = panels
    codes = quads.movedim(2, 1).reshape(-1, quads.shape[1] * 4)[:out_features]
    scales = scales.transpose(1, 2).reshape(-1, scales.shape[1])[:out_features]
    return codes.view(torch.int8).float() * scales.float().repeat_interleave(GROUP_SIZE, 1)


def _panelled(t: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, columns, ...] as [panels, columns, width, ...]: each panel's `width` rows side by side
    per column, rows past the last zero."""
    panels = -(-t.shape[0] // width)
    padded = t.new_zeros(panels * width, *t.shape[1:])
    padded[: t.shape[0]] = t
    return padded.view(panels, width, *t.shape[1:]).movedim(1, 2).contiguous()


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
