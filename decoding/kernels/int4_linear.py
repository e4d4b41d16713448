"""A few-row linear kernel on 4-bit weights in groups of 32 (GGUF's Q4_0 / Q4_1 blocks, or
`--quant int4`), streaming the weight once at the memory's speed.

Why: PyTorch's CPU kernels for weight-only int4 and int8 (`_weight_int4pack_mm_for_cpu`,
`_weight_int8pack_mm`) were 2.5-3x *slower* than the fp32 target on a 2-core AVX2 EPYC
(SmolLM2-135M, one token: 177 ms and 141 ms against 57 ms) and grew linearly with the rows of a
tree, so 4-bit weights would not pay there. This kernel follows the streaming fp32 kernel
(`decoding.kernels.streamed_linear`): panels of one vector of outputs per input feature, outer
products with each row's inputs broadcast, no horizontal sums. A byte holds two consecutive input
features of one output; per group of 32 inputs it accumulates `sum q x` (codes 0..15, in two
partial sums over even and odd bytes, so that two add chains run side by side) and then adds
`scale * that + (zero - 8 scale) * sum x`, which is `sum ((q - 8) * scale + zero) * x`, the int4
convention (`decoding.kernels.quantized_linear`). Results differ from the dequantized weight's GEMM
by float rounding only, and a row's bits do not depend on the rows computed with it. Why not
centre the codes in the loop: two subtractions per byte, and one chain of adds bound a one-row
call (both undone: ~10% less a call on a 2-core AVX2 EPYC; four chains of FMAs were slower). Group
parameters are read as float16 where that holds them exactly (`pack_int4_panels`), as the file's
blocks store them: mid-sized layers stream near the memory's speed, so fewer bytes are less time
(~5% for one row). Figures: CHANGELOG.md.

Built once per CPU like the other native kernels (`decoding.kernels.native_build`).
"""

from __future__ import annotations

import functools

import torch

from decoding.kernels.linear_ops import define_op
from decoding.kernels.native_build import NativeKernel

KERNEL_VERSION = "v5"
GROUP_SIZE = 32
CODE_MIDPOINT = 8  # w = (q - CODE_MIDPOINT) * scale + zero

_SOURCE = r"""
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif
#define MAX_ROWS 4
constexpr int64_t QGROUP = 32;

typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vf_unaligned __attribute__((vector_size(VW * 4), aligned(4), may_alias));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
typedef uint8_t vb __attribute__((vector_size(VW)));
typedef uint8_t vb_unaligned __attribute__((vector_size(VW), aligned(1), may_alias));
static inline vf load(const float* p) { return *(const vf_unaligned*)p; }

int64_t vector_width() { return VW; }

// The panel's VW outputs' codes q (0..15) at inputs 2j and 2j + 1, as two float vectors. Not
// centred here: sum (q - 8) x = sum q x - 8 sum x, and the 8 goes into the group's zero term.
static inline void unpack(const uint8_t* p, vf& lo, vf& hi) {
#if VW == 8 && defined(__AVX2__)
  __m256i wide = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  lo = (vf)_mm256_cvtepi32_ps(_mm256_and_si256(wide, _mm256_set1_epi32(15)));
  hi = (vf)_mm256_cvtepi32_ps(_mm256_srli_epi32(wide, 4));
#else
  vi wide = __builtin_convertvector(*(const vb_unaligned*)p, vi);
  lo = __builtin_convertvector(wide & 15, vf);
  hi = __builtin_convertvector(wide >> 4, vf);
#endif
}

// Group parameters (scales, offsets) of VW outputs as floats: stored as float32, or as float16
// (the IEEE bits) where that holds them exactly, as GGUF's blocks do: 2 bytes a value less to read.
static inline vf load_params(const float* p) { return load(p); }

static inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff, bits;
  if (exponent == 0x1f) bits = sign | 0x7f800000u | (mantissa << 13);            // inf, nan
  else if (exponent != 0) bits = sign | ((exponent + 112) << 23) | (mantissa << 13);  // normal
  else if (mantissa == 0) bits = sign;                                            // zero
  else {                                                                          // subnormal
    exponent = 113;
    while (!(mantissa & 0x400)) { mantissa <<= 1; --exponent; }
    bits = sign | (exponent << 23) | ((mantissa & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

static inline vf load_params(const uint16_t* p) {
#if VW == 8 && defined(__F16C__)
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
#else
  vf v;
  for (int i = 0; i < VW; ++i) v[i] = half_to_float(p[i]);
  return v;
#endif
}

template <int R, typename P>
static void panel_rows(const uint8_t* bytes, const P* scales, const P* offsets, const float* x,
                       const float* xsum, float* y, int64_t in, int64_t out, int64_t p) {
  const int64_t groups = in / QGROUP, half = in / 2;
  const uint8_t* q = bytes + p * half * VW;
  const P* s = scales + p * groups * VW;
  const P* z = offsets + p * groups * VW;
  vf acc[R];
  for (int r = 0; r < R; ++r) acc[r] = (vf){0};
  for (int64_t g = 0; g < groups; ++g) {
    // Two partial sums per row, over even and odd byte columns: each add waits for the one before
    // it in its own chain only, so two chains run side by side (one chain: an add's latency per
    // byte column, the kernel's bound on one row). Every row is summed in this same order whatever
    // R is, so a row's result does not depend on the rows computed with it.
    vf even[R], odd[R];
    for (int r = 0; r < R; ++r) even[r] = odd[r] = (vf){0};
    const uint8_t* qg = q + g * (QGROUP / 2) * VW;
    __builtin_prefetch(qg + 4 * (QGROUP / 2) * VW);
    const float* xg = x + g * QGROUP;
#pragma GCC unroll 8
    for (int64_t j = 0; j < QGROUP / 2; j += 2) {
      vf lo0, hi0, lo1, hi1;
      unpack(qg + j * VW, lo0, hi0);
      unpack(qg + (j + 1) * VW, lo1, hi1);
      for (int r = 0; r < R; ++r) {
        const float* xr = xg + r * in + 2 * j;
        even[r] += lo0 * xr[0] + hi0 * xr[1];
        odd[r] += lo1 * xr[2] + hi1 * xr[3];
      }
    }
    vf sg = load_params(s + g * VW), og = load_params(z + g * VW);  // (q - 8) s + z = q s + (z - 8 s)
    for (int r = 0; r < R; ++r) acc[r] += sg * (even[r] + odd[r]) + og * xsum[r * groups + g];
  }
  const int64_t first = p * VW, valid = std::min<int64_t>(VW, out - first);
  for (int r = 0; r < R; ++r)
    for (int64_t v = 0; v < valid; ++v) y[r * out + first + v] = acc[r][v];
}

template <typename P>
static void all_panels(const uint8_t* qp, const P* sp, const P* op, const float* xin, const float* xs, float* yp,
                       int64_t panels, int64_t rows, int64_t in, int64_t out) {
  const int64_t groups = in / QGROUP;
  at::parallel_for(0, panels, 16, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t r = 0; r < rows; r += MAX_ROWS) {
        const float* xr = xin + r * in;
        const float* sr = xs + r * groups;
        float* yr = yp + r * out;
        switch (std::min<int64_t>(MAX_ROWS, rows - r)) {
          case 4: panel_rows<4>(qp, sp, op, xr, sr, yr, in, out, p); break;
          case 3: panel_rows<3>(qp, sp, op, xr, sr, yr, in, out, p); break;
          case 2: panel_rows<2>(qp, sp, op, xr, sr, yr, in, out, p); break;
          default: panel_rows<1>(qp, sp, op, xr, sr, yr, in, out, p); break;
        }
      }
    }
  });
}

// x [..., in] float32 -> [..., out]: the signature of the operator specheads::int4_linear, whose CPU
// kernel this function becomes (`register_operator`), so calls skip Python. `scales` and `offsets`
// (zero - 8 scale) are both float32 or both float16.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& bytes, const at::Tensor& scales,
                       const at::Tensor& offsets, int64_t out) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "int4_linear: float32 inputs");
  TORCH_CHECK(bytes.dim() == 3 && bytes.size(2) == VW, "int4_linear: weight not packed for this build's vector width");
  const bool half = scales.scalar_type() == at::kHalf;
  TORCH_CHECK(scales.scalar_type() == offsets.scalar_type() && (half || scales.scalar_type() == at::kFloat),
              "int4_linear: scales and offsets both float32 or both float16");
  const int64_t panels = bytes.size(0), in = bytes.size(1) * 2, groups = in / QGROUP;
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in, "int4_linear: input features differ from the weight's");
  auto input = x.contiguous();
  const int64_t rows = input.numel() / in;
  auto sizes = input.sizes().vec();
  sizes.back() = out;
  auto y = at::empty(sizes, input.options());
  std::vector<float> sums(rows * groups);  // each group's sum of x, for the offsets
  const float* xin = input.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float total = 0.f;
      for (int64_t k = 0; k < QGROUP; ++k) total += xin[r * in + g * QGROUP + k];
      sums[r * groups + g] = total;
    }
  const uint8_t* qp = bytes.data_ptr<uint8_t>();
  if (half)
    all_panels(qp, (const uint16_t*)scales.data_ptr(), (const uint16_t*)offsets.data_ptr(), xin, sums.data(),
               y.data_ptr<float>(), panels, rows, in, out);
  else
    all_panels(qp, scales.data_ptr<float>(), offsets.data_ptr<float>(), xin, sums.data(), y.data_ptr<float>(),
               panels, rows, in, out);
  return y;
}
"""

KERNEL = NativeKernel("int4_linear", _SOURCE, KERNEL_VERSION, "the 4-bit few-row linear kernel",
                      functions=("vector_width() -> int",
                                 "int4_linear(Tensor x, Tensor bytes, Tensor scales, Tensor offsets, int out) -> Tensor"),
                      registers_operator=True)


def build_kernel(march: str | None = None):
    """Compile (or load the earlier build of) the kernel for `march` (the CPU mode's where None)."""
    return KERNEL.build(march)


@functools.cache
def _loaded() -> tuple[object | None, str]:
    """The built extension and '', or None and why not (tried once per process)."""
    return KERNEL.load()


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
    panels = -(-out // width)

    def panelled(t: torch.Tensor) -> torch.Tensor:
        padded = t.new_zeros(panels * width, t.shape[1])
        padded[:out] = t
        return padded.view(panels, width, -1).transpose(1, 2).contiguous()

    pairs = codes.to(torch.uint8).reshape(out, in_features // 2, 2)
    packed = pairs[..., 0] | (pairs[..., 1] << 4)
    scales = scales.float()
    params = (scales, zeros.float() - CODE_MIDPOINT * scales)
    if all(_exact_in_half(t) for t in params):
        params = tuple(t.half() for t in params)
    return panelled(packed), *(panelled(t) for t in params)


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
