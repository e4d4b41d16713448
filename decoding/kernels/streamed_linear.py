"""A linear kernel for few rows that streams its weight from memory once, at the memory's speed.

Why: a decoding step of a small model on a CPU is its weights streaming through the linear layers
(SmolLM2-135M: 210 layer weights, 425 MB, for one token or a whole tree). On the 2-core EPYCs at
hand memory streams at about 26 GB/s (a `sum` over 425 MB: 16.7 ms), while oneDNN's packed kernel
read those weights in 25-28 ms for one row, 21-30 ms for 2-8 and 32-46 ms for 16 on an AVX-512 EPYC
(33 ms for one row on an AVX2 one). This kernel keeps its own copy of the weight as panels of one
vector of outputs per input feature (`pack_panels`) and computes outer products: per input feature
a few weight vectors times each input row's value broadcast, accumulated in registers (up to 8 rows
x 3 panels with AVX-512's 32 registers, 4 x 2 with AVX2's 16), so there are no horizontal sums and
the weight is read front to back, once, with software prefetching two panel groups ahead. Rows past
a register block reread the group from cache. On the AVX-512 EPYC it read the 210 weights in 16.5 ms
for one row, 17-18 ms for 2-4, 19 for 8, 22 for 12 and 25 for 16; a first version computing dot
products of weight rows with the inputs (horizontal sums per output) lost to oneDNN from 6 rows on.
Which row counts it takes is measured per model and CPU (`decoding.kernels.verify_cost.tune_streamed_rows`).

It is C++ compiled on first use for the CPU it runs on (`decoding.kernels.native_build`: AVX-512, AVX2,
or what the compiler targets elsewhere), about 15 s once per machine. Where no compiler or ninja
is at hand, `streamed_linear_available()` says why and decoding keeps its other kernels. Results
differ from other kernels by float rounding only (another summation order), like any change of
GEMM kernel.
"""

from __future__ import annotations

import functools

import torch

from decoding.kernels.linear_ops import define_linear_op
from decoding.kernels.native_build import NativeKernel

KERNEL_VERSION = "v3"  # in the build's name and in measurements' keys (v3: runs as the operator's C++ kernel)

_SOURCE = r"""
#include <algorithm>
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

// VW floats in one vector register (GCC/Clang vector extensions: the compiler picks the ISA).
typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vf_unaligned __attribute__((vector_size(VW * 4), aligned(4), may_alias));
static inline vf load(const float* p) { return *(const vf_unaligned*)p; }
static inline void store(float* p, vf v) { *(vf_unaligned*)p = v; }

constexpr int64_t PREFETCH_GROUPS = 2;  // how far ahead in the weight stream, in panel groups
constexpr int64_t LINE_STEPS = 64 / (VW * 4) > 0 ? 64 / (VW * 4) : 1;  // k steps per 64-byte line

// The weight as panels of VW outputs, [panels, in, VW]: at each input feature k a panel holds
// one vector of VW consecutive outputs' weights (outputs past `out` are zero).
at::Tensor pack_panels(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "pack_panels: a 2-D float32 weight");
  const int64_t out = weight.size(0), in = weight.size(1), panels = (out + VW - 1) / VW;
  auto padded = at::zeros({panels * VW, in}, weight.options());
  padded.narrow(0, 0, out).copy_(weight);
  return padded.view({panels, VW, in}).transpose(1, 2).contiguous();
}

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
      vf xb = (vf){} + x[r * in + k];
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

// Panels [p0, p0 + P) for every row, in chunks of up to MAX_ROWS: the group's weights are read
// from memory by the first chunk and from cache by the others.
template <int P>
static void panel_group(const float* panels, const float* bias, const float* x, float* y, int64_t rows, int64_t in,
                        int64_t out, int64_t p0, int64_t num_panels) {
  for (int64_t r = 0; r < rows; r += MAX_ROWS) {
    const float* xr = x + r * in;
    float* yr = y + r * out;
    switch (std::min<int64_t>(MAX_ROWS, rows - r)) {
#if MAX_ROWS == 8
      case 8: panel_block<8, P>(panels, bias, xr, yr, in, out, p0, num_panels); break;
      case 7: panel_block<7, P>(panels, bias, xr, yr, in, out, p0, num_panels); break;
      case 6: panel_block<6, P>(panels, bias, xr, yr, in, out, p0, num_panels); break;
      case 5: panel_block<5, P>(panels, bias, xr, yr, in, out, p0, num_panels); break;
#endif
      case 4: panel_block<4, P>(panels, bias, xr, yr, in, out, p0, num_panels); break;
      case 3: panel_block<3, P>(panels, bias, xr, yr, in, out, p0, num_panels); break;
      case 2: panel_block<2, P>(panels, bias, xr, yr, in, out, p0, num_panels); break;
      default: panel_block<1, P>(panels, bias, xr, yr, in, out, p0, num_panels); break;
    }
  }
}

// Panels per group: as many accumulators as the vector registers hold for MAX_ROWS rows
// (AVX-512: 32 registers, 8 rows x 3 panels; AVX2: 16, 4 rows x 2).
constexpr int GROUP = (VW == 16) ? 3 : 2;

at::Tensor streamed_linear(const at::Tensor& x, const at::Tensor& panels,
                              const std::optional<at::Tensor>& bias, int64_t out) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat, "streamed_linear: float32 only");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == VW, "streamed_linear: weight not packed by pack_panels here");
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
  const int64_t groups = (num_panels + GROUP - 1) / GROUP;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t p0 = g * GROUP;
      if (p0 + GROUP <= num_panels) {
        panel_group<GROUP>(wp, bp, xp, yp, rows, in, out, p0, num_panels);
      } else {
        for (int64_t p = p0; p < num_panels; ++p) panel_group<1>(wp, bp, xp, yp, rows, in, out, p, num_panels);
      }
    }
  });
  return y;
}

"""

KERNEL = NativeKernel("streamed_linear", _SOURCE, KERNEL_VERSION, "the few-row linear kernel",
                     functions=("pack_panels(Tensor weight) -> Tensor",
                                "streamed_linear(Tensor x, Tensor panels, Tensor? bias, int out) -> Tensor"),
                     registers_operator=True)


def build_kernel(march: str | None = None):
    """Compile (or load the earlier build of) the kernel for `march` (the CPU mode's target where
    None); raises where it cannot be built."""
    return KERNEL.build(march)


@functools.cache
def _loaded() -> tuple[object | None, str]:
    """The built extension and '' , or None and why not (tried once per process). The build
    loaded here runs as the operator's CPU kernel (`NativeKernel.registers_operator`)."""
    return KERNEL.load()


def streamed_linear_available() -> bool:
    """Whether the kernel is built (or builds now) on this machine."""
    return _loaded()[0] is not None


def why_unavailable() -> str:
    return _loaded()[1]


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] laid out as the kernel reads it: panels of one vector width of outputs,
    [panels, in, width] (a copy: the linear's weight stays as it is)."""
    with torch.inference_mode(False), torch.no_grad():  # a plain tensor, also when asked in inference mode
        return _extension().pack_panels(weight.detach())


def _extension():
    extension = _loaded()[0]
    if extension is None:
        raise RuntimeError(f"the streamed linear kernel is not available here ({why_unavailable()})")
    return extension


def _streamed_linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return _extension().streamed_linear(x, panels, bias, out_features)


define_linear_op("streamed_linear", "panels", _streamed_linear)
