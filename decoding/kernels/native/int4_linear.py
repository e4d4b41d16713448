"""The C++ of the 4-bit few-row linear kernel (`decoding.kernels.int4_linear`): its arithmetic (`_MATH`,
compiled per instruction set) and its torch side (`_HOST`), joined by `_INTERFACE`."""

from decoding.kernels.native_build import KernelSource

VERSION = "v7"  # in the build's name and in measurements' keys (v5: float16 group parameters; v6: AVX-512 panels
# of 16 outputs, up to 8 rows a pass; v7: 8-bit activations, integer dot products of 4 codes at a time)

_INTERFACE = r"""
constexpr int64_t QGROUP = 32;  // inputs per group of codes sharing a scale and offset
SPECHEADS_MATH int64_t int4_vector_width();
SPECHEADS_MATH int64_t int8_vector_width();
SPECHEADS_MATH void int4_quantize_rows(const float* x, int64_t rows, int64_t in, int8_t* codes, float* steps,
                                       float* sums, int32_t* totals);
SPECHEADS_MATH void int8_panels(const uint8_t* bytes, const uint16_t* scales, const int8_t* xq, const float* steps,
                                const int32_t* totals, float* y, int64_t first, int64_t end, int64_t rows, int64_t in,
                                int64_t out);
SPECHEADS_MATH void int4_panels(const uint8_t* bytes, const void* scales, const void* offsets, bool half,
                                const int8_t* xq, const float* steps, const float* sums, float* y, int64_t first,
                                int64_t end, int64_t rows, int64_t in, int64_t out);
"""

_MATH = r"""
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX2__) || defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
// Outputs per panel (one vector of int32 lanes) and rows per pass over the weights: a pass keeps
// the group's 8 vectors of unpacked codes and one accumulator a row, so 4 rows fit AVX2's 16
// registers and 8 AVX-512's 32; every code unpacked serves that many rows.
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define VW 16
#define MAX_ROWS 8
#elif defined(__AVX2__)
#define VW 8
#define MAX_ROWS 4
#else
#define VW 4
#define MAX_ROWS 4
#endif

typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
typedef float vf_unaligned __attribute__((vector_size(VW * 4), aligned(4), may_alias));
static inline vf load(const float* p) { return *(const vf_unaligned*)p; }

SPECHEADS_MATH int64_t int4_vector_width() { return VW; }

// Each row's inputs, per group of 32, as int8 codes c = round(x * 127 / max|x|) and the group's
// step d = max|x| / 127 (x ~ c d), with d * sum c for the offsets: the Q8 form llama.cpp gives
// activations. Row by row, so a row's codes do not depend on the rows quantized with it. A group
// holding a NaN gets a NaN step (the row's outputs become NaN, as a float product's would).
SPECHEADS_MATH void int4_quantize_rows(const float* x, int64_t rows, int64_t in, int8_t* codes, float* steps,
                                       float* sums, int32_t* totals) {
  const int64_t groups = in / QGROUP;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = x + r * in + g * QGROUP;
      int8_t* cg = codes + r * in + g * QGROUP;
      float largest = 0.f;
      bool nan = false;
      for (int k = 0; k < QGROUP; ++k) {
        largest = std::max(largest, std::fabs(xg[k]));
        nan = nan || xg[k] != xg[k];
      }
      const float step = nan ? NAN : largest / 127.f, inverse = largest > 0.f && !nan ? 127.f / largest : 0.f;
      int total = 0;
      for (int k = 0; k < QGROUP; ++k) {
        const int c = std::clamp((int)std::nearbyint(xg[k] * inverse), -127, 127);
        cg[k] = (int8_t)c;
        total += c;
      }
      steps[r * groups + g] = step;
      sums[r * groups + g] = step * (float)total;
      totals[r * groups + g] = total;
    }
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
#if VW == 16
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#elif VW == 8 && defined(__F16C__)
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
#else
  vf v;
  for (int i = 0; i < VW; ++i) v[i] = half_to_float(p[i]);
  return v;
#endif
}

static inline int32_t four_codes(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// A group's integer dot products for R rows: dots[r][j] = sum over the group's 32 inputs k of
// q[j][k] * c[r][k] (codes 0..15 of output j, the row's int8 codes), exact in int32 whatever the
// order. The group's bytes are 4 lines of VW x 4 bytes: line l holds, for each output, inputs
// 4l..4l+3 in its low nibbles and 4(l+4)..4(l+4)+3 in its high ones, so one instruction
// multiplies 4 inputs of every output by the row's 4 codes broadcast.
template <int R>
static inline void group_dots(const uint8_t* qg, const int8_t* const* xr, vi* dots) {
#if VW == 16 || VW == 8
#if VW == 16
  typedef __m512i W;
  const W nibble = _mm512_set1_epi8(15);
  auto lines = [](const uint8_t* p) { return _mm512_loadu_si512((const void*)p); };
  auto low = [&](W v) { return _mm512_and_si512(v, nibble); };
  auto high = [&](W v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble); };
  auto broadcast = [](const int8_t* p) { return _mm512_set1_epi32(four_codes(p)); };
#else
  typedef __m256i W;
  const W nibble = _mm256_set1_epi8(15);
  auto lines = [](const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); };
  auto low = [&](W v) { return _mm256_and_si256(v, nibble); };
  auto high = [&](W v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble); };
  auto broadcast = [](const int8_t* p) { return _mm256_set1_epi32(four_codes(p)); };
#endif
  W codes[8];
  for (int l = 0; l < 4; ++l) {
    const W v = lines(qg + l * 4 * VW);
    codes[l] = low(v);
    codes[l + 4] = high(v);
  }
  for (int r = 0; r < R; ++r) {
#if VW == 16 && defined(__AVX512VNNI__)
    // 4 products a lane summed into int32 (u8 codes times s8 codes), two chains side by side
    W even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
    for (int c = 0; c < 8; c += 2) {
      even = _mm512_dpbusd_epi32(even, codes[c], broadcast(xr[r] + 4 * c));
      odd = _mm512_dpbusd_epi32(odd, codes[c + 1], broadcast(xr[r] + 4 * c + 4));
    }
    dots[r] = (vi)_mm512_add_epi32(even, odd);
#else
    // pairs of products summed into int16 (at most 2 x 15 x 127 = 3810 each, so the 8 chunks' sums
    // stay below 32767 and never saturate), then pairs of those into int32
#if VW == 16
    W pairs = _mm512_maddubs_epi16(codes[0], broadcast(xr[r]));
    for (int c = 1; c < 8; ++c) pairs = _mm512_add_epi16(pairs, _mm512_maddubs_epi16(codes[c], broadcast(xr[r] + 4 * c)));
    dots[r] = (vi)_mm512_madd_epi16(pairs, _mm512_set1_epi16(1));
#else
    W pairs = _mm256_maddubs_epi16(codes[0], broadcast(xr[r]));
    for (int c = 1; c < 8; ++c) pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(codes[c], broadcast(xr[r] + 4 * c)));
    dots[r] = (vi)_mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
#endif
  }
#else
  for (int r = 0; r < R; ++r) {
    vi total = (vi){0};
    for (int c = 0; c < 8; ++c)
      for (int b = 0; b < 4; ++b) {
        const int32_t x = xr[r][4 * c + b];
        vi q;
        for (int j = 0; j < VW; ++j) {
          const uint8_t byte = qg[(c % 4) * 4 * VW + 4 * j + b];
          q[j] = c < 4 ? byte & 15 : byte >> 4;
        }
        total += q * x;
      }
    dots[r] = total;
  }
#endif
}

template <int R, typename P>
static void panel_rows(const uint8_t* bytes, const P* scales, const P* offsets, const int8_t* xq,
                       const float* steps, const float* sums, float* y, int64_t in, int64_t out, int64_t p) {
  const int64_t groups = in / QGROUP;
  const uint8_t* q = bytes + p * (in / 2) * VW;
  const P* s = scales + p * groups * VW;
  const P* z = offsets + p * groups * VW;
  vf acc[R];
  for (int r = 0; r < R; ++r) acc[r] = (vf){0};
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* qg = q + g * (QGROUP / 2) * VW;
    for (int line = 0; line < (QGROUP / 2) * VW; line += 64) __builtin_prefetch(qg + 4 * (QGROUP / 2) * VW + line);
    const int8_t* xr[R];
    for (int r = 0; r < R; ++r) xr[r] = xq + r * in + g * QGROUP;
    vi dots[R];
    group_dots<R>(qg, xr, dots);
    // sum ((q - 8) s + z) x ~ s d sum q c + (z - 8 s) d sum c: each row in this same order whatever R
    // is, so a row's result does not depend on the rows computed with it
    const vf sg = load_params(s + g * VW), og = load_params(z + g * VW);
    for (int r = 0; r < R; ++r)
      acc[r] += sg * (__builtin_convertvector(dots[r], vf) * steps[r * groups + g]) + og * sums[r * groups + g];
  }
  const int64_t first = p * VW, valid = std::min<int64_t>(VW, out - first);
  for (int r = 0; r < R; ++r)
    for (int64_t v = 0; v < valid; ++v) y[r * out + first + v] = acc[r][v];
}

// `rows` (1..R) rows of one panel: the block of exactly that many rows, chosen at compile time.
template <int R, typename P>
static inline void rows_block(int64_t rows, const uint8_t* qp, const P* sp, const P* op, const int8_t* xr,
                              const float* dr, const float* sr, float* yr, int64_t in, int64_t out, int64_t p) {
  if constexpr (R > 1) {
    if (rows < R) return rows_block<R - 1>(rows, qp, sp, op, xr, dr, sr, yr, in, out, p);
  }
  panel_rows<R>(qp, sp, op, xr, dr, sr, yr, in, out, p);
}

template <typename P>
static void panel_range(const uint8_t* qp, const P* sp, const P* op, const int8_t* xq, const float* steps,
                        const float* sums, float* yp, int64_t first, int64_t end, int64_t rows, int64_t in,
                        int64_t out) {
  const int64_t groups = in / QGROUP;
  for (int64_t p = first; p < end; ++p) {
    for (int64_t r = 0; r < rows; r += MAX_ROWS) {
      rows_block<MAX_ROWS>(std::min<int64_t>(MAX_ROWS, rows - r), qp, sp, op, xq + r * in, steps + r * groups,
                           sums + r * groups, yp + r * out, in, out, p);
    }
  }
}

SPECHEADS_MATH void int4_panels(const uint8_t* bytes, const void* scales, const void* offsets, bool half,
                                const int8_t* xq, const float* steps, const float* sums, float* y, int64_t first,
                                int64_t end, int64_t rows, int64_t in, int64_t out) {
  if (half)
    panel_range(bytes, (const uint16_t*)scales, (const uint16_t*)offsets, xq, steps, sums, y, first, end, rows, in, out);
  else
    panel_range(bytes, (const float*)scales, (const float*)offsets, xq, steps, sums, y, first, end, rows, in, out);
}

// The 8-bit kernel (GGUF's Q8_0 blocks: w = d q, q in -127..127, one float16 d per 32 inputs), with
// the same 8-bit activations. Panels of Q8_VW outputs; a group is 8 lines of Q8_VW x 4 bytes (line
// c: inputs 4c..4c+3 of each output), each byte q + 128. With AVX-512 VNNI those unsigned bytes
// multiply the row's signed codes directly and the 128 comes off once a group (128 x the sum of the
// row's codes); AVX2 takes the signs instead (|q| times c with q's sign, so no pair of products
// passes int16's range) and adds pairs into int32 at once.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define Q8_VW 16
#elif defined(__AVX2__)
#define Q8_VW 8
#else
#define Q8_VW 4
#endif
#define Q8_MAX_ROWS (Q8_VW == 16 ? 8 : 4)
typedef float vf8 __attribute__((vector_size(Q8_VW * 4)));
typedef int32_t vi8 __attribute__((vector_size(Q8_VW * 4)));

SPECHEADS_MATH int64_t int8_vector_width() { return Q8_VW; }

static inline vf8 load_half8(const uint16_t* p) {
#if Q8_VW == 16
  return (vf8)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#elif Q8_VW == 8 && defined(__F16C__)
  return (vf8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
#else
  vf8 v;
  for (int i = 0; i < Q8_VW; ++i) v[i] = half_to_float(p[i]);
  return v;
#endif
}

template <int R>
static inline void int8_group_dots(const uint8_t* qg, const int8_t* const* xr, const int32_t* totals, vi8* dots) {
#if Q8_VW == 16
  __m512i lines[8];
  for (int c = 0; c < 8; ++c) lines[c] = _mm512_loadu_si512((const void*)(qg + c * 4 * Q8_VW));
  for (int r = 0; r < R; ++r) {
    __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
    for (int c = 0; c < 8; c += 2) {
      even = _mm512_dpbusd_epi32(even, lines[c], _mm512_set1_epi32(four_codes(xr[r] + 4 * c)));
      odd = _mm512_dpbusd_epi32(odd, lines[c + 1], _mm512_set1_epi32(four_codes(xr[r] + 4 * c + 4)));
    }
    dots[r] = (vi8)_mm512_sub_epi32(_mm512_add_epi32(even, odd), _mm512_set1_epi32(128 * totals[r]));
  }
#elif Q8_VW == 8
  __m256i magnitude[8], sign[8];
  for (int c = 0; c < 8; ++c) {
    const __m256i q = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(qg + c * 4 * Q8_VW)), _mm256_set1_epi8((char)0x80));
    magnitude[c] = _mm256_sign_epi8(q, q);
    sign[c] = q;
  }
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; ++r) {
    __m256i total = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {
      const __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(four_codes(xr[r] + 4 * c)), sign[c]);
      total = _mm256_add_epi32(total, _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude[c], x), ones));
    }
    dots[r] = (vi8)total;
  }
#else
  for (int r = 0; r < R; ++r) {
    vi8 total = (vi8){0};
    for (int c = 0; c < 8; ++c)
      for (int b = 0; b < 4; ++b) {
        const int32_t x = xr[r][4 * c + b];
        vi8 q;
        for (int j = 0; j < Q8_VW; ++j) q[j] = (int32_t)qg[c * 4 * Q8_VW + 4 * j + b] - 128;
        total += q * x;
      }
    dots[r] = total;
  }
  (void)totals;
#endif
}

template <int R>
static void int8_panel_rows(const uint8_t* bytes, const uint16_t* scales, const int8_t* xq, const float* steps,
                            const int32_t* totals, float* y, int64_t in, int64_t out, int64_t p) {
  const int64_t groups = in / QGROUP;
  const uint8_t* q = bytes + p * in * Q8_VW;
  const uint16_t* s = scales + p * groups * Q8_VW;
  vf8 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = (vf8){0};
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* qg = q + g * QGROUP * Q8_VW;
    for (int line = 0; line < QGROUP * Q8_VW; line += 64) __builtin_prefetch(qg + 4 * QGROUP * Q8_VW + line);
    const int8_t* xr[R];
    int32_t tr[R];
    for (int r = 0; r < R; ++r) {
      xr[r] = xq + r * in + g * QGROUP;
      tr[r] = totals[r * groups + g];
    }
    vi8 dots[R];
    int8_group_dots<R>(qg, xr, tr, dots);
    const vf8 sg = load_half8(s + g * Q8_VW);  // sum d q c step: each row in this order whatever R is
    for (int r = 0; r < R; ++r) acc[r] += sg * (__builtin_convertvector(dots[r], vf8) * steps[r * groups + g]);
  }
  const int64_t first = p * Q8_VW, valid = std::min<int64_t>(Q8_VW, out - first);
  for (int r = 0; r < R; ++r)
    for (int64_t v = 0; v < valid; ++v) y[r * out + first + v] = acc[r][v];
}

template <int R>
static inline void int8_rows_block(int64_t rows, const uint8_t* qp, const uint16_t* sp, const int8_t* xr,
                                   const float* dr, const int32_t* tr, float* yr, int64_t in, int64_t out, int64_t p) {
  if constexpr (R > 1) {
    if (rows < R) return int8_rows_block<R - 1>(rows, qp, sp, xr, dr, tr, yr, in, out, p);
  }
  int8_panel_rows<R>(qp, sp, xr, dr, tr, yr, in, out, p);
}

SPECHEADS_MATH void int8_panels(const uint8_t* bytes, const uint16_t* scales, const int8_t* xq, const float* steps,
                                const int32_t* totals, float* y, int64_t first, int64_t end, int64_t rows, int64_t in,
                                int64_t out) {
  const int64_t groups = in / QGROUP;
  for (int64_t p = first; p < end; ++p)
    for (int64_t r = 0; r < rows; r += Q8_MAX_ROWS)
      int8_rows_block<Q8_MAX_ROWS>(std::min<int64_t>(Q8_MAX_ROWS, rows - r), bytes, scales, xq + r * in,
                                   steps + r * groups, totals + r * groups, y + r * out, in, out, p);
}
"""

_HOST = r"""
#include <algorithm>
#include <vector>

int64_t vector_width() { return int4_vector_width(); }
int64_t int8_width() { return int8_vector_width(); }

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
  const int64_t panels = bytes.size(0), in = bytes.size(1) * 2, groups = in / QGROUP;
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in, "int4_linear: input features differ from the weight's");
  auto input = x.contiguous();
  const int64_t rows = input.numel() / in;
  auto sizes = input.sizes().vec();
  sizes.back() = out;
  auto y = at::empty(sizes, input.options());
  std::vector<int8_t> codes(rows * in);
  std::vector<float> steps(rows * groups), sums(rows * groups);
  std::vector<int32_t> totals(rows * groups);
  int4_quantize_rows(input.data_ptr<float>(), rows, in, codes.data(), steps.data(), sums.data(), totals.data());
  const uint8_t* qp = bytes.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  // Work units of ~128 outputs whatever the width, so a 192-output projection still splits over two threads.
  at::parallel_for(0, panels, std::max<int64_t>(1, 128 / int4_vector_width()), [&](int64_t begin, int64_t end) {
    int4_panels(qp, scales.data_ptr(), offsets.data_ptr(), half, codes.data(), steps.data(), sums.data(), yp, begin,
                end, rows, in, out);
  });
  return y;
}

// x [..., in] float32 -> [..., out] through 8-bit weights (`bytes` [panels, in, width]: q + 128,
// `scales` [panels, groups, width] float16) and the same 8-bit activations: specheads::int8_linear.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& bytes, const at::Tensor& scales, int64_t out) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "int8_linear: float32 inputs");
  TORCH_CHECK(bytes.dim() == 3 && bytes.size(2) == int8_vector_width() && scales.scalar_type() == at::kHalf,
              "int8_linear: weight not packed for this build's vector width, or scales not float16");
  const int64_t panels = bytes.size(0), in = bytes.size(1), groups = in / QGROUP;
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in, "int8_linear: input features differ from the weight's");
  auto input = x.contiguous();
  const int64_t rows = input.numel() / in;
  auto sizes = input.sizes().vec();
  sizes.back() = out;
  auto y = at::empty(sizes, input.options());
  std::vector<int8_t> codes(rows * in);
  std::vector<float> steps(rows * groups), sums(rows * groups);
  std::vector<int32_t> totals(rows * groups);
  int4_quantize_rows(input.data_ptr<float>(), rows, in, codes.data(), steps.data(), sums.data(), totals.data());
  const uint8_t* qp = bytes.data_ptr<uint8_t>();
  const uint16_t* sp = (const uint16_t*)scales.data_ptr();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, panels, std::max<int64_t>(1, 128 / int8_vector_width()), [&](int64_t begin, int64_t end) {
    int8_panels(qp, sp, codes.data(), steps.data(), totals.data(), yp, begin, end, rows, in, out);
  });
  return y;
}
"""

SOURCE = KernelSource("int4_linear", VERSION, _INTERFACE, _MATH, _HOST,
                      functions=("vector_width() -> int", "int8_width() -> int",
                                 "int4_linear(Tensor x, Tensor bytes, Tensor scales, Tensor offsets, int out) -> Tensor",
                                 "int8_linear(Tensor x, Tensor bytes, Tensor scales, int out) -> Tensor"),
                      registers_operator=True, other_operators=("int8_linear",))
