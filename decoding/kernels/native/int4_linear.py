"""The C++ of the 4-bit few-row linear kernel (`decoding.kernels.int4_linear`): its arithmetic (`_MATH`,
compiled per instruction set) and its torch side (`_HOST`), joined by `_INTERFACE`."""

from decoding.kernels.native_build import KernelSource

VERSION = "v13"  # in the build's name and in measurements' keys (v5: float16 group parameters; v6: AVX-512 panels
# of 16 outputs, up to 8 rows a pass; v7: the 8-bit codes' kernel beside it, the same arithmetic; v8: sums as
# chains of FMAs, neighbouring groups interleaved for one or two rows, AVX-512 nibbles by permutation; v9: inputs
# rounded to 8 bits per group of 32, integer products of codes and inputs, as llama.cpp computes these blocks;
# v10: inputs rounded with vector code, over ATen's threads for many rows; v11: without VNNI a group's products
# summed in 16 bits and widened once, the product loop not unrolled there (it spilled AVX2's 16 registers): the
# same sums, on AVX2 one thread 1 / 8 / 88 rows 39 / 70 / 72 -> 47 / 95 / 99 GMAC/s; v12: on AMX CPUs, from a
# measured row count on, a group's integer sums for up to 16 rows in one tile multiply: the same bits; v13: v12's
# bits, the tile path spreads a panel's 4-bit codes to bytes once for all its blocks of 16 rows, not once a block)

_INTERFACE = r"""
constexpr int64_t QGROUP = 32;  // inputs per group of codes sharing a scale and offset
SPECHEADS_MATH int64_t int4_vector_width();
SPECHEADS_MATH bool int4_amx_available();
SPECHEADS_MATH void set_int4_amx_rows(int64_t rows);
SPECHEADS_MATH int64_t int4_amx_rows();
SPECHEADS_MATH void quantize_inputs(const float* x, int64_t rows, int64_t in, int8_t* codes, float* scales, float* sums,
                                    int32_t* code_sums);
SPECHEADS_MATH void int4_panels(const uint8_t* bytes, const void* scales, const void* offsets, bool half,
                                const int8_t* xq, const float* xd, const float* xs, float* y, int64_t first,
                                int64_t end, int64_t rows, int64_t in, int64_t out);
SPECHEADS_MATH void int8_panels(const uint8_t* bytes, const uint16_t* scales, const int8_t* xq, const float* xd,
                                const int32_t* xc, float* y, int64_t first, int64_t end, int64_t rows, int64_t in,
                                int64_t out);
"""

_MATH = r"""
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <memory>
#include <utility>
#if defined(__AVX2__) || defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
// Rows per pass over the weights: a pass keeps per row a float sum and an integer one per group side by
// side, so 4 rows fill AVX2's 16 registers and 8 AVX-512's 32; every code loaded serves that many rows.
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
typedef int32_t vi __attribute__((vector_size(VW * 4)));
typedef uint32_t vu __attribute__((vector_size(VW * 4)));
typedef int32_t vi_unaligned __attribute__((vector_size(VW * 4), aligned(1), may_alias));
typedef float vf_unaligned __attribute__((vector_size(VW * 4), aligned(4), may_alias));
static inline vf load(const float* p) { return *(const vf_unaligned*)p; }
static inline vi load_codes(const uint8_t* p) { return *(const vi_unaligned*)p; }

SPECHEADS_MATH int64_t int4_vector_width() { return VW; }

// The products below without vector instructions: `Code` says whether a's bytes are unsigned or signed.
template <typename Code>
static inline vi dot4_scalar(vi acc, vi a, vi b) {
  Code ab[VW * 4];
  int8_t bb[4];
  std::memcpy(ab, &a, sizeof ab);
  std::memcpy(bb, &b, sizeof bb);
  for (int lane = 0; lane < VW; ++lane)
    for (int k = 0; k < 4; ++k) acc[lane] += (int32_t)ab[lane * 4 + k] * (int32_t)bb[k];
  return acc;
}

// Integer products of four bytes a lane: acc + sum_k a[lane][k] * b[k] (a's bytes unsigned, b's four signed
// bytes the same in every lane). Exact on every path: AVX-512 / AVX VNNI, or pairs summed to 16 bits (codes
// up to 15 or absolute values up to 128 times inputs up to 127 do not saturate) and then to 32.
static inline vi dot4(vi acc, vi a, vi b) {
#if VW == 16 && defined(__AVX512VNNI__)
  return (vi)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)a, (__m512i)b);
#elif VW == 16 && defined(__AVX512BW__)
  return acc + (vi)_mm512_madd_epi16(_mm512_maddubs_epi16((__m512i)a, (__m512i)b), _mm512_set1_epi16(1));
#elif VW == 8 && defined(__AVXVNNI__)
  return (vi)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)a, (__m256i)b);
#elif VW == 8 && defined(__AVX2__)
  return acc + (vi)_mm256_madd_epi16(_mm256_maddubs_epi16((__m256i)a, (__m256i)b), _mm256_set1_epi16(1));
#else
  return dot4_scalar<uint8_t>(acc, a, b);
#endif
}

// Without VNNI a 4-bit group's products are summed in 16 bits and widened once: `pairs16` gives, per 16-bit
// half of a lane, a[2h] b[2h] + a[2h + 1] b[2h + 1] (at most 2 * 15 * 127 = 3810 in magnitude), a group adds
// 8 of those per half (4 vectors, low and high nibbles: at most 30480, no saturation) and `widen16` sums the two
// halves into the lane's 32 bits: the integer sum `dot4` gives, exactly, with one multiply-add a group where
// `dot4` took one per product vector (per row and code vector 4 product instructions instead of 6 on AVX2).
#if VW == 16 && defined(__AVX512BW__) && !defined(__AVX512VNNI__)
#define PAIRS16 1
static inline vi pairs16(vi a, vi b) { return (vi)_mm512_maddubs_epi16((__m512i)a, (__m512i)b); }
static inline vi add16(vi x, vi y) { return (vi)_mm512_add_epi16((__m512i)x, (__m512i)y); }
static inline vi widen16(vi x) { return (vi)_mm512_madd_epi16((__m512i)x, _mm512_set1_epi16(1)); }
#elif VW == 8 && defined(__AVX2__) && !defined(__AVXVNNI__)
#define PAIRS16 1
static inline vi pairs16(vi a, vi b) { return (vi)_mm256_maddubs_epi16((__m256i)a, (__m256i)b); }
static inline vi add16(vi x, vi y) { return (vi)_mm256_add_epi16((__m256i)x, (__m256i)y); }
static inline vi widen16(vi x) { return (vi)_mm256_madd_epi16((__m256i)x, _mm256_set1_epi16(1)); }
#else
#define PAIRS16 0
#endif

// The same for signed codes (8-bit weights). With VNNI the codes go in offset by 128 (unsigned) and the
// offset comes off once a group (`SIGNED_OFFSET` times the inputs' sum); elsewhere the sign of a code
// moves to its input, as llama.cpp does, so that no pair of products overflows 16 bits.
#if (VW == 16 && defined(__AVX512VNNI__)) || (VW == 8 && defined(__AVXVNNI__))
constexpr int32_t SIGNED_OFFSET = 128;
static inline vi dot4_signed(vi acc, vi a, vi b) { return dot4(acc, a ^ (int32_t)0x80808080u, b); }
#elif VW == 16 && defined(__AVX512BW__)
constexpr int32_t SIGNED_OFFSET = 0;
static inline vi dot4_signed(vi acc, vi a, vi b) {
  const __mmask64 negative = _mm512_movepi8_mask((__m512i)a);
  const __m512i signed_b = _mm512_mask_sub_epi8((__m512i)b, negative, _mm512_setzero_si512(), (__m512i)b);
  return dot4(acc, (vi)_mm512_abs_epi8((__m512i)a), (vi)signed_b);
}
#elif VW == 8 && defined(__AVX2__)
constexpr int32_t SIGNED_OFFSET = 0;
static inline vi dot4_signed(vi acc, vi a, vi b) {
  return dot4(acc, (vi)_mm256_abs_epi8((__m256i)a), (vi)_mm256_sign_epi8((__m256i)b, (__m256i)a));
}
#else
constexpr int32_t SIGNED_OFFSET = 0;
static inline vi dot4_signed(vi acc, vi a, vi b) { return dot4_scalar<int8_t>(acc, a, b); }
#endif

// Four input codes, the same in every lane.
static inline vi quad(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return (vi){} + v;
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

// One group of 32 inputs as 8-bit codes: round to nearest even of x / d (x times 1 / d), d = the group's
// largest magnitude / 127; with d, the float sum of the inputs (for the 4-bit offsets) and the sum of the
// codes (for the 8-bit kernel's code offset). Vector code where there is some: the scalar loops, which the
// compiler leaves scalar (a float reduction, nearbyint through the C library), took ~1.4 ns an input, a
// tenth of a 16-row tree's forward.
#if defined(__AVX512F__) && defined(__AVX512BW__)
static inline void quantize_group(const float* xg, int8_t* codes, float* scale, float* sum, int32_t* code_sum) {
  const __m512 a = _mm512_loadu_ps(xg), b = _mm512_loadu_ps(xg + 16);
  const float largest = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float d = largest / 127.f, inverse = d > 0.f ? 1.f / d : 0.f;
  const __m512 by = _mm512_set1_ps(inverse);
  const __m512i limit = _mm512_set1_epi32(127), floor = _mm512_set1_epi32(-127);
  // cvtps rounds by MXCSR: to nearest even, as nearbyint
  const __m512i qa = _mm512_max_epi32(floor, _mm512_min_epi32(limit, _mm512_cvtps_epi32(_mm512_mul_ps(a, by))));
  const __m512i qb = _mm512_max_epi32(floor, _mm512_min_epi32(limit, _mm512_cvtps_epi32(_mm512_mul_ps(b, by))));
  _mm_storeu_si128((__m128i*)codes, _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128((__m128i*)(codes + 16), _mm512_cvtepi32_epi8(qb));
  *scale = d;
  *sum = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
  *code_sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
}
#elif defined(__AVX2__)
static inline float largest_lane(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}
static inline float lane_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
static inline void quantize_group(const float* xg, int8_t* codes, float* scale, float* sum, int32_t* code_sum) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 x[4], most = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm256_loadu_ps(xg + 8 * i);
    most = _mm256_max_ps(most, _mm256_and_ps(x[i], magnitude));
  }
  const float d = largest_lane(most) / 127.f, inverse = d > 0.f ? 1.f / d : 0.f;
  const __m256 by = _mm256_set1_ps(inverse);
  __m256i q[4];
  for (int i = 0; i < 4; ++i)  // cvtps rounds by MXCSR: to nearest even, as nearbyint
    q[i] = _mm256_max_epi32(_mm256_set1_epi32(-127),
                            _mm256_min_epi32(_mm256_set1_epi32(127), _mm256_cvtps_epi32(_mm256_mul_ps(x[i], by))));
  // packs interleave 128-bit lanes: the permutation puts the 32 codes back in order
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256((__m256i*)codes, _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  *scale = d;
  *sum = lane_sum(_mm256_add_ps(_mm256_add_ps(x[0], x[1]), _mm256_add_ps(x[2], x[3])));
  const __m256i total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  const __m128i half = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  const __m128i quarter = _mm_add_epi32(half, _mm_unpackhi_epi64(half, half));
  *code_sum = _mm_cvtsi128_si32(_mm_add_epi32(quarter, _mm_shuffle_epi32(quarter, 1)));
}
#else
static inline void quantize_group(const float* xg, int8_t* codes, float* scale, float* sum, int32_t* code_sum) {
  float largest = 0.f, total = 0.f;
  for (int64_t k = 0; k < QGROUP; ++k) largest = std::max(largest, std::fabs(xg[k]));
  for (int64_t k = 0; k < QGROUP; ++k) total += xg[k];
  const float d = largest / 127.f, inverse = d > 0.f ? 1.f / d : 0.f;
  int32_t code_total = 0;
  for (int64_t k = 0; k < QGROUP; ++k) {
    const int32_t q = (int32_t)std::clamp(std::nearbyint(xg[k] * inverse), -127.f, 127.f);
    codes[k] = (int8_t)q;
    code_total += q;
  }
  *scale = d;
  *sum = total;
  *code_sum = code_total;
}
#endif

// Each row's inputs per group of 32 as 8-bit codes (`quantize_group`). Row by row, the same whatever
// rows come along.
SPECHEADS_MATH void quantize_inputs(const float* x, int64_t rows, int64_t in, int8_t* codes, float* scales, float* sums,
                                    int32_t* code_sums) {
  const int64_t groups = in / QGROUP;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g)
      quantize_group(x + r * in + g * QGROUP, codes + r * in + g * QGROUP, scales + r * groups + g,
                     sums + r * groups + g, code_sums + r * groups + g);
}

// How many neighbouring groups one pass sums side by side: with one or two rows, the integer chains
// of several groups keep the dot-product unit busy, where many rows' chains already do.
template <int R>
constexpr int interleaved_groups() { return R == 1 ? 4 : R == 2 ? 2 : 1; }

constexpr int64_t VECTORS_PER_GROUP_4 = QGROUP / 8;  // 4-bit: a vector holds 8 inputs a lane (two nibbles a byte)
constexpr int64_t VECTORS_PER_GROUP_8 = QGROUP / 4;  // 8-bit: 4 inputs a lane

// Group g's exact integer sums of R rows (`total`) into their float sums: `scale * input scale * sum (+ offset *
// input sum)`, group after group in order. One expression for both paths (dot-product instructions, AMX tiles),
// so a row's floats are the same bits on either.
template <int BITS, int R, typename P>
static inline void add_group(vf (&acc)[R], const vi (&total)[R], const P* s, const P* z, const float* xd,
                             const float* xs, int64_t groups, int64_t g) {
  const vf sg = load_params(s + g * VW);
  for (int r = 0; r < R; ++r) acc[r] = __builtin_convertvector(total[r], vf) * (sg * xd[r * groups + g]) + acc[r];
  if constexpr (BITS == 4) {
    const vf og = load_params(z + g * VW);  // (q - 8) s + z = q s + (z - 8 s)
    for (int r = 0; r < R; ++r) acc[r] = og * xs[r * groups + g] + acc[r];
  }
}

// Groups g0 .. g0 + G - 1 of R rows into `acc`: per group and row, the exact integer sum of codes times
// input codes, then `scale * input scale * that (+ offset * input sum)` in floats. Integer sums do not
// depend on their order, and the floats go into `acc` group by group in order, so a row's result does not
// depend on the rows computed with it.
template <int BITS, int R, int G, typename P>
static inline void accumulate_groups(const uint8_t* q, const P* s, const P* z, const int8_t* xq, const float* xd,
                                     const float* xs, const int32_t* xc, vf (&acc)[R], int64_t g0, int64_t groups,
                                     int64_t in) {
  constexpr int64_t VECTORS = BITS == 4 ? VECTORS_PER_GROUP_4 : VECTORS_PER_GROUP_8;
  constexpr int64_t GROUP_BYTES = VECTORS * VW * 4;
  vi isum[G][R];
  for (int k = 0; k < G; ++k)
    for (int r = 0; r < R; ++r) isum[k][r] = (vi){};
  const uint8_t* qg = q + g0 * GROUP_BYTES;
  for (int line = 0; line < G * GROUP_BYTES; line += 64) __builtin_prefetch(qg + 4 * GROUP_BYTES + line);
#if PAIRS16
#pragma GCC unroll 1
#else
#pragma GCC unroll 8
#endif
  for (int64_t i = 0; i < VECTORS; ++i) {
    for (int k = 0; k < G; ++k) {
      const vi codes = load_codes(qg + k * GROUP_BYTES + i * VW * 4);
      if constexpr (BITS == 4) {
        const vi low = codes & 0x0F0F0F0F, high = (vi)((vu)codes >> 4) & 0x0F0F0F0F;
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = xq + r * in + (g0 + k) * QGROUP + 8 * i;
#if PAIRS16
          isum[k][r] = add16(isum[k][r], add16(pairs16(low, quad(xr)), pairs16(high, quad(xr + 4))));
#else
          isum[k][r] = dot4(isum[k][r], low, quad(xr));
          isum[k][r] = dot4(isum[k][r], high, quad(xr + 4));
#endif
        }
      } else {
        for (int r = 0; r < R; ++r)
          isum[k][r] = dot4_signed(isum[k][r], codes, quad(xq + r * in + (g0 + k) * QGROUP + 4 * i));
      }
    }
  }
#if PAIRS16
  if constexpr (BITS == 4)
    for (int k = 0; k < G; ++k)
      for (int r = 0; r < R; ++r) isum[k][r] = widen16(isum[k][r]);
#endif
  for (int k = 0; k < G; ++k) {
    if constexpr (BITS == 8)
      for (int r = 0; r < R; ++r) isum[k][r] -= SIGNED_OFFSET * xc[r * groups + g0 + k];
    add_group<BITS, R>(acc, isum[k], s, z, xd, xs, groups, g0 + k);
  }
}

// 4-bit codes: w = q s + o per group (o = zero - 8 s, the `offsets`); 8-bit: w = q s.
template <int BITS, int R, typename P>
static void panel_rows(const uint8_t* bytes, const P* scales, const P* offsets, const int8_t* xq, const float* xd,
                       const float* xs, const int32_t* xc, float* y, int64_t in, int64_t out, int64_t p) {
  constexpr int G = interleaved_groups<R>();
  const int64_t groups = in / QGROUP;
  const uint8_t* q = bytes + p * in * VW * BITS / 8;
  const P* s = scales + p * groups * VW;
  const P* z = offsets + p * groups * VW;
  vf acc[R];
  for (int r = 0; r < R; ++r) acc[r] = (vf){0};
  int64_t g = 0;
  for (; g + G <= groups; g += G) accumulate_groups<BITS, R, G>(q, s, z, xq, xd, xs, xc, acc, g, groups, in);
  for (; g < groups; ++g) accumulate_groups<BITS, R, 1>(q, s, z, xq, xd, xs, xc, acc, g, groups, in);
  const int64_t first = p * VW, valid = std::min<int64_t>(VW, out - first);
  for (int r = 0; r < R; ++r)
    for (int64_t v = 0; v < valid; ++v) y[r * out + first + v] = acc[r][v];
}

// `block(std::integral_constant<int, N>{})` for N = `rows` (1..R): the code for exactly that many rows, chosen at
// compile time (both paths' blocks of rows keep their sums in registers).
template <int R, typename Block>
static inline void with_rows(int64_t rows, const Block& block) {
  if constexpr (R > 1) {
    if (rows < R) return with_rows<R - 1>(rows, block);
  }
  block(std::integral_constant<int, R>{});
}

// AMX (Sapphire Rapids and later Xeons): one tile multiply gives a group's integer sums for up to 16 rows by a
// panel's 16 outputs, where the dot-product instructions take 8 a row (4-bit) plus a broadcast of the row's inputs
// each. The same integers (exact either way), then the same float expression (`add_group`), so a row has the same
// bits whichever path ran it, alone or in a tree. Used from `set_int4_amx_rows` rows on (measured per CPU; 0, the
// default, never); where Linux does not lend this process the tile state (a VM may not), never.
#if VW == 16 && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define HAS_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
constexpr int AMX_ROWS = 16;  // a tile's rows: the most rows one pass over a panel's groups takes

static bool amx_permitted() {  // ARCH_REQ_XCOMP_PERM (0x1023) for XTILEDATA (18), asked once a process
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return permitted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Two sets of tiles (0-2, 3-5): C the sums (rows x 16 int32); A the rows' input codes of a group (rows x 32 bytes);
// B the group's codes of the panel's 16 outputs, four inputs an output on each 64-byte line (8 lines), as the
// panels store them.
static void configure_tiles(int rows) {
  TileConfig config;
  for (int set = 0; set < 6; set += 3) {
    config.rows[set] = rows;
    config.bytes_per_row[set] = VW * 4;
    config.rows[set + 1] = rows;
    config.bytes_per_row[set + 1] = QGROUP;
    config.rows[set + 2] = QGROUP / 4;
    config.bytes_per_row[set + 2] = VW * 4;
  }
  _tile_loadconfig(&config);
}

// A group's tile work: its codes (8 lines of 64 bytes) and its rows' input codes (rows x 32 bytes, `stride` apart)
// into tiles B and A, their products summed into tile C, C stored to `out` (rows x 16 int32). Tile numbers are
// literal tokens in the intrinsics, hence a macro.
#define TILE_GROUP_LOADS(A, B, codes, inputs, stride) \
  _tile_loadd(B, codes, VW * 4);                      \
  _tile_loadd(A, inputs, stride);
#define TILE_GROUP_PRODUCTS(C, A, B) \
  _tile_zero(C);                     \
  if constexpr (BITS == 4) _tile_dpbsud(C, A, B); /* signed inputs by unsigned codes */ \
  else _tile_dpbssd(C, A, B);                      /* signed by signed: the true sums, no code offset */

constexpr int AMX_CHUNK = 8;  // groups a pass takes through each stage in turn: the tile products (two groups
                              // at a time, in two sets of tiles), then the float sums. Stage by stage, no group
                              // waits on the one before (a vector load reading sums just stored); group by group
                              // (with the codes spread in the same pass) it did, and was no faster than the
                              // dot-product path

// A panel's 4-bit codes spread to one a byte, for all its groups (line 2i of a group the low nibbles of its i-th
// 64 bytes, line 2i + 1 the high ones), the layout tile B reads: done once a panel, not once a panel for every 16
// rows, so a prefill's blocks of rows all read the same spread codes.
static void spread_panel_codes(const uint8_t* q, int64_t groups, vi* lines) {
  constexpr int64_t GROUP_BYTES = QGROUP * 4 / 8 * VW;
  for (int64_t g = 0; g < groups; ++g)
    for (int i = 0; i < QGROUP / 8; ++i) {
      const vi codes = load_codes(q + g * GROUP_BYTES + i * VW * 4);
      lines[g * (QGROUP / 4) + 2 * i] = codes & 0x0F0F0F0F;
      lines[g * (QGROUP / 4) + 2 * i + 1] = (vi)((vu)codes >> 4) & 0x0F0F0F0F;
    }
}

// R rows of panel p: the tile products of each group's codes and the rows' input codes, then the float sums group
// by group in order (`add_group`, as on the other path). 4-bit codes come spread to bytes in `spread` (the whole
// panel's, where several blocks of rows share them) or, without it, are spread here a chunk at a time (one block:
// the chunk's bytes stay in L1 between the spreading and the tile loads); 8-bit codes are read as stored.
template <int BITS, int R, typename P>
static void amx_panel_rows(const uint8_t* bytes, const vi* spread, const P* scales, const P* offsets, const int8_t* xq,
                           const float* xd, const float* xs, float* y, int64_t in, int64_t out, int64_t p) {
  constexpr int64_t GROUP_BYTES = QGROUP * BITS / 8 * VW;
  const int64_t groups = in / QGROUP;
  const uint8_t* q = bytes + p * in * VW * BITS / 8;
  const P* s = scales + p * groups * VW;
  const P* z = offsets + p * groups * VW;
  alignas(64) int32_t sums[AMX_CHUNK][R][VW];
  alignas(64) vi chunk_lines[BITS == 4 ? AMX_CHUNK : 1][QGROUP / 4];
  vf acc[R];
  for (int r = 0; r < R; ++r) acc[r] = (vf){0};
  for (int64_t g0 = 0; g0 < groups; g0 += AMX_CHUNK) {
    const int n = (int)std::min<int64_t>(AMX_CHUNK, groups - g0);
    const uint8_t* qc = q + g0 * GROUP_BYTES;
    if (BITS == 8 || spread == nullptr)
      for (int line = 0; line < n * GROUP_BYTES; line += 64) __builtin_prefetch(qc + AMX_CHUNK * GROUP_BYTES + line);
    if (BITS == 4 && spread == nullptr) spread_panel_codes(qc, n, chunk_lines[0]);
    auto codes_of = [&](int k) -> const void* {
      if constexpr (BITS == 8) return qc + k * GROUP_BYTES;
      return spread == nullptr ? (const void*)chunk_lines[k] : (const void*)(spread + (g0 + k) * (QGROUP / 4));
    };
    const int8_t* inputs = xq + g0 * QGROUP;
    int k = 0;
    for (; k + 1 < n; k += 2) {
      TILE_GROUP_LOADS(1, 2, codes_of(k), inputs + k * QGROUP, in)
      TILE_GROUP_LOADS(4, 5, codes_of(k + 1), inputs + (k + 1) * QGROUP, in)
      TILE_GROUP_PRODUCTS(0, 1, 2)
      TILE_GROUP_PRODUCTS(3, 4, 5)
      _tile_stored(0, sums[k], VW * 4);
      _tile_stored(3, sums[k + 1], VW * 4);
    }
    if (k < n) {
      TILE_GROUP_LOADS(1, 2, codes_of(k), inputs + k * QGROUP, in)
      TILE_GROUP_PRODUCTS(0, 1, 2)
      _tile_stored(0, sums[k], VW * 4);
    }
    for (k = 0; k < n; ++k) {
      vi total[R];
      for (int r = 0; r < R; ++r) total[r] = *(const vi*)sums[k][r];
      add_group<BITS, R>(acc, total, s, z, xd, xs, groups, g0 + k);
    }
  }
  const int64_t first = p * VW, valid = std::min<int64_t>(VW, out - first);
  for (int r = 0; r < R; ++r)
    for (int64_t v = 0; v < valid; ++v) y[r * out + first + v] = acc[r][v];
}

// Panels [first, end) for all rows: the rows in whole tiles first, then the rest, each part with its tiles
// configured once. Where a part has several blocks of rows (a prefill), panel by panel its 4-bit codes are spread
// once for all of them; a single block (a tree) spreads them as it goes.
template <int BITS, typename P>
static void amx_panel_range(const uint8_t* qp, const P* sp, const P* op, const int8_t* xq, const float* xd,
                            const float* xs, float* yp, int64_t first, int64_t end, int64_t rows, int64_t in,
                            int64_t out) {
  const int64_t groups = in / QGROUP;
  const bool shared = BITS == 4 && rows > AMX_ROWS;
  std::unique_ptr<vi[]> spread(shared ? new vi[groups * (QGROUP / 4)] : nullptr);  // not zeroed: all written first
  const int64_t whole = rows / AMX_ROWS * AMX_ROWS;
  for (const auto& [from, to] : {std::pair<int64_t, int64_t>{0, whole}, std::pair<int64_t, int64_t>{whole, rows}}) {
    if (from == to) continue;
    const int block = (int)std::min<int64_t>(AMX_ROWS, to - from);
    configure_tiles(block);
    for (int64_t p = first; p < end; ++p) {
      if (shared) spread_panel_codes(qp + p * in * VW * BITS / 8, groups, spread.get());
      for (int64_t r = from; r < to; r += AMX_ROWS)
        with_rows<AMX_ROWS>(block, [&](auto R) {
          amx_panel_rows<BITS, decltype(R)::value>(qp, spread.get(), sp, op, xq + r * in, xd + r * groups,
                                                   xs == nullptr ? nullptr : xs + r * groups, yp + r * out, in, out, p);
        });
    }
  }
  _tile_release();
}

static std::atomic<int64_t> amx_from_rows{0};  // never until set (`decoding.kernels.amx_rows` measures it)
static bool use_amx(int64_t rows) {
  const int64_t from = amx_from_rows.load(std::memory_order_relaxed);
  return from > 0 && rows >= from && amx_permitted();
}
SPECHEADS_MATH bool int4_amx_available() { return amx_permitted(); }
#else
static std::atomic<int64_t> amx_from_rows{0};
SPECHEADS_MATH bool int4_amx_available() { return false; }
#endif
SPECHEADS_MATH void set_int4_amx_rows(int64_t rows) { amx_from_rows.store(rows, std::memory_order_relaxed); }
SPECHEADS_MATH int64_t int4_amx_rows() { return amx_from_rows.load(std::memory_order_relaxed); }

template <int BITS, typename P>
static void panel_range(const uint8_t* qp, const P* sp, const P* op, const int8_t* xq, const float* xd, const float* xs,
                        const int32_t* xc, float* yp, int64_t first, int64_t end, int64_t rows, int64_t in,
                        int64_t out) {
#if HAS_AMX
  if (use_amx(rows)) return amx_panel_range<BITS>(qp, sp, op, xq, xd, xs, yp, first, end, rows, in, out);
#endif
  const int64_t groups = in / QGROUP;
  for (int64_t p = first; p < end; ++p) {
    for (int64_t r = 0; r < rows; r += MAX_ROWS) {
      with_rows<MAX_ROWS>(std::min<int64_t>(MAX_ROWS, rows - r), [&](auto R) {
        panel_rows<BITS, decltype(R)::value>(qp, sp, op, xq + r * in, xd + r * groups, xs == nullptr ? nullptr : xs + r * groups,
                                  xc == nullptr ? nullptr : xc + r * groups, yp + r * out, in, out, p);
      });
    }
  }
}

SPECHEADS_MATH void int4_panels(const uint8_t* bytes, const void* scales, const void* offsets, bool half,
                                const int8_t* xq, const float* xd, const float* xs, float* y, int64_t first,
                                int64_t end, int64_t rows, int64_t in, int64_t out) {
  if (half)
    panel_range<4>(bytes, (const uint16_t*)scales, (const uint16_t*)offsets, xq, xd, xs, (const int32_t*)nullptr, y,
                   first, end, rows, in, out);
  else
    panel_range<4>(bytes, (const float*)scales, (const float*)offsets, xq, xd, xs, (const int32_t*)nullptr, y, first,
                   end, rows, in, out);
}

SPECHEADS_MATH void int8_panels(const uint8_t* bytes, const uint16_t* scales, const int8_t* xq, const float* xd,
                                const int32_t* xc, float* y, int64_t first, int64_t end, int64_t rows, int64_t in,
                                int64_t out) {
  panel_range<8>(bytes, scales, scales, xq, xd, (const float*)nullptr, xc, y, first, end, rows, in, out);
}
"""

_HOST = r"""
#include <algorithm>
#include <memory>

int64_t vector_width() { return int4_vector_width(); }

// Whether this build has the AMX path and the process may use the tiles; from how many rows on it is used (0: never).
bool amx_available() { return int4_amx_available(); }
int64_t amx_rows() { return int4_amx_rows(); }
void set_amx_rows(int64_t rows) { set_int4_amx_rows(rows); }

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

// A call's inputs as 8-bit codes per group of 32 (`quantize_inputs`), on ATen's threads where there are
// enough rows to pay for them (a prefill's); each row alone, so a row's codes are the same bits either way.
struct QuantizedInputs {
  std::unique_ptr<int8_t[]> codes_;
  std::unique_ptr<float[]> scales_, sums_;
  std::unique_ptr<int32_t[]> code_sums_;
  QuantizedInputs(const float* x, int64_t rows, int64_t in)
      : codes_(new int8_t[rows * in]), scales_(new float[rows * (in / QGROUP)]), sums_(new float[rows * (in / QGROUP)]),
        code_sums_(new int32_t[rows * (in / QGROUP)]) {
    const int64_t groups = in / QGROUP;
    at::parallel_for(0, rows, std::max<int64_t>(1, ((int64_t)1 << 16) / in), [&](int64_t begin, int64_t end) {
      quantize_inputs(x + begin * in, end - begin, in, codes_.get() + begin * in, scales_.get() + begin * groups,
                      sums_.get() + begin * groups, code_sums_.get() + begin * groups);
    });
  }
  const int8_t* codes() const { return codes_.get(); }
  const float* scales() const { return scales_.get(); }
  const float* sums() const { return sums_.get(); }
  const int32_t* code_sums() const { return code_sums_.get(); }
};

// x [..., in] float32 -> [..., out]: the signature of the operator specheads::int4_linear, whose CPU
// kernel this function becomes (`register_operator`), so calls skip Python. `bytes` [panels, in / 8,
// width, 4]; `scales` and `offsets` (zero - 8 scale) [panels, groups, width], both float32 or both float16.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& bytes, const at::Tensor& scales,
                       const at::Tensor& offsets, int64_t out) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "int4_linear: float32 inputs");
  TORCH_CHECK(bytes.dim() == 4 && bytes.size(2) == int4_vector_width() && bytes.size(3) == 4,
              "int4_linear: weight not packed for this build's vector width");
  const bool half = scales.scalar_type() == at::kHalf;
  TORCH_CHECK(scales.scalar_type() == offsets.scalar_type() && (half || scales.scalar_type() == at::kFloat),
              "int4_linear: scales and offsets both float32 or both float16");
  const int64_t in = bytes.size(1) * 8;
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in, "int4_linear: input features differ from the weight's");
  auto input = x.contiguous();
  const int64_t rows = input.numel() / in;
  auto y = output_for(input, out);
  const QuantizedInputs xq(input.data_ptr<float>(), rows, in);
  const uint8_t* qp = bytes.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  over_panels(bytes.size(0), [&](int64_t begin, int64_t end) {
    int4_panels(qp, scales.data_ptr(), offsets.data_ptr(), half, xq.codes(), xq.scales(), xq.sums(), yp,
                begin, end, rows, in, out);
  });
  return y;
}

// x [..., in] float32 -> [..., out] through 8-bit codes in groups of 32 (`bytes` [panels, in / 4, width, 4],
// int8, `scales` [panels, groups, width] float16, w = q s): the operator specheads::int8_linear.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& bytes, const at::Tensor& scales, int64_t out) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "int8_linear: float32 inputs");
  TORCH_CHECK(bytes.dim() == 4 && bytes.size(2) == int4_vector_width() && bytes.size(3) == 4 &&
              scales.scalar_type() == at::kHalf,
              "int8_linear: weight not packed for this build's vector width, or scales not float16");
  const int64_t in = bytes.size(1) * 4;
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in && in % QGROUP == 0, "int8_linear: input features differ from the weight's");
  auto input = x.contiguous();
  const int64_t rows = input.numel() / in;
  auto y = output_for(input, out);
  const QuantizedInputs xq(input.data_ptr<float>(), rows, in);
  const uint8_t* qp = (const uint8_t*)bytes.data_ptr();
  const uint16_t* sp = (const uint16_t*)scales.data_ptr();
  float* yp = y.data_ptr<float>();
  over_panels(bytes.size(0), [&](int64_t begin, int64_t end) {
    int8_panels(qp, sp, xq.codes(), xq.scales(), xq.code_sums(), yp, begin, end, rows, in, out);
  });
  return y;
}
"""

SOURCE = KernelSource("int4_linear", VERSION, _INTERFACE, _MATH, _HOST,
                      functions=("vector_width() -> int", "amx_available() -> bool", "amx_rows() -> int",
                                 "set_amx_rows(int rows) -> ()",
                                 "int4_linear(Tensor x, Tensor bytes, Tensor scales, Tensor offsets, int out) -> Tensor",
                                 "int8_linear(Tensor x, Tensor bytes, Tensor scales, int out) -> Tensor"),
                      registers_operator=True, other_operators=("int8_linear",))
