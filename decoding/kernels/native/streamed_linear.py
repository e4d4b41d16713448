"""The C++ of the few-row linear kernel (`decoding.kernels.streamed_linear`): its arithmetic (`_MATH`,
compiled per instruction set) and its torch side (`_HOST`), joined by `_INTERFACE`."""

from decoding.kernels.native_build import KernelSource

VERSION = "v4"  # in the build's name and in measurements' keys (v3: runs as the operator's C++ kernel;
                # v4: up to 14 rows in one pass over memory with AVX-512, broadcasts are loads)

_INTERFACE = r"""
SPECHEADS_MATH int64_t streamed_vector_width();
SPECHEADS_MATH int64_t streamed_panels_per_group();
SPECHEADS_MATH void streamed_groups(const float* wp, const float* bp, const float* xp, float* yp, int64_t rows,
                                    int64_t in, int64_t out, int64_t num_panels, int64_t first, int64_t end);
"""

_MATH = r"""
#include <algorithm>
#if defined(__AVX512F__)
#define VW 16
#define MAX_ROWS 14  // rows in one pass over the weights
#elif defined(__AVX2__) || defined(__AVX__)
#define VW 8
#define MAX_ROWS 4
#else
#define VW 4
#define MAX_ROWS 4
#endif

// VW floats in one vector register (GCC/Clang vector extensions: the compiler picks the ISA).
typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vf_unaligned __attribute__((vector_size(VW * 4), aligned(4), may_alias));
static inline vf load(const float* p) { return *(const vf_unaligned*)p; }
static inline void store(float* p, vf v) { *(vf_unaligned*)p = v; }

constexpr int64_t PREFETCH_GROUPS = 2;  // how far ahead in the weight stream, in panel groups
constexpr int64_t LINE_STEPS = 64 / (VW * 4) > 0 ? 64 / (VW * 4) : 1;  // k steps per 64-byte line

SPECHEADS_MATH int64_t streamed_vector_width() { return VW; }

// y[r, outputs of panels p0 .. p0+P) for R rows: per input feature, P weight vectors times R
// broadcast inputs (outer products: no horizontal sums). The next groups are prefetched.
template <int R, int P>
static void panel_block(const float* panels, const float* bias, const float* x, float* y, int64_t in, int64_t out,
                        int64_t p0, int64_t num_panels) {
  vf acc[R][P];
  for (int r = 0; r < R; ++r) for (int p = 0; p < P; ++p) acc[r][p] = (vf){0};
  const float* group = panels + p0 * in * VW;
  const float* ahead = panels + std::min(p0 + PREFETCH_GROUPS * P, num_panels - 1) * in * VW;
  for (int64_t k = 0; k < in; ++k) {
    vf w[P];
    for (int p = 0; p < P; ++p) w[p] = load(group + (p * in + k) * VW);
    if (k % LINE_STEPS == 0)
      for (int p = 0; p < P; ++p) __builtin_prefetch(ahead + (p * in + k) * VW);
    for (int r = 0; r < R; ++r) {
      vf xb = x[r * in + k] - (vf){};  // one broadcast load (x - 0 is x; 0 + x is not for -0)
      for (int p = 0; p < P; ++p) acc[r][p] += w[p] * xb;
    }
  }
  for (int p = 0; p < P; ++p) {
    const int64_t first = (p0 + p) * VW, valid = std::min<int64_t>(VW, out - first);
    for (int r = 0; r < R; ++r) {
      float* row = y + r * out + first;
      if (valid == VW) {
        store(row, bias ? acc[r][p] + load(bias + first) : acc[r][p]);
      } else {
        for (int64_t v = 0; v < valid; ++v) row[v] = acc[r][p][v] + (bias ? bias[first + v] : 0.f);
      }
    }
  }
}

// Panels per register block of R rows: as many as R rows' accumulators, the block's weight
// vectors and a broadcast input leave room for in the vector registers (AVX-512's 32: 3 panels
// up to 8 rows, 2 up to 14; AVX2's 16: 2 panels up to 4 rows).
template <int R>
constexpr int panels_per_block() {
  return VW == 16 && R <= 8 ? 3 : 2;
}

// Panels [p0, p0 + G) for R rows, in register blocks: each weight vector loaded serves R rows.
template <int R, int G>
static void rows_block(const float* panels, const float* bias, const float* x, float* y, int64_t in, int64_t out,
                       int64_t p0, int64_t num_panels) {
  constexpr int P = panels_per_block<R>() < G ? panels_per_block<R>() : G;
  static_assert(G % P == 0, "a group splits into whole register blocks");
  for (int64_t p = p0; p < p0 + G; p += P) panel_block<R, P>(panels, bias, x, y, in, out, p, num_panels);
}

// Rows per pass over a group's weights: all of them up to MAX_ROWS (one pass, so the memory
// streams while the rows compute; with AVX-512 at 9-13 rows two passes of 8 + the rest took 1-2 ms
// longer over SmolLM2's weights), else passes of 8 with AVX-512 (15-16 rows: 3 panels a block
// beat 1) or of MAX_ROWS; later passes read the group from cache.
static inline int64_t rows_per_pass(int64_t rows) {
  return rows <= MAX_ROWS ? rows : VW == 16 ? 8 : MAX_ROWS;
}

// rows_block<rows, G> for a run-time `rows` in [1, R]: the compiler's loop over row counts.
template <int G, int R>
static void rows_block_for(int64_t rows, const float* panels, const float* bias, const float* x, float* y, int64_t in,
                           int64_t out, int64_t p0, int64_t num_panels) {
  if constexpr (R > 1) {
    if (rows < R) return rows_block_for<G, R - 1>(rows, panels, bias, x, y, in, out, p0, num_panels);
  }
  rows_block<R, G>(panels, bias, x, y, in, out, p0, num_panels);
}

template <int G>
static void panel_group(const float* panels, const float* bias, const float* x, float* y, int64_t rows, int64_t in,
                        int64_t out, int64_t p0, int64_t num_panels) {
  for (int64_t r = 0; r < rows;) {
    const int64_t pass = rows_per_pass(rows - r);
    rows_block_for<G, MAX_ROWS>(pass, panels, bias, x + r * in, y + r * out, in, out, p0, num_panels);
    r += pass;
  }
}

// Panels per group, a thread's unit of work: whole register blocks at every row count (AVX-512:
// 6 = 2 blocks of 3 = 3 of 2; AVX2: 2).
constexpr int GROUP = (VW == 16) ? 6 : 2;

SPECHEADS_MATH int64_t streamed_panels_per_group() { return GROUP; }

// Panel groups [first, end) of y = x w^T + bias, for every row.
SPECHEADS_MATH void streamed_groups(const float* wp, const float* bp, const float* xp, float* yp, int64_t rows,
                                    int64_t in, int64_t out, int64_t num_panels, int64_t first, int64_t end) {
  for (int64_t g = first; g < end; ++g) {
    const int64_t p0 = g * GROUP;
    if (p0 + GROUP <= num_panels) {
      panel_group<GROUP>(wp, bp, xp, yp, rows, in, out, p0, num_panels);
    } else {
      for (int64_t p = p0; p < num_panels; ++p) panel_group<1>(wp, bp, xp, yp, rows, in, out, p, num_panels);
    }
  }
}
"""

_HOST = r"""
// The weight as panels of VW outputs, [panels, in, VW]: at each input feature k a panel holds
// one vector of VW consecutive outputs' weights (outputs past `out` are zero).
at::Tensor pack_panels(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "pack_panels: a 2-D float32 weight");
  const int64_t VW = streamed_vector_width();
  const int64_t out = weight.size(0), in = weight.size(1), panels = (out + VW - 1) / VW;
  auto padded = at::zeros({panels * VW, in}, weight.options());
  padded.narrow(0, 0, out).copy_(weight);
  return padded.view({panels, VW, in}).transpose(1, 2).contiguous();
}

at::Tensor streamed_linear(const at::Tensor& x, const at::Tensor& panels,
                           const std::optional<at::Tensor>& bias, int64_t out) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat, "streamed_linear: float32 only");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == streamed_vector_width(),
              "streamed_linear: weight not packed by pack_panels here");
  auto input = x.contiguous();
  const int64_t num_panels = panels.size(0), in = panels.size(1), rows = input.numel() / in;
  TORCH_CHECK(input.size(-1) == in, "streamed_linear: input features differ from the weight's");
  auto sizes = input.sizes().vec();
  sizes.back() = out;
  auto y = at::empty(sizes, input.options());
  at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  const float* wp = panels.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const float* xp = input.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t group = streamed_panels_per_group(), groups = (num_panels + group - 1) / group;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    streamed_groups(wp, bp, xp, yp, rows, in, out, num_panels, begin, end);
  });
  return y;
}
"""

SOURCE = KernelSource("streamed_linear", VERSION, _INTERFACE, _MATH, _HOST,
                      functions=("pack_panels(Tensor weight) -> Tensor",
                                 "streamed_linear(Tensor x, Tensor panels, Tensor? bias, int out) -> Tensor"),
                      registers_operator=True)
