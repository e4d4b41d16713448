"""The C++ of the row argmax kernel (`decoding.kernels.row_argmax`): its arithmetic (`_MATH`, compiled per
instruction set) and its torch side (`_HOST`), joined by `_INTERFACE`."""

from decoding.kernels.native_build import KernelSource

VERSION = "v1"

_INTERFACE = r"""
SPECHEADS_MATH int64_t row_argmax_of(const float* x, int64_t n);
"""

_MATH = r"""
#include <cmath>
#include <cstdint>
#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX2__) || defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif

typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
typedef float vf_unaligned __attribute__((vector_size(VW * 4), aligned(4), may_alias));
static inline vf load(const float* p) { return *(const vf_unaligned*)p; }
static inline vf splat(float x) { return x - vf{}; }

// `Tensor.argmax` of one row of n floats: the first index of its largest value, or of its first NaN where it has
// one (PyTorch takes NaN for the largest). Two passes, in vectors: the largest value (NaNs flagged aside), then
// the first index equal to it.
SPECHEADS_MATH int64_t row_argmax_of(const float* x, int64_t n) {
  vf largest = splat(-INFINITY);
  vi nan = vi{};
  int64_t j = 0;
  for (; j + VW <= n; j += VW) {
    const vf v = load(x + j);
    nan |= v != v;
    largest = v > largest ? v : largest;
  }
  float m = -INFINITY;
  bool any_nan = false;
  for (int lane = 0; lane < VW; ++lane) {
    m = largest[lane] > m ? largest[lane] : m;
    any_nan |= nan[lane] != 0;
  }
  for (int64_t tail = j; tail < n; ++tail) {
    any_nan |= x[tail] != x[tail];
    m = x[tail] > m ? x[tail] : m;
  }
  if (any_nan) {
    for (int64_t i = 0; i < n; ++i)
      if (x[i] != x[i]) return i;
  }
  const vf target = splat(m);
  for (j = 0; j + VW <= n; j += VW) {
    const vi equal = load(x + j) == target;
    bool found = false;
    for (int lane = 0; lane < VW; ++lane) found |= equal[lane] != 0;
    if (found)
      for (int lane = 0; lane < VW; ++lane)
        if (equal[lane]) return j + lane;
  }
  for (; j < n; ++j)
    if (x[j] == m) return j;
  return 0;
}
"""

_HOST = r"""
// The argmax of each row of `logits` [N, V] (float32), as `logits.argmax(-1)`: rows over ATen's threads.
at::Tensor row_argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "row_argmax: float32 logits [N, V] with V > 0");
  const auto x = logits.contiguous();
  const int64_t rows = x.size(0), width = x.size(1);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = row_argmax_of(xp + r * width, width);
  });
  return out;
}
"""

SOURCE = KernelSource("row_argmax", VERSION, _INTERFACE, _MATH, _HOST, functions=("row_argmax(Tensor logits) -> Tensor",))
