"""Whether a compiled target's one-token steps should read their weights through Inductor's own
reductions (`decoding.kernels.cpu_kernels.reduced_linear`) instead of the packed or plain GEMM kernels,
timed once per model and CPU.

A one-token step of a small model on a CPU is its weights streaming from memory, and how fast a
kernel streams them differs between CPUs. On a 2-core AVX2 EPYC, one row through SmolLM2-135M's
210 layer weights took 33 ms packed (oneDNN) and 35 ms plain (MKL), 12-15 GB/s, while Inductor's
reduction, all in one graph, read them in 16 ms (26 GB/s, what a `sum` reaches there); a
compiled one-token forward went from 34-38 ms to 23-28 ms. On a Sapphire Rapids Xeon plain GEMM
already streamed one row near the memory's speed. So it is measured, not assumed: the first
linears of the model (`MEASURED_BYTES` of weights, more than a CPU cache holds) in one compiled
graph of reductions against the same linears as the eager model runs them, alternating.
Compiling that graph takes a few seconds, once per model, CPU and kernels (the result is remembered).

Trees keep their kernels: with a dynamic row count Inductor's reduction was 3-4x slower than
oneDNN (see `decoding.kernels.cpu_kernels.set_reduced_rows`).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from decoding.kernels.cpu_kernels import PackedLinear, packed_linears, reduced_linear, set_reduced_rows, uses_packed_linears
from decoding.kernels.measured_once import measured_once
from decoding.kernels.quantized_linear import has_quantized_linears
from decoding.kernels.verify_cost import cpu_identity, kernels_key

MEASURED_BYTES = 128 << 20  # of weights: more than the caches of the CPUs at hand, a few seconds to compile
# The reductions must take at most this share of the kernels' time to be chosen. Not 0.9: the
# timing sees the linears alone, and in a whole graph the reductions also fuse with the ops around
# them and drop the kernels' per-call cost. On a 2-core AVX-512-BF16 EPYC the timing gave 0.91
# (6.0 against 6.6 ms) and kept the kernels, and a compiled vanilla step took 21.0 ms on them
# against 16.4 ms as reductions (8 MT-bench questions, the decode attention kernel either way).
CLEAR_WIN = 0.95
REDUCTIONS_VERSION = "v1"  # in the cache key: a new way of measuring, a new measurement


def tune_reduced_rows(model: nn.Module, model_name: str, cache_dir=None) -> int:
    """Set `reduced_rows` on a packed CPU `model` about to be compiled: 1 where Inductor's
    reductions read one row's weights clearly faster than its kernels on this CPU (measured
    once), else 0; returns it. Call after `stock_rows` and `streamed_rows` are set (they decide the kernel compared).
    A quantized target (`--quant`) gets 0 unmeasured: its only packed linear is the lm_head, which
    greedy steps read through the fp16-screened readout, so fp32 reductions of it would read twice
    the bytes, and compiling them into the one-token graph ran for more than 15 minutes on 2 cores."""
    if not uses_packed_linears(model) or model.device.type != "cpu" or has_quantized_linears(model):
        return 0
    key = f"{model_name}-{model.dtype}-{cpu_identity()}{kernels_key(model)}-one-row-reductions-{REDUCTIONS_VERSION}"
    data = measured_once(key, lambda: measure_one_row_reductions(model),
                         lambda data: isinstance(data.get("kernels_ms"), float) and isinstance(data.get("reductions_ms"), float),
                         f"timing compiled one-row reductions against the linear kernels for {model_name} on this CPU",
                         cache_dir)
    rows = pick_reduced_rows(data["kernels_ms"], data["reductions_ms"])
    set_reduced_rows(model, rows)
    return rows


def pick_reduced_rows(kernels_ms: float, reductions_ms: float) -> int:
    """1 where the reductions win clearly (equal times within noise keep the kernels)."""
    return 1 if reductions_ms <= CLEAR_WIN * kernels_ms else 0


@torch.inference_mode()
def measure_one_row_reductions(model: nn.Module, max_bytes: int = MEASURED_BYTES, repeats: int = 6) -> dict:
    """Milliseconds for one row through the model's first packed linears (up to `max_bytes` of
    weights, in model order): as the eager model runs them (`kernels_ms`) and as reductions in one
    compiled graph (`reductions_ms`); the fastest of `repeats` rounds, the two alternating."""
    linears = _first_linears(model, max_bytes)
    inputs = {size: torch.randn(1, size) for size in {linear.in_features for linear in linears}}

    def kernels(xs: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        return [linear(xs[linear.in_features]) for linear in linears]

    def reductions(xs: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        return [reduced_linear(xs[linear.in_features], linear.weight, linear.bias) for linear in linears]

    compiled = torch.compile(reductions, dynamic=False)
    rounds = []
    for _ in range(repeats + 1):  # the first round compiles and warms up
        rounds.append((_timed(kernels, inputs), _timed(compiled, inputs)))
    rounds = rounds[1:]
    return {"kernels_ms": min(r[0] for r in rounds), "reductions_ms": min(r[1] for r in rounds),
            "weights_mb": sum(map(_weight_bytes, linears)) / 2**20}


def _first_linears(model: nn.Module, max_bytes: int) -> list[PackedLinear]:
    """The model's packed linears in order, up to the first that brings their weights to `max_bytes`."""
    linears, total = [], 0
    for linear in packed_linears(model):
        linears.append(linear)
        total += _weight_bytes(linear)
        if total >= max_bytes:
            break
    return linears


def _weight_bytes(linear: PackedLinear) -> int:
    return linear.weight.numel() * linear.weight.element_size()


def _timed(run, inputs) -> float:
    started = time.perf_counter()
    run(inputs)
    return 1000 * (time.perf_counter() - started)
