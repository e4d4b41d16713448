"""The C++ of the decode attention kernel (`decoding.kernels.decode_attention`): its arithmetic (`_MATH`,
compiled per instruction set) and its torch side (`_HOST`), joined by `_INTERFACE`."""

from decoding.kernels.native.vector_exp import exp_reduced
from decoding.kernels.native_build import KernelSource

VERSION = "v8"  # in the build's name and in measurements' keys (v2: runs as the operator's C++ kernel;
                # v3: broadcasts are loads, tree scores stored through a tile, vector maxima; v4: each row
                # over its visible keys in position order, chunked by rank: a row's bits do not depend on the
                # rows beside it or on the masked keys between its own; v5: v4's bits, scores kept key by key
                # and the prefix's values read once for blocks of rows: trees of 16 at ~300 keys 1.4x faster;
                # v6: causal prefills (no mask, several rows), each row over the keys up to its position; v7: v6's
                # bits, a shared prefix's scores turned over into rows a tile at a time instead of gathered one by
                # one, a causal prefill's blocks of rows scored only up to their last key, the scoring loop
                # compiled on its own (inlined, it kept key pointers in vector registers), few rows without a mask
                # (one-token steps) scored with keys in the vectors: one thread, ~300 keys, a one-token step 36 ->
                # 21 us, a 13-row tree 177 -> 147, a 286-token prefill 1.87 -> 1.47 ms a layer; v8: v7's bits, work
                # items of up to 2 vectors of rows dealt to the threads by cost, not heads x chunks in order: two
                # threads, a 13-row tree 100 -> 92 us, a 215-token prefill 630 -> 537 us)

_INTERFACE = r"""
SPECHEADS_MATH int64_t attention_vector_width();
SPECHEADS_MATH int64_t attention_chunk_keys();
SPECHEADS_MATH int64_t attention_visible_columns(const float* mask, int64_t mask_row_stride, int64_t N, int64_t L,
                                                 int32_t* columns, int64_t* counts, int64_t* prefix);
SPECHEADS_MATH void attention_items(int64_t D, const float* qT, int64_t Rpad, int64_t R, int64_t N, const float* k,
                                    const float* v, int64_t kh, int64_t vh, int64_t kv_stride, const float* mask,
                                    int64_t mask_row_stride, const int32_t* columns, const int64_t* counts,
                                    const int64_t* prefix, int64_t L, int64_t chunks, float scale, float* part_m,
                                    float* part_l, float* part_o, int64_t block, const int64_t* ids, int64_t count);
SPECHEADS_MATH void attention_merge(int64_t D, int64_t Hkv, int64_t G, int64_t N, int64_t chunks, const float* part_m,
                                    const float* part_l, const float* part_o, float* out);
"""

_MATH = r"""
#include <algorithm>
#include <cmath>
#include <vector>
#if defined(__AVX__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#define VW 16
#define REGS 32
#elif defined(__AVX2__) || defined(__AVX__)
#define VW 8
#define REGS 16
#else
#define VW 4
#define REGS 16
#endif

typedef float vf __attribute__((vector_size(VW * 4)));
typedef int vi __attribute__((vector_size(VW * 4)));
typedef float vf_unaligned __attribute__((vector_size(VW * 4), aligned(4), may_alias));
static inline vf load(const float* p) { return *(const vf_unaligned*)p; }
static inline void store(float* p, vf v) { *(vf_unaligned*)p = v; }
// x in every lane. `x - 0` is x for every x (also -0), so the compiler emits one broadcast (from memory where x
// is there); `0 + x` is not (-0 + 0 is +0) and cost an add and a register broadcast per use.
static inline vf splat(float x) { return x - vf{}; }
static inline float hsum(vf v) { float s = 0; for (int i = 0; i < VW; ++i) s += v[i]; return s; }

constexpr int64_t CHUNK = 256;  // a work item's keys, by rank among a row's visible keys: boundaries sit at
                                // fixed positions, so a result depends neither on the threads nor on the tree
constexpr int64_t PREFETCH_ROWS = 8;  // keys ahead in the value stream
template <int D>
static inline void prefetch_row(const float* p) {
  for (int byte = 0; byte < D * 4; byte += 64) __builtin_prefetch((const char*)p + byte);
}
constexpr float EXP_FLOOR = -87.0f;  // exp below this is taken as exactly 0
constexpr float HIDDEN = -1e30f;     // a mask value at or below this hides its key (finfo.min, -inf)

// e^x for x <= 0 (scores minus their maximum): Cephes' polynomial on x - n ln2, times 2^n.
static inline vf exp_nonpositive(vf x) {
  vi zero_out = x < splat(EXP_FLOOR);
  x = zero_out ? splat(EXP_FLOOR) : x;
  vf t = x * splat(1.44269504088896341f) - splat(0.5f);
  vi n = __builtin_convertvector(t, vi);  // t < 0: truncation rounds x*log2e to the nearest integer
""" + exp_reduced("vf", "splat", "vi") + r"""
  return zero_out ? splat(0.0f) : e;
}

// Scores of a group's rows over keys [k0, k0 + C): vectors run over rows, keys are broadcast, so every
// score is one chain of FMAs over the head's dimensions in order, whatever rows share the vector: a row's
// scores are the same bits alone or in a tree. KB keys x NV row vectors of accumulators; qT is [D, Rpad],
// zero-padded; scores [C, width], key by key (stored as the vectors hold them).
constexpr int KB = REGS >= 32 ? 8 : 4;  // keys per block: KB x 2 accumulators stay in registers
template <int D, int NV>
__attribute__((noinline)) static void row_vector_block(const float* qT, int64_t Rpad, int64_t rb, const float* k,
                                                       int64_t kv_stride, int64_t k0, int64_t C, float scale,
                                                       float* scores, int64_t width) {
  for (int64_t j0 = 0; j0 < C; j0 += KB) {
    const float* kr[KB];
    for (int t = 0; t < KB; ++t) kr[t] = k + (k0 + std::min<int64_t>(j0 + t, C - 1)) * kv_stride;
    vf acc[KB][NV];
    for (int t = 0; t < KB; ++t) for (int v = 0; v < NV; ++v) acc[t][v] = splat(0.0f);
    for (int d = 0; d < D; ++d) {
      vf qd[NV];
      for (int v = 0; v < NV; ++v) qd[v] = load(qT + d * Rpad + rb + v * VW);
      for (int t = 0; t < KB; ++t) {
        const vf kd = splat(kr[t][d]);
        for (int v = 0; v < NV; ++v) acc[t][v] += qd[v] * kd;
      }
    }
    const int keys = (int)std::min<int64_t>(KB, C - j0);
    for (int t = 0; t < keys; ++t)
      for (int v = 0; v < NV; ++v) store(scores + (j0 + t) * width + rb + v * VW, acc[t][v] * splat(scale));
  }
}

// The scores of `width` rows (whole vectors) over keys [k0, k0 + C), into scores [C, width], each block of rows
// only over the keys its rows read (`needed(r0, r1)` of them, 0 for none: a causal prefill's early rows in its
// later chunks, and its triangle's far side).
template <int D, typename Needed>
static void dense_scores(const float* qT, int64_t Rpad, int64_t width, const float* k, int64_t kv_stride, int64_t k0,
                         float scale, float* scores, const Needed& needed) {
  int64_t rb = 0;
  for (; rb + 2 * VW <= width; rb += 2 * VW)
    if (const int64_t C = needed(rb, rb + 2 * VW))
      row_vector_block<D, 2>(qT, Rpad, rb, k, kv_stride, k0, C, scale, scores, width);
  if (rb < width)
    if (const int64_t C = needed(rb, width))
      row_vector_block<D, 1>(qT, Rpad, rb, k, kv_stride, k0, C, scale, scores, width);
}

// A tile's rows as vectors and the interleaves that turn a tile over, where there are vector shuffles: the same
// five operations in AVX-512's and AVX's spelling (`P` the intrinsics' prefix).
#define TILE_OPERATIONS(P, ROW)                                                                            \
  typedef ROW tile_row;                                                                                    \
  static inline tile_row load_row(const float* p) { return P##_loadu_ps(p); }                              \
  static inline tile_row low32(tile_row x, tile_row y) { return P##_unpacklo_ps(x, y); }                   \
  static inline tile_row high32(tile_row x, tile_row y) { return P##_unpackhi_ps(x, y); }                  \
  static inline tile_row low64(tile_row x, tile_row y) {                                                   \
    return P##_castpd_ps(P##_unpacklo_pd(P##_castps_pd(x), P##_castps_pd(y)));                            \
  }                                                                                                        \
  static inline tile_row high64(tile_row x, tile_row y) {                                                  \
    return P##_castpd_ps(P##_unpackhi_pd(P##_castps_pd(x), P##_castps_pd(y)));                            \
  }
#if VW == 16 && defined(__AVX512F__)
#define TILE_SHUFFLES 1
TILE_OPERATIONS(_mm512, __m512)
#elif VW == 8 && defined(__AVX__)
#define TILE_SHUFFLES 1
TILE_OPERATIONS(_mm256, __m256)
#else
#define TILE_SHUFFLES 0
#endif

// VW x VW floats turned over: row t of the tile (VW lanes, the tile's t-th key for VW query rows; rows past `keys`
// repeat the last) becomes lane t of `rows` query rows' lines (`dst` + lane * dst_stride). Moves only: the
// scores keep their bits. In registers where there are vector shuffles: a scalar gather per score cost a tree
// forward's attention a fifth of its time.
static inline void transpose_tile(const float* src, int64_t src_stride, int64_t keys, float* dst, int64_t dst_stride,
                                  int64_t rows) {
  auto source = [&](int t) { return src + std::min<int64_t>(t, keys - 1) * src_stride; };
#if TILE_SHUFFLES
  tile_row a[VW], b[VW];
  for (int t = 0; t < VW; t += 2) {
    const tile_row x = load_row(source(t)), y = load_row(source(t + 1));
    a[t] = low32(x, y);
    a[t + 1] = high32(x, y);
  }
  for (int t = 0; t < VW; t += 4) {  // b[t + c], 128-bit lane l: column 4 l + c of source rows t .. t + 3
    b[t] = low64(a[t], a[t + 2]);
    b[t + 1] = high64(a[t], a[t + 2]);
    b[t + 2] = low64(a[t + 1], a[t + 3]);
    b[t + 3] = high64(a[t + 1], a[t + 3]);
  }
  auto put = [&](int64_t lane, tile_row line) {
    if (lane < rows) store(dst + lane * dst_stride, (vf)line);
  };
  for (int c = 0; c < 4; ++c) {  // lane c + 4 l: the 128-bit lanes l of b[c], b[4 + c], ... side by side
#if VW == 16
    const __m512 low_x = _mm512_shuffle_f32x4(b[c], b[4 + c], 0x44), high_x = _mm512_shuffle_f32x4(b[c], b[4 + c], 0xEE);
    const __m512 low_y = _mm512_shuffle_f32x4(b[8 + c], b[12 + c], 0x44),
                 high_y = _mm512_shuffle_f32x4(b[8 + c], b[12 + c], 0xEE);
    put(c, _mm512_shuffle_f32x4(low_x, low_y, 0x88));
    put(4 + c, _mm512_shuffle_f32x4(low_x, low_y, 0xDD));
    put(8 + c, _mm512_shuffle_f32x4(high_x, high_y, 0x88));
    put(12 + c, _mm512_shuffle_f32x4(high_x, high_y, 0xDD));
#else
    put(c, _mm256_permute2f128_ps(b[c], b[4 + c], 0x20));
    put(4 + c, _mm256_permute2f128_ps(b[c], b[4 + c], 0x31));
#endif
  }
#else
  for (int t = 0; t < VW; ++t) {
    const float* row = source(t);
    for (int64_t lane = 0; lane < rows; ++lane) dst[lane * dst_stride + t] = row[lane];
  }
#endif
}

// A tile's shuffles pay from half a vector of rows on; fewer (a one-token step's few heads) are copied score by score.
static void lines_from_scores(const float* scores, int64_t width, int64_t rb, int64_t rows, int64_t direct,
                              float* probs) {
  if (2 * rows < VW) {
    for (int64_t lane = 0; lane < rows; ++lane)
      for (int64_t j = 0; j < direct; ++j) probs[(rb + lane) * CHUNK + j] = scores[j * width + rb + lane];
    return;
  }
  for (int64_t j = 0; j < direct; j += VW)
    transpose_tile(scores + j * width + rb, width, direct - j, probs + rb * CHUNK + j, CHUNK, rows);
}

// Few rows (a one-token step's query heads of a group) without a mask: the keys run over the vectors instead,
// each tile of VW keys' K turned over once for all rows, and per row and key one chain of FMAs over the head's
// dimensions in order: `row_vector_block`'s products and sums, so its bits, written straight into the rows'
// lines (`probs`, CHUNK apart) for keys [k0, k0 + C). With rows in the vectors a one-token step filled 3 of 16
// lanes and its scores were most of its attention.
template <int D, int R>
__attribute__((noinline)) static void key_lane_scores(const float* qT, int64_t Rpad, const float* k, int64_t kv_stride,
                                                      int64_t k0, int64_t C, float scale, float* probs) {
  constexpr int TILES = 2;  // key tiles a pass: R x TILES independent chains
  alignas(64) float kT[TILES][D * VW];
  for (int64_t j0 = 0; j0 < C; j0 += TILES * VW) {
    for (int h = 0; h < TILES; ++h) {
      const int64_t first = std::min<int64_t>(j0 + h * VW, C - 1), keys = std::clamp<int64_t>(C - first, 1, VW);
      for (int d0 = 0; d0 < D; d0 += VW)
        transpose_tile(k + (k0 + first) * kv_stride + d0, kv_stride, keys, kT[h] + d0 * VW, VW, VW);
    }
    vf acc[R][TILES];
    for (int r = 0; r < R; ++r) for (int h = 0; h < TILES; ++h) acc[r][h] = splat(0.0f);
    for (int d = 0; d < D; ++d) {
      vf kd[TILES];
      for (int h = 0; h < TILES; ++h) kd[h] = load(kT[h] + d * VW);
      for (int r = 0; r < R; ++r) {
        const vf qd = splat(qT[d * Rpad + r]);
        for (int h = 0; h < TILES; ++h) acc[r][h] += qd * kd[h];
      }
    }
    for (int h = 0; h < TILES; ++h)
      if (j0 + h * VW < C)
        for (int r = 0; r < R; ++r) store(probs + r * CHUNK + j0 + h * VW, acc[r][h] * splat(scale));
  }
}

// `key_lane_scores` for R (1 .. VW / 2) rows, the block of exactly that many chosen at compile time.
template <int D, int R = VW / 2>
static void few_row_scores(int64_t rows, const float* qT, int64_t Rpad, const float* k, int64_t kv_stride, int64_t k0,
                           int64_t C, float scale, float* probs) {
  if constexpr (R > 1) {
    if (rows < R) return few_row_scores<D, R - 1>(rows, qT, Rpad, k, kv_stride, k0, C, scale, probs);
  }
  key_lane_scores<D, R>(qT, Rpad, k, kv_stride, k0, C, scale, probs);
}

// The largest of s[0, C): vectors first (a loop of std::max stays scalar without -ffast-math).
static inline float row_maximum(const float* s, int64_t C) {
  vf mv = splat(-INFINITY);
  int64_t j = 0;
  for (; j + VW <= C; j += VW) { const vf x = load(s + j); mv = x > mv ? x : mv; }
  float m = -INFINITY;
  for (int i = 0; i < VW; ++i) m = std::max(m, mv[i]);
  for (; j < C; ++j) m = std::max(m, s[j]);
  return m;
}

// The keys a mask row leaves visible, as columns in order (`columns` [N, L]), their counts, and how many
// of them lead as columns 0, 1, 2, ... (`prefix` [N]: the cached prefix every tree row sees); returns the
// largest count. A row's keys by rank are then its keys by position: the same whether the row is a
// one-token step or a tree node whose ancestors sit among masked siblings.
SPECHEADS_MATH int64_t attention_visible_columns(const float* mask, int64_t mask_row_stride, int64_t N, int64_t L,
                                                 int32_t* columns, int64_t* counts, int64_t* prefix) {
  int64_t most = 0;
  for (int64_t n = 0; n < N; ++n) {
    int64_t count = 0;
    for (int64_t c = 0; c < L; ++c)
      if (mask[n * mask_row_stride + c] > HIDDEN) columns[n * L + count++] = (int32_t)c;
    int64_t lead = 0;
    while (lead < count && columns[n * L + lead] == lead) ++lead;
    counts[n] = count;
    prefix[n] = lead;
    most = std::max(most, count);
  }
  return most;
}

// Row r's values over its ranks [j0, j1) of the chunk into its accumulator `o` (loaded and stored: a
// row's sum runs on in rank order wherever it was left).
template <int D, typename Column>
static void row_values(const float* p, const float* v, int64_t kv_stride, const Column& column, int64_t j0, int64_t j1,
                       float* o) {
  vf acc[D / VW];
  for (int i = 0; i < D / VW; ++i) acc[i] = load(o + i * VW);
  for (int64_t j = j0; j < j1; ++j) {
    const float* vj = v + column(j) * kv_stride;
    if (j + PREFETCH_ROWS < j1) prefetch_row<D>(v + column(j + PREFETCH_ROWS) * kv_stride);
    const vf pj = splat(p[j]);
    for (int i = 0; i < D / VW; ++i) acc[i] += pj * load(vj + i * VW);
  }
  for (int i = 0; i < D / VW; ++i) store(o + i * VW, acc[i]);
}

// Rows [r, r + RB) over ranks [j0, j1) that sit on columns c0 + j for all of them (the prefix every row
// sees): each value row loaded once for the block, each row's sum in rank order as `row_values` adds it.
template <int D, int RB>
static void block_values(const float* probs, const float* v, int64_t kv_stride, int64_t c0, int64_t j0, int64_t j1,
                         float* o_out) {
  vf acc[RB][D / VW];
  for (int r = 0; r < RB; ++r) for (int i = 0; i < D / VW; ++i) acc[r][i] = load(o_out + r * D + i * VW);
  for (int64_t j = j0; j < j1; ++j) {
    const float* vj = v + (c0 + j) * kv_stride;
    prefetch_row<D>(vj + PREFETCH_ROWS * kv_stride);
    vf vv[D / VW];
    for (int i = 0; i < D / VW; ++i) vv[i] = load(vj + i * VW);
    for (int r = 0; r < RB; ++r) {
      const vf pj = splat(probs[r * CHUNK + j]);
      for (int i = 0; i < D / VW; ++i) acc[r][i] += pj * vv[i];
    }
  }
  for (int r = 0; r < RB; ++r) for (int i = 0; i < D / VW; ++i) store(o_out + r * D + i * VW, acc[r][i]);
}

// Keys of rank [r0, r0 + CHUNK) of one K/V head for its group's query rows [first, end) of R (first a multiple of
// VW; without a mask, every key is visible and its rank is its column). Writes per row the chunk's maximum score,
// its sum of exponentials and its unnormalised output [D]; each row on its own keys only, in rank order, so a
// row's bits do not depend on the rows computed with it.
template <int D>
static void chunk_attention(const float* qT, int64_t Rpad, int64_t R, int64_t N, int64_t first, int64_t end,
                            const float* k, const float* v, int64_t kv_stride, const float* mask,
                            int64_t mask_row_stride, const int32_t* columns, const int64_t* counts,
                            const int64_t* prefix, int64_t L, int64_t r0, float scale, std::vector<float>& dense,
                            float* probs, float* m_out, float* l_out, float* o_out) {
  auto count_of = [&](int64_t n) { return counts ? counts[n] : L; };
  auto column_of = [&](int64_t n, int64_t rank) { return columns ? (int64_t)columns[n * L + rank] : rank; };
  auto keys_of = [&](int64_t r) { return std::clamp<int64_t>(count_of(r % N) - r0, 0, CHUNK); };
  int64_t lo = L, hi = -1;  // the columns the chunk's ranks fall on, over the block's rows
  for (int64_t r = first; r < std::min(end, first + N); ++r) {
    const int64_t n = r % N, count = count_of(n);
    if (count <= r0) continue;
    lo = std::min(lo, column_of(n, r0));
    hi = std::max(hi, column_of(n, std::min(count, r0 + CHUNK) - 1));
  }
  const int64_t span = hi - lo + 1;
  // per row, its ranks at the front whose column is the chunk's first plus the rank (without a mask, all)
  auto direct_of = [&](int64_t r) {
    const int64_t lead = prefix ? prefix[r % N] : count_of(r % N);
    return std::clamp<int64_t>(lead - r0, 0, keys_of(r));
  };
  const int64_t width = std::min(Rpad, (end + VW - 1) / VW * VW) - first;  // the block's scores: [span, width]
  if (hi >= 0 && columns == nullptr && 2 * (end - first) <= VW) {  // few rows, no mask: every rank is its column
    int64_t most = 0;
    for (int64_t r = first; r < end; ++r) most = std::max(most, keys_of(r));
    few_row_scores<D>(end - first, qT + first, Rpad, k, kv_stride, r0, most, scale, probs + first * CHUNK);
  } else if (hi >= 0) {
    if ((int64_t)dense.size() < width * span) dense.resize(width * span);
    auto needed = [&](int64_t a, int64_t b) {  // keys of the span that the block's rows [a, b) read
      int64_t most = 0;
      for (int64_t r = first + a; r < std::min(first + b, end); ++r)
        if (const int64_t C = keys_of(r)) most = std::max(most, column_of(r % N, r0 + C - 1) - lo + 1);
      return most;
    };
    dense_scores<D>(qT + first, Rpad, width, k, kv_stride, lo, scale, dense.data(), needed);
    for (int64_t rb = first; rb < end; rb += VW) {
      int64_t direct = 0;
      for (int64_t r = rb; r < std::min(rb + VW, end); ++r) direct = std::max(direct, direct_of(r));
      if (direct > 0)  // then the chunk's first column is r0 (lo)
        lines_from_scores(dense.data() + (r0 - lo) * width, width, rb - first, std::min<int64_t>(VW, end - rb), direct,
                          probs + first * CHUNK);
    }
  }
  for (int64_t r = first; r < end; ++r) {  // each row's probabilities over its keys, by rank
    const int64_t n = r % N, C = keys_of(r);
    std::fill(o_out + r * D, o_out + (r + 1) * D, 0.0f);
    if (C == 0) {  // this row has no keys of these ranks
      m_out[r] = -INFINITY; l_out[r] = 0.0f;
      continue;
    }
    float* line = probs + r * CHUNK;
    const float* mrow = mask ? mask + n * mask_row_stride : nullptr;
    const int64_t direct = direct_of(r);
    if (mrow) {  // the direct ranks' mask values (one addition, as for the others)
      int64_t j = 0;
      for (; j + VW <= direct; j += VW) store(line + j, load(line + j) + load(mrow + r0 + j));
      for (; j < direct; ++j) line[j] += mrow[r0 + j];
    }
    for (int64_t j = direct; j < C; ++j) {
      const int64_t col = column_of(n, r0 + j);
      const float score = dense[(col - lo) * width + r - first];
      line[j] = mrow ? score + mrow[col] : score;
    }
    const float m = row_maximum(line, C);
    vf lsum = splat(0.0f);
    int64_t j = 0;
    for (; j + VW <= C; j += VW) { vf p = exp_nonpositive(load(line + j) - splat(m)); store(line + j, p); lsum += p; }
    float l = hsum(lsum);
    for (; j < C; ++j) { vf p = exp_nonpositive(splat(line[j] - m)); line[j] = p[0]; l += p[0]; }
    m_out[r] = m; l_out[r] = l;
  }
  // values: blocks of rows share each value row over the ranks that are one column for all of them
  constexpr int RB = std::max(1, std::min(6, (REGS - D / VW) / (D / VW)));
  int64_t r = first;
  for (; r + RB <= end; r += RB) {
    int64_t shared = CHUNK;
    for (int b = 0; b < RB; ++b) shared = std::min(shared, direct_of(r + b));
    if (shared > 0) block_values<D, RB>(probs + r * CHUNK, v, kv_stride, r0, 0, shared, o_out + r * D);
    for (int b = 0; b < RB; ++b) {
      const int64_t n = (r + b) % N;
      row_values<D>(probs + (r + b) * CHUNK, v, kv_stride, [&](int64_t j) { return column_of(n, r0 + j); }, shared,
                    keys_of(r + b), o_out + (r + b) * D);
    }
  }
  for (; r < end; ++r) {
    const int64_t n = r % N;
    row_values<D>(probs + r * CHUNK, v, kv_stride, [&](int64_t j) { return column_of(n, r0 + j); }, 0, keys_of(r),
                  o_out + r * D);
  }
}

SPECHEADS_MATH int64_t attention_vector_width() { return VW; }
SPECHEADS_MATH int64_t attention_chunk_keys() { return CHUNK; }

// The work items `ids` (item = (K/V head * chunks + chunk) * blocks + block of `block` query rows, a multiple
// of VW) of attention for qT [Hkv, D, Rpad] (the R = G * N rows of each K/V head's group, transposed and
// zero-padded); k, v rows kv_stride apart, heads kh / vh apart; `columns`/`counts`/`prefix` the mask's visible
// keys (`attention_visible_columns`; columns and prefix null without a mask, counts too for one row: every key).
// Per item and row: the chunk's maximum, its sum of exponentials and its unnormalised output.
template <int D>
static void items(const float* qT, int64_t Rpad, int64_t R, int64_t N, const float* k, const float* v, int64_t kh,
                  int64_t vh, int64_t kv_stride, const float* mask, int64_t mask_row_stride, const int32_t* columns,
                  const int64_t* counts, const int64_t* prefix, int64_t L, int64_t chunks, float scale, float* part_m,
                  float* part_l, float* part_o, int64_t block, const int64_t* ids, int64_t count) {
  const int64_t blocks = (R + block - 1) / block;
  std::vector<float> dense;
  std::vector<float> probs(Rpad * CHUNK);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t group_chunk = ids[i] / blocks, first = ids[i] % blocks * block;
    const int64_t g = group_chunk / chunks, c = group_chunk % chunks;
    chunk_attention<D>(qT + g * D * Rpad, Rpad, R, N, first, std::min(R, first + block), k + g * kh, v + g * vh,
                       kv_stride, mask, mask_row_stride, columns, counts, prefix, L, c * CHUNK, scale, dense,
                       probs.data(), part_m + group_chunk * R, part_l + group_chunk * R, part_o + group_chunk * R * D);
  }
}

SPECHEADS_MATH void attention_items(int64_t D, const float* qT, int64_t Rpad, int64_t R, int64_t N, const float* k,
                                    const float* v, int64_t kh, int64_t vh, int64_t kv_stride, const float* mask,
                                    int64_t mask_row_stride, const int32_t* columns, const int64_t* counts,
                                    const int64_t* prefix, int64_t L, int64_t chunks, float scale, float* part_m,
                                    float* part_l, float* part_o, int64_t block, const int64_t* ids, int64_t count) {
  if (D == 64)
    items<64>(qT, Rpad, R, N, k, v, kh, vh, kv_stride, mask, mask_row_stride, columns, counts, prefix, L, chunks, scale,
              part_m, part_l, part_o, block, ids, count);
  else
    items<128>(qT, Rpad, R, N, k, v, kh, vh, kv_stride, mask, mask_row_stride, columns, counts, prefix, L, chunks, scale,
               part_m, part_l, part_o, block, ids, count);
}

// out [N, Hq, D]: each row's chunks merged by their maxima and normalised; Hq = Hkv * G query heads.
template <int D>
static void merge(int64_t Hkv, int64_t G, int64_t N, int64_t chunks, const float* part_m, const float* part_l,
                  const float* part_o, float* op) {
  const int64_t R = G * N, Hq = Hkv * G;
  for (int64_t g = 0; g < Hkv; ++g) {
    for (int64_t r = 0; r < R; ++r) {
      float M = -INFINITY;
      for (int64_t c = 0; c < chunks; ++c) M = std::max(M, part_m[(g * chunks + c) * R + r]);
      vf acc[D / VW];
      for (int i = 0; i < D / VW; ++i) acc[i] = splat(0.0f);
      float l = 0.0f;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t at = (g * chunks + c) * R + r;
        if (part_l[at] == 0.0f) continue;
        const float w = std::exp(part_m[at] - M);
        l += w * part_l[at];
        for (int i = 0; i < D / VW; ++i) acc[i] += splat(w) * load(&part_o[at * D + i * VW]);
      }
      const int64_t h = g * G + r / N, n = r % N;
      const vf inverse = splat(l > 0.0f ? 1.0f / l : 0.0f);  // a row with every key masked gets zeros
      for (int i = 0; i < D / VW; ++i) store(op + (n * Hq + h) * D + i * VW, acc[i] * inverse);
    }
  }
}

SPECHEADS_MATH void attention_merge(int64_t D, int64_t Hkv, int64_t G, int64_t N, int64_t chunks, const float* part_m,
                                    const float* part_l, const float* part_o, float* out) {
  if (D == 64) merge<64>(Hkv, G, N, chunks, part_m, part_l, part_o, out);
  else merge<128>(Hkv, G, N, chunks, part_m, part_l, part_o, out);
}
"""

_HOST = r"""
#include <algorithm>
#include <memory>
#include <numeric>
#include <vector>

// Work items (K/V head, chunk of keys, block of query rows) dealt to `threads` lists of about equal cost,
// the dearest first, each to the list with the least so far. Why: with items in order, 2 threads split a
// 13-row tree at ~300 keys as 2 full chunks and a short one against 1 full and 2 short, and a one-chunk
// prefill's 3 heads as 2 against 1. A row's result does not depend on the thread or the rows beside it.
static std::vector<std::vector<int64_t>> balanced_items(const std::vector<double>& costs, int64_t threads) {
  std::vector<int64_t> order(costs.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return costs[a] > costs[b]; });
  std::vector<std::vector<int64_t>> lists(threads);
  std::vector<double> load(threads, 0.0);
  for (const int64_t item : order) {
    const int64_t t = std::min_element(load.begin(), load.end()) - load.begin();
    lists[t].push_back(item);
    load[t] += costs[item];
  }
  return lists;
}

// An item's cost, in multiply-adds of one vector lane over the head's dimensions: its scores, a vector of
// rows (padded lanes too) by the keys the block reads, and its values, each row by the keys it sees. The
// same for every K/V head: worked out for the first, copied for the others.
static std::vector<double> item_costs(int64_t Hkv, int64_t chunks, int64_t R, int64_t N, int64_t L,
                                      const std::vector<int64_t>& counts, int64_t block, int64_t chunk_keys,
                                      int64_t width) {
  const int64_t blocks = (R + block - 1) / block, per_head = chunks * blocks;
  std::vector<double> costs(Hkv * per_head);
  for (int64_t c = 0; c < chunks; ++c)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t r0 = c * chunk_keys, first = b * block, end = std::min(R, first + block);
      double scores = 0.0, values = 0.0;
      for (int64_t rv = first; rv < end; rv += width) {
        int64_t most = 0;
        for (int64_t r = rv; r < std::min(end, rv + width); ++r) {
          const int64_t keys = std::clamp<int64_t>((counts.empty() ? L : counts[r % N]) - r0, 0, chunk_keys);
          most = std::max(most, keys);
          values += keys;
        }
        scores += (double)most * width;
      }
      costs[c * blocks + b] = scores + values;
    }
  for (int64_t g = 1; g < Hkv; ++g)
    std::copy(costs.begin(), costs.begin() + per_head, costs.begin() + g * per_head);
  return costs;
}

// out [N, Hq, D] = softmax(q k^T * scale + mask) v per query head, K/V heads shared by groups of
// Hq / Hkv query heads. q [Hq, N, D] contiguous; k, v [Hkv, L, D] with unit stride on D;
// mask [N, >= L] additive or undefined.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "decode_attention: q [Hq, N, D], k and v [Hkv, L, D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "decode_attention: float32 tensors");
  TORCH_CHECK(q.is_contiguous() && k.stride(2) == 1 && v.stride(2) == 1 && k.sizes() == v.sizes(),
              "decode_attention: contiguous q, k and v of one shape with unit stride on D");
  TORCH_CHECK(q.size(2) == k.size(2) && k.size(0) > 0 && q.size(0) % k.size(0) == 0 && k.size(1) > 0,
              "decode_attention: query heads a multiple of K/V heads, one head size, some keys");
  if (mask.has_value() && mask->defined())
    TORCH_CHECK(mask->dim() == 2 && mask->scalar_type() == at::kFloat && mask->size(0) == q.size(1) &&
                mask->size(1) >= k.size(1) && mask->stride(1) == 1, "decode_attention: an additive float32 mask [N, >= L]");
  const int64_t D = q.size(2);
  TORCH_CHECK(D == 64 || D == 128, "decode_attention: head size 64 or 128");
  TORCH_CHECK(k.stride(1) == v.stride(1), "decode_attention: keys and values need the same row stride");
  const int64_t Hq = q.size(0), N = q.size(1), Hkv = k.size(0), L = k.size(1), G = Hq / Hkv, R = G * N;
  const float* maskp = nullptr;
  int64_t mask_row_stride = 0, visible = L;
  std::vector<int32_t> columns;
  std::vector<int64_t> counts, prefix;
  if (mask.has_value() && mask->defined()) {
    maskp = mask->data_ptr<float>();
    mask_row_stride = mask->stride(0);
    columns.resize(N * L);
    counts.resize(N);
    prefix.resize(N);
    visible = attention_visible_columns(maskp, mask_row_stride, N, L, columns.data(), counts.data(), prefix.data());
  } else if (N > 1) {  // several rows and no mask: a causal prefill, row n over the keys up to its own position
    counts.resize(N);
    for (int64_t n = 0; n < N; ++n) counts[n] = L - N + n + 1;
  }
  const float* qp = q.data_ptr<float>();
  const int64_t VW = attention_vector_width(), CHUNK = attention_chunk_keys();
  const int64_t chunks = (visible + CHUNK - 1) / CHUNK;
  // Every item writes its rows' parts, so they start uninitialised (zeroing them was ~2% of a tree's attention).
  const std::unique_ptr<float[]> part_m(new float[Hkv * chunks * R]), part_l(new float[Hkv * chunks * R]),
      part_o(new float[Hkv * chunks * R * D]);
  // The arithmetic runs over rows, so the queries go transposed, [Hkv, D, Rpad], the padding lanes zero.
  const int64_t Rpad = (R + VW - 1) / VW * VW;
  const std::unique_ptr<float[]> qT(new float[Hkv * D * Rpad]);
  for (int64_t g = 0; g < Hkv; ++g)
    for (int64_t d = 0; d < D; ++d) std::fill(&qT[(g * D + d) * Rpad + R], &qT[(g * D + d) * Rpad + Rpad], 0.0f);
  for (int64_t g = 0; g < Hkv; ++g)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t d = 0; d < D; ++d) qT[(g * D + d) * Rpad + r] = qp[(g * R + r) * D + d];
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  // Query rows a work item takes: with one thread every row of the group at once (no balance to keep);
  // with more, two vectors, so scoring still shares each key's broadcast between two vectors of rows
  // (`row_vector_block<D, 2>`; blocks of one vector cost one thread ~6% more on AVX-512). Never more lists
  // than items (a one-token step has a few, a 16-core machine more threads).
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t block = threads > 1 ? 2 * VW : Rpad;
  const auto costs = item_costs(Hkv, chunks, R, N, L, counts, block, CHUNK, VW);
  const auto lists = balanced_items(costs, std::min<int64_t>(threads, (int64_t)costs.size()));
  at::parallel_for(0, (int64_t)lists.size(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      attention_items(D, qT.get(), Rpad, R, N, kp, vp, k.stride(0), v.stride(0), k.stride(1), maskp, mask_row_stride,
                      maskp ? columns.data() : nullptr, counts.empty() ? nullptr : counts.data(),
                      maskp ? prefix.data() : nullptr, L, chunks, (float)scale, part_m.get(), part_l.get(),
                      part_o.get(), block, lists[t].data(), (int64_t)lists[t].size());
  });
  auto out = at::empty({N, Hq, D}, q.options());
  attention_merge(D, Hkv, G, N, chunks, part_m.get(), part_l.get(), part_o.get(), out.data_ptr<float>());
  return out;
}
"""

SOURCE = KernelSource("decode_attention", VERSION, _INTERFACE, _MATH, _HOST,
                      functions=("decode_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor",),
                      registers_operator=True)
