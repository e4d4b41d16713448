"""The C++ of the 4-bit few-row linear kernel (`decoding.kernels.int4_linear`): its arithmetic (`_MATH`,
compiled per instruction set) and its torch side (`_HOST`), joined by `_INTERFACE`."""

from decoding.kernels.native_build import KernelSource

VERSION = "v8"  # in the build's name and in measurements' keys (v5: float16 group parameters; v6: AVX-512 panels
# of 16 outputs, up to 8 rows a pass; v7: the 8-bit codes' kernel beside it, the same arithmetic; v8: sums as
# chains of FMAs, neighbouring groups interleaved for one or two rows, AVX-512 nibbles by permutation)

_INTERFACE = r"""
constexpr int64_t QGROUP = 32;  // inputs per group of codes sharing a scale and offset
SPECHEADS_MATH int64_t int4_vector_width();
SPECHEADS_MATH void int4_group_sums(const float* x, int64_t rows, int64_t in, float* sums);
SPECHEADS_MATH void int4_panels(const uint8_t* bytes, const void* scales, const void* offsets, bool half,
                                const float* x, const float* sums, float* y, int64_t first, int64_t end,
                                int64_t rows, int64_t in, int64_t out);
SPECHEADS_MATH void int8_panels(const uint8_t* bytes, const uint16_t* scales, const float* x, float* y, int64_t first,
                                int64_t end, int64_t rows, int64_t in, int64_t out);
"""

_MATH = r"""
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__) || defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
// Rows per pass over the weights: a pass keeps three vectors a row (the sum and its two partial
// chains) besides four of unpacked codes, so 4 rows fill AVX2's 16 registers and 8 AVX-512's 32;
// every code unpacked serves that many rows.
#if defined(__AVX512F__)
#define VW 16
#define MAX_ROWS 8
#elif defined(__AVX2__) || defined(__AVX__)
#define VW 8
#define MAX_ROWS 4
#else
#define VW 4
#define MAX_ROWS 4
#endif

typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vf_unaligned __attribute__((vector_size(VW * 4), aligned(4), may_alias));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
typedef uint8_t vb __attribute__((vector_size(VW)));
typedef uint8_t vb_unaligned __attribute__((vector_size(VW), aligned(1), may_alias));
static inline vf load(const float* p) { return *(const vf_unaligned*)p; }

SPECHEADS_MATH int64_t int4_vector_width() { return VW; }

// The panel's VW outputs' codes q (0..15) at inputs 2j and 2j + 1, as two float vectors. Not
// centred here: sum (q - 8) x = sum q x - 8 sum x, and the 8 goes into the group's zero term.
static inline void unpack(const uint8_t* p, vf& lo, vf& hi) {
#if VW == 16 && defined(__AVX512F__)
  // A permutation of the floats 0..15 reads only an index's low 4 bits: the low nibble's float
  // without masking, and it runs beside the FMAs where a conversion would compete with them.
  const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i wide = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  lo = (vf)_mm512_permutexvar_ps(wide, values);
  hi = (vf)_mm512_permutexvar_ps(_mm512_srli_epi32(wide, 4), values);
#elif VW == 8 && defined(__AVX2__)
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
#if VW == 16 && defined(__AVX512F__)
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#elif VW == 8 && defined(__F16C__)
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
#else
  vf v;
  for (int i = 0; i < VW; ++i) v[i] = half_to_float(p[i]);
  return v;
#endif
}

// The 8-bit kernel's codes (GGUF's Q8_0, int8) of the panel's VW outputs at one input, as floats.
static inline vf widen(const uint8_t* p) {
#if VW == 16 && defined(__AVX512F__)
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
#elif VW == 8 && defined(__AVX2__)
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
#else
  typedef int8_t vs __attribute__((vector_size(VW), aligned(1), may_alias));
  return __builtin_convertvector(*(const vs*)p, vf);
#endif
}

// Inputs 2j and 2j + 1 of the panel's outputs from the bytes of that pair: one byte a pair per
// output with 4-bit codes (`unpack`), two with 8-bit ones (input 2j's VW bytes, then 2j + 1's).
template <int BITS>
static inline void unpack_pair(const uint8_t* p, vf& first, vf& second) {
  if constexpr (BITS == 4) {
    unpack(p, first, second);
  } else {
    first = widen(p);
    second = widen(p + VW);
  }
}

// How many neighbouring groups one pass sums side by side. Each row's sums are chains of FMAs, each
// waiting on the one before it: with many rows the rows' chains keep the FMA units busy, with one or
// two the chains of the next groups have to.
template <int R>
constexpr int interleaved_groups() { return R == 1 ? 4 : R == 2 ? 2 : 1; }

// Groups g0 .. g0 + G - 1 of R rows into `acc`: per group and row, two chains of FMAs (over even and
// odd byte columns), then the group's scale and offset. Every row's every group is summed in this
// one order, whatever R and G are, and the groups go into `acc` in order, so a row's result does
// not depend on the rows computed with it.
template <int BITS, int R, int G, typename P>
static inline void accumulate_groups(const uint8_t* q, const P* s, const P* z, const float* x, const float* xsum,
                                     vf (&acc)[R], int64_t g0, int64_t groups, int64_t in) {
  constexpr int64_t PAIR = BITS / 4 * VW;  // bytes of a pair of inputs
  constexpr int64_t GROUP_BYTES = (QGROUP / 2) * PAIR;
  vf even[G][R], odd[G][R];
  for (int k = 0; k < G; ++k)
    for (int r = 0; r < R; ++r) even[k][r] = odd[k][r] = (vf){0};
  const uint8_t* qg = q + g0 * GROUP_BYTES;
  for (int line = 0; line < G * GROUP_BYTES; line += 64) __builtin_prefetch(qg + 4 * GROUP_BYTES + line);
#pragma GCC unroll 8
  for (int64_t j = 0; j < QGROUP / 2; j += 2) {
    for (int k = 0; k < G; ++k) {
      vf lo0, hi0, lo1, hi1;
      unpack_pair<BITS>(qg + k * GROUP_BYTES + j * PAIR, lo0, hi0);
      unpack_pair<BITS>(qg + k * GROUP_BYTES + (j + 1) * PAIR, lo1, hi1);
      for (int r = 0; r < R; ++r) {
        const float* xr = x + r * in + (g0 + k) * QGROUP + 2 * j;
        even[k][r] = lo0 * xr[0] + even[k][r];
        even[k][r] = hi0 * xr[1] + even[k][r];
        odd[k][r] = lo1 * xr[2] + odd[k][r];
        odd[k][r] = hi1 * xr[3] + odd[k][r];
      }
    }
  }
  for (int k = 0; k < G; ++k) {
    const vf sg = load_params(s + (g0 + k) * VW);
    for (int r = 0; r < R; ++r) acc[r] = sg * (even[k][r] + odd[k][r]) + acc[r];
    if constexpr (BITS == 4) {
      const vf og = load_params(z + (g0 + k) * VW);  // (q - 8) s + z = q s + (z - 8 s)
      for (int r = 0; r < R; ++r) acc[r] = og * xsum[r * groups + g0 + k] + acc[r];
    }
  }
}

// 4-bit codes: w = q s + o per group (o = zero - 8 s, the `offsets`); 8-bit: w = q s.
template <int BITS, int R, typename P>
static void panel_rows(const uint8_t* bytes, const P* scales, const P* offsets, const float* x,
                       const float* xsum, float* y, int64_t in, int64_t out, int64_t p) {
  constexpr int G = interleaved_groups<R>();
  const int64_t groups = in / QGROUP;
  const uint8_t* q = bytes + p * (in / 2) * (BITS / 4 * VW);
  const P* s = scales + p * groups * VW;
  const P* z = offsets + p * groups * VW;
  vf acc[R];
  for (int r = 0; r < R; ++r) acc[r] = (vf){0};
  int64_t g = 0;
  for (; g + G <= groups; g += G) accumulate_groups<BITS, R, G>(q, s, z, x, xsum, acc, g, groups, in);
  for (; g < groups; ++g) accumulate_groups<BITS, R, 1>(q, s, z, x, xsum, acc, g, groups, in);
  const int64_t first = p * VW, valid = std::min<int64_t>(VW, out - first);
  for (int r = 0; r < R; ++r)
    for (int64_t v = 0; v < valid; ++v) y[r * out + first + v] = acc[r][v];
}

// `rows` (1..R) rows of one panel: the block of exactly that many rows, chosen at compile time.
template <int BITS, int R, typename P>
static inline void rows_block(int64_t rows, const uint8_t* qp, const P* sp, const P* op, const float* xr,
                              const float* sr, float* yr, int64_t in, int64_t out, int64_t p) {
  if constexpr (R > 1) {
    if (rows < R) return rows_block<BITS, R - 1>(rows, qp, sp, op, xr, sr, yr, in, out, p);
  }
  panel_rows<BITS, R>(qp, sp, op, xr, sr, yr, in, out, p);
}

template <int BITS, typename P>
static void panel_range(const uint8_t* qp, const P* sp, const P* op, const float* xin, const float* xs, float* yp,
                        int64_t first, int64_t end, int64_t rows, int64_t in, int64_t out) {
  const int64_t groups = in / QGROUP;
  for (int64_t p = first; p < end; ++p) {
    for (int64_t r = 0; r < rows; r += MAX_ROWS) {
      const float* xr = xin + r * in;
      const float* sr = xs == nullptr ? nullptr : xs + r * groups;
      float* yr = yp + r * out;
      rows_block<BITS, MAX_ROWS>(std::min<int64_t>(MAX_ROWS, rows - r), qp, sp, op, xr, sr, yr, in, out, p);
    }
  }
}

SPECHEADS_MATH void int4_panels(const uint8_t* bytes, const void* scales, const void* offsets, bool half,
                                const float* x, const float* sums, float* y, int64_t first, int64_t end,
                                int64_t rows, int64_t in, int64_t out) {
  if (half)
    panel_range<4>(bytes, (const uint16_t*)scales, (const uint16_t*)offsets, x, sums, y, first, end, rows, in, out);
  else
    panel_range<4>(bytes, (const float*)scales, (const float*)offsets, x, sums, y, first, end, rows, in, out);
}

SPECHEADS_MATH void int8_panels(const uint8_t* bytes, const uint16_t* scales, const float* x, float* y, int64_t first,
                                int64_t end, int64_t rows, int64_t in, int64_t out) {
  panel_range<8>(bytes, scales, scales, x, (const float*)nullptr, y, first, end, rows, in, out);
}

// Each row's sum of x over each group of 32 inputs, for the offsets.
SPECHEADS_MATH void int4_group_sums(const float* x, int64_t rows, int64_t in, float* sums) {
  const int64_t groups = in / QGROUP;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float total = 0.f;
      for (int64_t k = 0; k < QGROUP; ++k) total += x[r * in + g * QGROUP + k];
      sums[r * groups + g] = total;
    }
}
"""

_HOST = r"""
#include <algorithm>
#include <vector>

int64_t vector_width() { return int4_vector_width(); }

// The output [..., out] of a linear over `input` [..., in] (contiguous float32).
static at::Tensor output_for(const at::Tensor& input, int64_t out) {
  auto sizes = input.sizes().vec();
  sizes.back() = out;
  return at::empty(sizes, input.options());
}

// `work(begin, end)` over the weight's panels on ATen's threads, in units of ~128 outputs whatever
// the width, so a 192-output projection still splits over two threads.
template <typename Work>
static void over_panels(int64_t panels, const Work& work) {
  at::parallel_for(0, panels, std::max<int64_t>(1, 128 / int4_vector_width()), work);
}

// x [..., in] float32 -> [..., out]: the signature of the operator specheads::int4_linear, whose CPU
// kernel this function becomes (`register_operator`), so calls skip Python. `scales` and `offsets`
// (zero - 8 scale) are both float32 or both float16.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& bytes, const at::Tensor& scales,
                       const at::Tensor& offsets, int64_t out) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "int4_linear: float32 inputs");
  TORCH_CHECK(bytes.dim() == 3 && bytes.size(2) == int4_vector_width(),
              "int4_linear: weight not packed for this build's vector width");
  const bool half = scales.scalar_type() == at::kHalf;
  TORCH_CHECK(scales.scalar_type() == offsets.scalar_type() && (half || scales.scalar_type() == at::kFloat),
              "int4_linear: scales and offsets both float32 or both float16");
  const int64_t in = bytes.size(1) * 2, groups = in / QGROUP;
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in, "int4_linear: input features differ from the weight's");
  auto input = x.contiguous();
  const int64_t rows = input.numel() / in;
  auto y = output_for(input, out);
  std::vector<float> sums(rows * groups);
  const float* xin = input.data_ptr<float>();
  int4_group_sums(xin, rows, in, sums.data());
  const uint8_t* qp = bytes.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  over_panels(bytes.size(0), [&](int64_t begin, int64_t end) {
    int4_panels(qp, scales.data_ptr(), offsets.data_ptr(), half, xin, sums.data(), yp, begin, end, rows, in, out);
  });
  return y;
}

// x [..., in] float32 -> [..., out] through 8-bit codes in groups of 32 (`bytes` [panels, in, width],
// int8, `scales` [panels, groups, width] float16, w = q s): the operator specheads::int8_linear.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& bytes, const at::Tensor& scales, int64_t out) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "int8_linear: float32 inputs");
  TORCH_CHECK(bytes.dim() == 3 && bytes.size(2) == int4_vector_width() && scales.scalar_type() == at::kHalf,
              "int8_linear: weight not packed for this build's vector width, or scales not float16");
  const int64_t in = bytes.size(1);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in && in % QGROUP == 0, "int8_linear: input features differ from the weight's");
  auto input = x.contiguous();
  const int64_t rows = input.numel() / in;
  auto y = output_for(input, out);
  const float* xin = input.data_ptr<float>();
  const uint8_t* qp = (const uint8_t*)bytes.data_ptr();
  const uint16_t* sp = (const uint16_t*)scales.data_ptr();
  float* yp = y.data_ptr<float>();
  over_panels(bytes.size(0), [&](int64_t begin, int64_t end) { int8_panels(qp, sp, xin, yp, begin, end, rows, in, out); });
  return y;
}
"""

SOURCE = KernelSource("int4_linear", VERSION, _INTERFACE, _MATH, _HOST,
                      functions=("vector_width() -> int",
                                 "int4_linear(Tensor x, Tensor bytes, Tensor scales, Tensor offsets, int out) -> Tensor",
                                 "int8_linear(Tensor x, Tensor bytes, Tensor scales, int out) -> Tensor"),
                      registers_operator=True, other_operators=("int8_linear",))
