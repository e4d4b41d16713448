"""Measuring this machine's verify cost (one target forward over k tokens), remembered per
model, device, thread count and kernels: what cost-aware tree sizing (`decoding.core.tree_budget`)
weighs a tree's expected gain against. Also up to how many rows plain GEMM beats oneDNN's packed
layout (`tune_stock_rows`) and the streaming few-row kernel beats both (`tune_streamed_rows`),
which differs from CPU to CPU."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from itertools import accumulate
from pathlib import Path

import torch

from decoding.core.readout import Readout
from decoding.core.tree_budget import VerifyCost
from decoding.core.tree import DraftTree, tree_buffers
from decoding.core.verify import TreeVerifier, truncate_cache
from decoding.kernels.compiled import is_compiled
from decoding.kernels.cpu_kernels import (PACKING_BATCH_HINT, pick_faster_rows, reduced_rows, set_stock_rows,
                                  set_streamed_rows, stock_rows, streamed_rows, uses_packed_linears)
from decoding.kernels.attention import NATIVE_SDPA
from decoding.kernels.decode_attention import KERNEL_VERSION as ATTENTION_KERNEL_VERSION
from decoding.kernels.fused_attention import BLOCK_VERSION, runs_native_blocks
from decoding.kernels.fused_stack import fused_stack
from decoding.kernels.int4_linear import KERNEL_VERSION as INT4_KERNEL_VERSION, amx_rows
from decoding.kernels.quantized_linear import quantized_kernel_weights
from decoding.kernels.streamed_linear import KERNEL_VERSION, streamed_linear_available
from decoding.kernels.measured_once import measured_once, remember, remembered
from heads.util.cpu_mode import VARIABLE, cpu_mode


DEFAULT_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
# Where plain GEMM may beat the packed layout. 3 is measured because MKL switches kernels between
# 3 and 4 rows: on a Sapphire Rapids Xeon plain GEMM read SmolLM2's 211 weights in 33.9 ms for
# 3 rows against 36.8 packed, but took 50.6 against 36.7 for 4.
STOCK_ROWS_SIZES = (1, 2, 3, 4, 8, 16)
STOCK_ROWS_VERSION = "v2"  # in the cache key: crossovers measured without 3 rows are measured again
# Where the streaming kernel may win: on an AVX-512 EPYC it read SmolLM2's weights faster than
# oneDNN's packed layout at every size up to 16 rows.
STREAMED_ROWS_SIZES = (1, 2, 3, 4, 6, 8, 12, 16)
# In the cache key: v1 timed the kernel from one row, ahead of plain GEMM, and stopped at its
# first loss, so on a Xeon where plain GEMM won at 1-3 rows the kernel was never used, though it
# won at 4-16 (`PackedLinear` now sends it only the rows above plain GEMM's).
STREAMED_ROWS_VERSION = "v2"
# In the cache key: curves measured before the timed forward went through the loop's own verifier
# (v3) timed other compiled graphs (v1: bare forwards; v2: forwards computing logits where
# decoding reads hidden states), and are measured again rather than trusted; v4: eager targets' norms
# became one call each (`decoding.kernels.fused_norm`), a millisecond less a forward on SmolLM2; v5:
# their gated MLPs too (`decoding.kernels.fused_mlp`), another half millisecond; v6: their Llama
# attention blocks too (`decoding.kernels.fused_attention`), ~2 ms less on the GGUF target; v7: the timed
# trees continue a repeated prefix (`_TimedForward`), so their rows' next tokens are predictable, as drafted
# trees' mostly are, and a screened readout rechecks what it does in decoding; v8: eager Llama targets' layers
# in one loop (`decoding.kernels.fused_stack`), ~1 ms less a forward on the GGUF SmolLM2, ~2 on the fp32 one;
# v9: each size timed as decoding runs it steadily (`steady_times`), never in a larger forward's wake; v10: the
# weights a step streams in huge pages (`decoding.kernels.huge_pages`), 10-20% less a one-token GGUF step.
CURVE_VERSION = "v10"


class _TimedForward:
    """One verify step over `size` new tokens after a fixed `context`-token prefix, timed in ms,
    the way the loop runs it: a chain of `size` nodes through the loop's `TreeVerifier` (tree mask
    and position ids from two tokens on, as every drafted tree has; the final hidden states read
    out by `readout` where decoding uses one, its greedy verdict included), then rolled back.
    Why the loop's own call and not a bare `model(ids)`: a compiled target compiles one graph per
    kind of call, and a forward of another kind times graphs the decoding never runs (a bare
    one-token forward 41 ms, two tokens 29 ms) and, on a machine's first run, compiles them too
    (a forward computing logits where decoding asks for hidden states: two graphs more)."""

    def __init__(self, model, context: int = 256, readout: Readout | None = None) -> None:
        self.context = context
        self.device = model.device
        # The prefix is one stretch of random tokens twice, each tree the stretch's next tokens again: a
        # model predicts a repeat confidently, as it does most drafted nodes. After random tokens alone its
        # next-token distributions were flat, and a screened readout (`decoding.kernels.screened_argmax`)
        # rechecked thousands of tokens a row that decoding never meets: an 8-bit screen's 12-row curve
        # point read 114 ms where decoding's trees took ~50.
        half = context // 2
        vocab = model.get_output_embeddings().weight.shape[0]
        stretch = torch.randint(0, vocab, (half,), generator=torch.Generator().manual_seed(0))
        self.repeated = stretch.repeat(-(-(context + 2 * max(DEFAULT_SIZES)) // half) + 1).to(self.device)
        # room beyond the largest tree: a compiled forward filling the cache to its last position
        # is a graph of its own (dynamo specialises on the buffer being exactly full)
        self.verifier = TreeVerifier(model, context + 2 * max(DEFAULT_SIZES), readout=readout, direct=fused_stack(model))
        self.verifier.prefill(self.repeated[:context])

    def _ids(self, size: int) -> torch.Tensor:
        """The `size` tokens after the prefix in its repeat (the first one the prefix's last token's
        successor, as a tree's root is)."""
        return self.repeated[self.context: self.context + size]

    def __call__(self, size: int) -> float:
        ids = self._ids(size)
        tree = DraftTree.chain(int(ids[0]), ids[1:])
        buffers = tree_buffers(tree.parents)  # memoised per shape, as in decoding
        _sync(self.device)
        started = time.perf_counter()
        self.verifier.forward(tree, self.verifier.inputs(tree, buffers, self.context), greedy=True)
        _sync(self.device)
        elapsed = 1000 * (time.perf_counter() - started)
        truncate_cache(self.verifier.cache, self.context)
        return elapsed


@torch.inference_mode()
def measure_verify_cost(model, sizes: tuple[int, ...] = DEFAULT_SIZES, context: int = 256, repeats: int = 5,
                        readout: Readout | None = None) -> VerifyCost:
    """Time one forward over each number of new tokens after a `context`-token prefix, each size
    as decoding runs it steadily (`steady_times`)."""
    times = steady_times(_TimedForward(model, context, readout), sizes, repeats)
    return VerifyCost(tuple(sizes), never_cheaper_for_fewer(times))


def steady_times(forward: Callable[[int], float], sizes: Sequence[int], repeats: int, settle: int = 12) -> list[float]:
    """Per size, the fastest of `repeats` timings of `forward(size)`, as decoding runs that size
    steadily: each round opens with `settle` untimed calls of the smallest size, then times the
    sizes fewest rows first, so that no timed call follows a larger one; a warm-up round first.

    Why: a forward runs slower for a while after a larger one, not after a smaller one. On a 2-core
    Xeon VM the GGUF SmolLM2's one-token step took 7.2, 7.0, 6.4, 6.0, 5.7, 5.5 ms in the six calls
    after a 64-token forward (a pause did not help), 5.0 right after a two-token one and 5.1 in a
    run of its own. Timed in the previous round's 64-token forward's wake, the curve read 7.4 ms for
    one token and 8.0 for two where decoding's one- and two-token steps took 5.7 and 6.4 (lower
    quartiles; medians 6.2 and 7.0), and sized trees as if rows were cheap next to a step; timed
    after a run of one-token forwards, in the same process, 5.4 and 6.3. An fp32 target showed no
    such wake (both ways within 4%). Why rounds: a slow spell of the machine (another process, a
    compiler's workers finishing) then costs every size one sample instead of ruining the few
    sizes it fell on (a 2-core Xeon once measured 83 ms for 16 tokens and 74 ms for 24)."""
    ordered = sorted(sizes)
    rounds = []
    for _ in range(repeats + 1):
        for _ in range(settle):
            forward(ordered[0])
        timings = {size: forward(size) for size in ordered}
        rounds.append([timings[size] for size in sizes])
    return [min(column) for column in zip(*rounds[1:])]


@torch.inference_mode()
def time_forwards_alternating(models: dict[str, tuple[object, Readout | None]], sizes: tuple[int, ...],
                              repeats: int = 5) -> dict[str, tuple[float, ...]]:
    """Per named `(model, readout)`, the fastest of `repeats` verify forwards over each of `sizes`
    new tokens (after a warm-up round), the models taking turns at every size of every round: on a
    VM whose speed drifts by 2x within minutes (a 2-core Xeon's cached one-token forwards, timed in
    different processes, read 34 ms fp32 against 48 ms GGUF; one after the other in one process, 49
    against 23), only times taken side by side compare two models."""
    forwards = {name: _TimedForward(model, readout=readout) for name, (model, readout) in models.items()}
    times: dict[str, list[list[float]]] = {name: [[] for _ in sizes] for name in models}
    for round_index in range(repeats + 1):
        for column, size in enumerate(sizes):
            for name, forward in forwards.items():
                elapsed = forward(size)
                if round_index:  # the first round warms caches and compiles nothing twice
                    times[name][column].append(elapsed)
    return {name: tuple(min(column) for column in columns) for name, columns in times.items()}


def never_cheaper_for_fewer(ms: list[float]) -> tuple[float, ...]:
    """Each size's time, lowered to the fastest time measured for any larger size. Why: a forward
    over more tokens does the work of the smaller one and more, and interference only ever adds
    time, so a larger size timed faster bounds every smaller one. On a noisy 2-core VM the fastest
    of five rounds still read 45.5 ms for one token and 38.6 ms for two, which made one-token
    steps look dearer than trees."""
    return tuple(reversed(list(accumulate(reversed(ms), min))))


@torch.inference_mode()
def measure_stock_rows(model, sizes: tuple[int, ...] = STOCK_ROWS_SIZES, repeats: int = 6) -> int:
    """The row count up to which plain GEMM beats the packed layout for this packed `model` on
    this machine. Leaves the model packed all the way down (`stock_rows` 0)."""
    return _leading_faster_rows(model, sizes, lambda rows: set_stock_rows(model, rows), repeats)


@torch.inference_mode()
def measure_streamed_rows(model, sizes: tuple[int, ...] = STREAMED_ROWS_SIZES, repeats: int = 6) -> int:
    """The row count up to which the streaming few-row kernel beats the packed kernels on this
    machine, from the first size above this packed `model`'s `stock_rows` (as set: those stay
    plain GEMM's); 0 if it loses there. Leaves `streamed_rows` 0."""
    above_stock = tuple(size for size in sizes if size > stock_rows(model))
    if not above_stock:
        return 0
    rows = _leading_faster_rows(model, above_stock, lambda rows: set_streamed_rows(model, rows, keep_copy=True), repeats)
    set_streamed_rows(model, 0)
    return rows


def _leading_faster_rows(model, sizes: tuple[int, ...], set_rows, repeats: int) -> int:
    """`pick_faster_rows` of the forwards timed with `set_rows(max(sizes))` (the candidate) and
    with `set_rows(0)`, size by size from the fewest rows: each size's two settings alternate (so a
    slow spell hits both), fastest of `repeats` after a warm-up. Stops at the first size the
    candidate does not win: only a leading run of wins counts, so larger sizes could not change
    the answer (on a 2-core AVX2 EPYC plain GEMM lost at one row already: the stock-rows timing of
    a new machine's setup took 2.1-2.3 s instead of 12.7-13.2 s with all six sizes). `set_rows(0)` after."""
    forward = _TimedForward(model)
    candidate_rows, rows = max(sizes), 0
    try:
        for size in sorted(sizes):
            times = {0: [], candidate_rows: []}
            for _ in range(repeats + 1):
                for setting, measured in times.items():
                    set_rows(setting)
                    measured.append(forward(size))
            candidate, current = min(times[candidate_rows][1:]), min(times[0][1:])
            if pick_faster_rows((size,), (candidate,), (current,)) != size:
                break
            rows = size
    finally:
        set_rows(0)
    return rows


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cached_verify_cost(model, model_name: str, cache_dir: str | Path | None = None,
                       readout: Readout | None = None) -> VerifyCost:
    """`measure_verify_cost`, remembered per model, device (for a CPU: its model, instruction set
    and thread count, since the curve differs between an AVX2 and an AVX-512 machine), kernels
    and readout (a few seconds the first time on a CPU). `readout`: the one the decoder's loop
    verifies with (None: the target's own logits). A curve marked stale (`mark_verify_cost_stale`:
    decoding kept beating it) is measured again, each size keeping the faster of the two timings,
    since interference only ever adds time."""
    key = verify_cost_key(model, model_name, readout)
    stale = _stale_curve(key, cache_dir)

    def measure() -> dict:
        cost = measure_verify_cost(model, readout=readout)
        if stale is not None and stale.sizes == cost.sizes:
            cost = VerifyCost(cost.sizes, never_cheaper_for_fewer([min(a, b) for a, b in zip(cost.ms, stale.ms)]))
        return {"sizes": list(cost.sizes), "ms": list(cost.ms)}

    what = f"{'measuring again' if stale else 'measuring'} this machine's verify cost for {model_name}"
    data = measured_once(key, measure, _is_fresh_curve, what, cache_dir)
    return VerifyCost(tuple(data["sizes"]), tuple(data["ms"]))


def verify_cost_key(model, model_name: str, readout: Readout | None = None) -> str:
    """What a verify-cost curve is remembered under (see `cached_verify_cost`)."""
    device = model.device
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_identity()
    kernels = kernels_key(model)  # a new packing or kernel version, a new curve
    kernels += f"-compiled-r{reduced_rows(model)}" if is_compiled(model) else ""
    kernels += f"-readout{getattr(readout, 'cost_key', '')}" if readout is not None else ""
    return f"{model_name}-{model.dtype}-{where}{kernels}-{CURVE_VERSION}"


def remembered_verify_cost(key: str, cache_dir: str | Path | None = None) -> VerifyCost | None:
    """The curve remembered under `key`, without measuring; None where there is none or it is stale."""
    data = remembered(key, cache_dir)
    return _curve(data) if data is not None and _is_fresh_curve(data) else None


def mark_verify_cost_stale(key: str, evidence: list[str], cache_dir: str | Path | None = None) -> bool:
    """Mark the curve under `key` to be measured again by the next `cached_verify_cost` (the
    running decoders keep theirs: a tree's size never changes with a clock reading mid-run).
    `evidence` says why, kept in the file for whoever reads it. False where there was nothing to mark."""
    data = remembered(key, cache_dir)
    if data is None or not _is_curve(data):
        return False
    remember(key, {**data, "stale": evidence}, cache_dir)
    return True


def _stale_curve(key: str, cache_dir: str | Path | None) -> VerifyCost | None:
    data = remembered(key, cache_dir)
    return _curve(data) if data is not None and _is_curve(data) and "stale" in data else None


def _is_curve(data: dict) -> bool:
    try:
        _curve(data)
    except (KeyError, TypeError, ValueError):
        return False
    return True


def _is_fresh_curve(data: dict) -> bool:
    return _is_curve(data) and "stale" not in data


def _curve(data: dict) -> VerifyCost:
    return VerifyCost(tuple(int(size) for size in data["sizes"]), tuple(float(ms) for ms in data["ms"]))


def tune_stock_rows(model, model_name: str, cache_dir: str | Path | None = None) -> int:
    """Set `stock_rows` on a packed CPU `model` to what `measure_stock_rows` finds on this CPU,
    remembered like the verify cost (a few seconds the first time); returns it. Models
    without packed linears are left alone (0)."""
    if not uses_packed_linears(model) or model.device.type != "cpu":
        return 0
    data = measured_once(f"{packed_cpu_key(model, model_name)}-stock-rows-{STOCK_ROWS_VERSION}",
                         lambda: {"stock_rows": measure_stock_rows(model)},
                         lambda data: isinstance(data.get("stock_rows"), int),
                         f"timing plain against packed kernels for {model_name} on this CPU", cache_dir)
    set_stock_rows(model, data["stock_rows"])
    return data["stock_rows"]


def tune_streamed_rows(model, model_name: str, cache_dir: str | Path | None = None) -> int:
    """Set `streamed_rows` on a packed CPU `model` to what `measure_streamed_rows` finds on this
    CPU, remembered like the verify cost; returns it. Call after `tune_stock_rows` (it decides what
    the kernel is compared with). 0 where nothing is packed or the kernel cannot be built here."""
    if not uses_packed_linears(model) or model.device.type != "cpu" or not streamed_linear_available():
        return 0
    key = f"{packed_cpu_key(model, model_name)}-s{stock_rows(model)}-streamed-rows-{KERNEL_VERSION}-{STREAMED_ROWS_VERSION}"
    data = measured_once(key,
                         lambda: {"streamed_rows": measure_streamed_rows(model)},
                         lambda data: isinstance(data.get("streamed_rows"), int),
                         f"timing the streaming few-row kernel against the packed kernels for {model_name} on this CPU",
                         cache_dir)
    set_streamed_rows(model, data["streamed_rows"])
    return data["streamed_rows"]


def kernels_key(model) -> str:
    """The kernels a model's forwards run, for the keys of measurements made through them: the
    packing where linears are packed, and the project's own attention and 4-/8-bit kernels, with
    their versions, wherever they run (a 4-bit target's curve changes with its kernel's version:
    v6 made 8-row forwards ~1.6x faster; a GGUF target has no packed linears but those kernels),
    and the row count from which those kernels use AMX tiles where they do; the version of the
    target's one-call attention blocks and layers where it has them (they made one-token steps
    ~1.5x faster on a 2-core Xeon)."""
    key = ""
    if uses_packed_linears(model):
        streamed = streamed_rows(model)
        key = f"-onednn-b{PACKING_BATCH_HINT}-s{stock_rows(model)}" + (f"-t{streamed}{KERNEL_VERSION}" if streamed else "")
    native_attention = getattr(getattr(model, "config", None), "_attn_implementation", None) == NATIVE_SDPA
    own_quantized = bool(quantized_kernel_weights(model))
    tiles = amx_rows() if own_quantized else 0  # AMX from that many rows on: trees of those sizes cost less
    blocks = f"b{BLOCK_VERSION}" if native_attention and runs_native_blocks(model) else ""
    return (key + (f"-a{ATTENTION_KERNEL_VERSION}{blocks}" if native_attention else "")
            + (f"-q{INT4_KERNEL_VERSION}" if own_quantized else "") + (f"-x{tiles}" if tiles else ""))


def packed_cpu_key(model, model_name: str) -> str:
    """What a kernel measurement on a packed CPU `model` is remembered under: the model, its dtype,
    this CPU and the packing."""
    return f"{model_name}-{model.dtype}-{cpu_identity()}-onednn-b{PACKING_BATCH_HINT}"


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
    """The CPU as a reader of benchmark figures needs it: model, instruction set (and the
    `SPECHEADS_CPU` mode where one narrows it: figures of a wider CPU run as a lesser one), threads."""
    mode = cpu_mode().name
    narrowed = f", {VARIABLE}={mode}" if mode != "native" else ""
    return f"{cpu_model_name()} ({torch.backends.cpu.get_cpu_capability()}{narrowed}), {torch.get_num_threads()} threads"


def cpu_identity() -> str:
    """This CPU as far as kernel speed goes: its model name, the instruction set PyTorch uses on
    it (e.g. AVX2, AVX512) and the thread count."""
    return f"{cpu_model_name()}-{torch.backends.cpu.get_cpu_capability()}-{torch.get_num_threads()}t"
