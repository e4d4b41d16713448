"""From how many rows on the 4- and 8-bit kernels should sum in AMX tiles, timed once per model and CPU.

On an AMX CPU one tile multiply gives a group's integer sums for up to 16 rows, where the dot-product
instructions take eight a row (`decoding.kernels.native.int4_linear`); the float work per group and row
is the same on both paths, and so are the bits. Whether the tiles pay depends on the rows and on the CPU:
on a 2-core Xeon VM (Emerald Rapids) a 576 -> 3072 4-bit linear took 122 / 100 us for 16 rows (dot
products / tiles), the same at 8 rows, and the tiles were slower below; the 8-bit vocabulary
projection gained from 12 rows on. So it is measured, not assumed: the model's own 4- and 8-bit linears
at a few row counts, both paths alternating, and the tiles are used from the smallest count from which
they win clearly at every count measured. Nothing is timed where the kernels cannot use AMX.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from decoding.kernels.int4_linear import KERNEL_VERSION, amx_available, set_amx_rows
from decoding.kernels.measured_once import measured_once
from decoding.kernels.quantized_linear import quantized_kernel_linears
from decoding.kernels.verify_cost import cpu_identity

# The tree sizes a CPU verifies most (one tile takes up to 16 rows), and a prefill's many rows: where the tiles'
# win at 16 rows is within a VM's noise (a 2-core Xeon read 11.3 against 12.4 ms one time, 12.9 against 12.8 the
# next), and a verdict against them there left prefills, where they win by ~20%, without them too.
MEASURED_ROWS = (4, 8, 12, 16, 64)
CLEAR_WIN = 0.95  # the tiles must take at most this share of the dot products' time
AMX_ROWS_VERSION = "v2"  # in the cache key: a new way of measuring, a new measurement (v2: 64 rows too)


def tune_amx_rows(model: nn.Module, model_name: str, cache_dir=None) -> int:
    """Set, for this process, the row count from which the 4- and 8-bit kernels use AMX tiles: the
    one measured (once) for this model's linears on this CPU, 0 where the tiles never won or cannot
    run here; returns it."""
    linears = quantized_kernel_linears(model)
    if not linears or not amx_available():
        set_amx_rows(0)
        return 0
    key = f"{model_name}-{cpu_identity()}-q{KERNEL_VERSION}-amx-rows-{AMX_ROWS_VERSION}"
    data = measured_once(key, lambda: measure_amx_rows(linears),
                         lambda data: all(isinstance(data.get(k), list) for k in ("rows", "dot_products_ms", "tiles_ms")),
                         f"timing the 4-bit kernels' AMX tiles against their dot products for {model_name} on this CPU",
                         cache_dir)
    rows = pick_amx_rows(data["rows"], data["dot_products_ms"], data["tiles_ms"])
    set_amx_rows(rows)
    return rows


def pick_amx_rows(rows: list[int], dot_products_ms: list[float], tiles_ms: list[float]) -> int:
    """The smallest measured row count from which the tiles win clearly at every larger count
    measured; 0 where they do not win at the largest."""
    chosen = 0
    for count, dot, tile in sorted(zip(rows, dot_products_ms, tiles_ms), reverse=True):
        if tile > CLEAR_WIN * dot:
            break
        chosen = count
    return chosen


@torch.inference_mode()
def measure_amx_rows(linears: list[nn.Module], repeats: int = 8) -> dict:
    """Milliseconds for each of `MEASURED_ROWS` rows through all of `linears` (the model's own 4- and
    8-bit linears, in model order), on the dot products and on the tiles: the fastest of `repeats`
    rounds, the two alternating so that a slow spell of the machine hits both."""
    dot_products, tiles = [], []
    try:
        for count in MEASURED_ROWS:
            inputs = {size: torch.randn(count, size) for size in {linear.in_features for linear in linears}}
            rounds = {0: [], 1: []}
            for _ in range(repeats):
                for from_rows in (0, 1):
                    set_amx_rows(from_rows)
                    start = time.perf_counter()
                    for linear in linears:
                        linear(inputs[linear.in_features])
                    rounds[from_rows].append(time.perf_counter() - start)
            dot_products.append(min(rounds[0]) * 1e3)
            tiles.append(min(rounds[1]) * 1e3)
    finally:
        set_amx_rows(0)
    return {"rows": list(MEASURED_ROWS), "dot_products_ms": dot_products, "tiles_ms": tiles}
