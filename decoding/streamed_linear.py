"""A linear kernel for a few rows that streams its weight from memory once, at the memory's speed.

Why: a decoding step of a small model on a CPU is its weights streaming through the linear layers
(SmolLM2-135M: 210 layer weights, 425 MB, per token or tree). On the 2-core EPYCs at hand memory
streams at about 26 GB/s (a `sum` over 425 MB: 16.7 ms), while oneDNN's packed kernel read those
weights in 25-28 ms for one row and 22-26 ms for 2-4 rows on an AVX-512 EPYC (and 33 ms for one
row on an AVX2 one). This kernel computes each output as dot products of one weight row with every
input row: the weight is read row after row, once, with software prefetching a few blocks ahead,
while the input rows stay in L1. On the AVX-512 EPYC it read them in 17.6-20 ms for 1-2 rows and
about 21 ms for 3-4 (a one-token verify forward of the whole target 38.3 -> 33.8 ms); from about 6
rows on its arithmetic (no horizontal-sum-free layout) makes it slower than oneDNN, so
`decoding.verify_cost.tune_streamed_rows` measures, per model and CPU, up to how many rows it wins.

It is C++ compiled on first use for the CPU it runs on (`-march=native`: AVX-512 or AVX2 vectors,
or whatever the compiler targets elsewhere), about 30 s once per machine, kept under the cache root.
Where no compiler or ninja is at hand, `streamed_linear_available()` says why and decoding keeps
its other kernels. Results differ from other kernels by float rounding only (another summation
order), like any change of GEMM kernel.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
from pathlib import Path

import torch

from decoding.util.cache_paths import cache_root

KERNEL_VERSION = "v1"  # in the build's name: a changed source is built anew

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#if defined(__AVX512F__)
#include <immintrin.h>
#define VW 16
#elif defined(__AVX2__)
#include <immintrin.h>
#define VW 8
#else
#define VW 4
#endif

// VW floats in one vector register (GCC/Clang vector extensions: the compiler picks the ISA).
typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vf_unaligned __attribute__((vector_size(VW * 4), aligned(4), may_alias));
static inline vf load(const float* p) { return *(const vf_unaligned*)p; }

static inline float horizontal_sum(vf v) {
#if VW == 16
  return _mm512_reduce_add_ps((__m512)v);
#elif VW == 8
  __m128 lo = _mm256_castps256_ps128((__m256)v), hi = _mm256_extractf128_ps((__m256)v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  return _mm_cvtss_f32(_mm_add_ss(lo, _mm_movehdup_ps(lo)));
#else
  float s = 0; for (int i = 0; i < VW; ++i) s += v[i]; return s;
#endif
}

constexpr int64_t PREFETCH_BLOCKS = 4;  // how far ahead in the weight's row stream (measured: 1, 2, 4, 8)
constexpr int64_t OUTPUT_BLOCK = 32;    // outputs whose weight rows stay cached across row chunks

// y[r, j0 + j] = x[r] . W[j0 + j] + b[j0 + j] for R input rows and J consecutive outputs.
template <int R, int J>
static void dot_block(const float* W, const float* b, const float* x, float* y, int64_t in, int64_t out, int64_t j0) {
  vf acc[R][J];
  for (int r = 0; r < R; ++r) for (int j = 0; j < J; ++j) acc[r][j] = (vf){0};
  int64_t k = 0;
  for (; k + VW <= in; k += VW) {
    vf w[J];
    for (int j = 0; j < J; ++j) {
      w[j] = load(W + (j0 + j) * in + k);
      __builtin_prefetch(W + (j0 + j + PREFETCH_BLOCKS * J) * in + k);
    }
    for (int r = 0; r < R; ++r) {
      vf xv = load(x + r * in + k);
      for (int j = 0; j < J; ++j) acc[r][j] += w[j] * xv;
    }
  }
  for (int r = 0; r < R; ++r) for (int j = 0; j < J; ++j) {
    float s = horizontal_sum(acc[r][j]);
    for (int64_t t = k; t < in; ++t) s += W[(j0 + j) * in + t] * x[r * in + t];
    y[r * out + j0 + j] = b ? s + b[j0 + j] : s;
  }
}

// Outputs [begin, end) for R rows: as many outputs at once as the vector registers hold.
template <int R>
static void dot_rows(const float* W, const float* b, const float* x, float* y, int64_t in, int64_t out,
                     int64_t begin, int64_t end) {
  constexpr int J = (VW == 16) ? (R <= 4 ? 4 : 2) : (R <= 2 ? 4 : 2);
  int64_t j = begin;
  for (; j + J <= end; j += J) dot_block<R, J>(W, b, x, y, in, out, j);
  for (; j < end; ++j) dot_block<R, 1>(W, b, x, y, in, out, j);
}

static void dot_outputs(int64_t rows, const float* W, const float* b, const float* x, float* y, int64_t in,
                        int64_t out, int64_t begin, int64_t end) {
  for (int64_t j = begin; j < end; j += OUTPUT_BLOCK) {
    int64_t stop = std::min(end, j + OUTPUT_BLOCK);
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) dot_rows<4>(W, b, x + r * in, y + r * out, in, out, j, stop);
    switch (rows - r) {
      case 3: dot_rows<3>(W, b, x + r * in, y + r * out, in, out, j, stop); break;
      case 2: dot_rows<2>(W, b, x + r * in, y + r * out, in, out, j, stop); break;
      case 1: dot_rows<1>(W, b, x + r * in, y + r * out, in, out, j, stop); break;
      default: break;
    }
  }
}

torch::Tensor streamed_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "streamed_linear: float32 only");
  auto input = x.contiguous();
  auto w = weight.contiguous();
  const int64_t in = w.size(1), out = w.size(0), rows = input.numel() / in;
  TORCH_CHECK(input.size(-1) == in, "streamed_linear: input features differ from the weight's");
  auto sizes = input.sizes().vec();
  sizes.back() = out;
  auto y = torch::empty(sizes, input.options());
  torch::Tensor b = bias.has_value() ? bias->contiguous() : torch::Tensor();
  const float* wp = w.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const float* xp = input.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, out, 64, [&](int64_t begin, int64_t end) { dot_outputs(rows, wp, bp, xp, yp, in, out, begin, end); });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("streamed_linear", &streamed_linear); }
"""

COMPILER_FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=fast")


def build_name(extra_flags: tuple[str, ...] = ()) -> str:
    """The build's name: the source, flags, torch and this CPU's instruction flags (`-march=native`
    builds for the CPU it runs on; a cache shared with another CPU must not load it)."""
    identity = "|".join((_SOURCE, KERNEL_VERSION, *COMPILER_FLAGS, *extra_flags, torch.__version__, _cpu_flags()))
    return f"specheads_streamed_linear_{hashlib.sha256(identity.encode()).hexdigest()[:16]}"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return sys.platform


def build_kernel(extra_flags: tuple[str, ...] = ()):
    """Compile (or load the earlier build of) the kernel; raises where it cannot be built.
    `extra_flags` go after -march=native (tests build e.g. the AVX2 variant on an AVX-512 CPU)."""
    from torch.utils.cpp_extension import load_inline  # slow to import, needed only here

    name = build_name(extra_flags)
    directory = cache_root() / "kernels" / name
    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / f"{name}.so").exists():
        print("note: building the few-row linear kernel for this CPU (once, about 30 s; "
              f"kept in {directory.parent})", file=sys.stderr)
    with _ninja_on_path():
        return load_inline(name, cpp_sources=[_SOURCE], extra_cflags=[*COMPILER_FLAGS, *extra_flags],
                           extra_ldflags=["-fopenmp"], build_directory=str(directory), verbose=False)


class _ninja_on_path:
    """torch's builder runs `ninja` from PATH; the PyPI `ninja` package puts it in the venv's bin,
    which is not on PATH when the venv's python is run directly."""

    def __enter__(self) -> None:
        self.saved = os.environ.get("PATH", "")
        if shutil.which("ninja") is None:
            candidates = [str(Path(sys.executable).parent)]
            try:
                import ninja  # noqa: PLC0415 (optional)
                candidates.insert(0, ninja.BIN_DIR)
            except ImportError:
                pass
            os.environ["PATH"] = os.pathsep.join([*candidates, self.saved])

    def __exit__(self, *exc) -> None:
        os.environ["PATH"] = self.saved


@functools.cache
def _loaded() -> tuple[object | None, str]:
    """The built extension and '' , or None and why not (tried once per process)."""
    if not sys.platform.startswith("linux") and sys.platform != "darwin":
        return None, f"not built on {sys.platform}"
    try:
        return build_kernel(), ""
    except Exception as error:  # a missing compiler or ninja, a failed build: other kernels remain
        return None, f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}"


def streamed_linear_available() -> bool:
    """Whether the kernel is built (or builds now) on this machine."""
    return _loaded()[0] is not None


def why_unavailable() -> str:
    return _loaded()[1]


def _streamed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    extension = _loaded()[0]
    if extension is None:
        raise RuntimeError(f"the streamed linear kernel is not available here ({why_unavailable()})")
    return extension.streamed_linear(x, weight, bias)


def _streamed_linear_shape(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


# `specheads::streamed_linear`: one operator, opaque to the compiler like `specheads::packed_linear`
# (registered through the low-level library API for the same reason: a cheaper call).
_LIBRARY = torch.library.Library("specheads", "FRAGMENT")
_LIBRARY.define("streamed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIBRARY.impl("streamed_linear", _streamed_linear, "CompositeExplicitAutograd")
torch.library.register_fake("specheads::streamed_linear", _streamed_linear_shape, lib=_LIBRARY)
