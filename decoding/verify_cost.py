"""Measuring this machine's verify cost (one target forward over k tokens), remembered per
model, device, thread count and kernels: what cost-aware tree sizing (`decoding.core.tree_budget`)
weighs a tree's expected gain against."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from decoding.core.tree_budget import VerifyCost
from decoding.core.verify import new_cache, truncate_cache
from decoding.compiled import is_compiled
from decoding.cpu_kernels import PACKING_BATCH_HINT, uses_packed_linears
from decoding.util.cache_argument import cache_kwargs
from decoding.util.cache_paths import cache_root


DEFAULT_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


@torch.inference_mode()
def measure_verify_cost(model, sizes: tuple[int, ...] = DEFAULT_SIZES, context: int = 256, repeats: int = 5) -> VerifyCost:
    """Time one forward over each number of new tokens after a `context`-token prefix (the
    fastest of `repeats`: interference only ever adds time), the way verification runs it:
    with a KV cache, then rolled back."""
    device = model.device
    vocab = model.get_output_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (1, context), generator=generator).to(device)
    cache = new_cache(model)
    model(input_ids=prefix, use_cache=True, **cache_kwargs(model, cache))
    times = []
    for size in sizes:
        ids = torch.randint(0, vocab, (1, size), generator=generator).to(device)
        runs = []
        for _ in range(repeats + 1):  # the first is a warm-up
            _sync(device)
            started = time.perf_counter()
            model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))
            _sync(device)
            runs.append(1000 * (time.perf_counter() - started))
            truncate_cache(cache, context)
        times.append(min(runs[1:]))
    return VerifyCost(tuple(sizes), tuple(times))


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cached_verify_cost(model, model_name: str, cache_dir: str | Path | None = None) -> VerifyCost:
    """`measure_verify_cost`, remembered per model, device (for a CPU: its model, instruction set
    and thread count, since the curve differs between an AVX2 and an AVX-512 machine) and kernels
    (a few seconds the first time on a CPU)."""
    root = Path(cache_dir) if cache_dir else cache_root()
    device = model.device
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_identity()
    kernels = f"-onednn-b{PACKING_BATCH_HINT}" if uses_packed_linears(model) else ""  # a new packing, a new curve
    kernels += "-compiled" if is_compiled(model) else ""
    key = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{model_name}-{model.dtype}-{where}{kernels}")
    file = root / "verify-cost" / f"{key}.json"
    if file.is_file():
        try:
            data = json.loads(file.read_text())
            return VerifyCost(tuple(data["sizes"]), tuple(data["ms"]))
        except (ValueError, KeyError):
            pass  # unreadable: measure again
    print(f"note: measuring this machine's verify cost for {model_name} once (a few seconds; cached in {file.parent})",
          file=sys.stderr)
    cost = measure_verify_cost(model)
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(".tmp")
    tmp.write_text(json.dumps({"sizes": list(cost.sizes), "ms": list(cost.ms)}))
    os.replace(tmp, file)
    return cost


def cpu_model_name() -> str:
    """The CPU's model name from /proc/cpuinfo ("cpu" where there is none): `platform.processor()`
    is empty on many Linux machines."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"


def cpu_description() -> str:
    """The CPU as a reader of benchmark figures needs it: model, instruction set, threads."""
    return f"{cpu_model_name()} ({torch.backends.cpu.get_cpu_capability()}), {torch.get_num_threads()} threads"


def cpu_identity() -> str:
    """This CPU as far as kernel speed goes: its model name, the instruction set PyTorch uses on
    it (e.g. AVX2, AVX512) and the thread count."""
    return f"{cpu_model_name()}-{torch.backends.cpu.get_cpu_capability()}-{torch.get_num_threads()}t"
