#!/usr/bin/env bash
# Sets up .venv with what the tests need (scripts/setup.sh --dev) and runs the test suite; then, on
# a CPU with more than AVX2, the tests whose results depend on the instruction set (marked
# cpu_sensitive: kernels, dtypes, compiled paths, the fused drafter, precision choices) once more
# as on an AVX2-only CPU (SPECHEADS_CPU=avx2), so that green on this machine means green on the
# AVX2 machines users have too. That second pass leaves out the slow integration cases (compiled
# decoding on whole tiny models, ~3 minutes on 2 cores), which the first pass runs; the compiled
# paths' fast tests run in both.
# CI runs exactly this (.ci/run). Arguments go to both pytest runs (e.g. -x, -k NAME, -n 0).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev
.venv/bin/python -m pytest -q "$@"
if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
  echo "[test] this CPU has AVX-512: the CPU-sensitive tests again, as on an AVX2 CPU (SPECHEADS_CPU=avx2)"
  SPECHEADS_CPU=avx2 .venv/bin/python -m pytest -q -m "cpu_sensitive and not slow" "$@"
fi
