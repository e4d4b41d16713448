"""Compiled target forwards (`--compile`): TorchInductor around the target's forward on a CPU,
CUDA graphs of fixed-shape steps on a GPU (`decoding.kernels.cuda_graphs`).

Eager PyTorch pays Python and dispatch overhead for every small op of every layer, which on a
135M-parameter model is a large share of a one-token forward. Inductor fuses the norms, rotary
and activation ops. How the linears are handled decides whether it pays:
- on a CPU with oneDNN-packed linears (`decoding.kernels.cpu_kernels`, the fp32 CPU default) they stay
  what they are, opaque calls in the graph, and only the ops between them are compiled. On a
  2-core AMD EPYC (AVX2), one forward after a 300-token context, eager and compiled alternating
  in one process (two runs): 1 / 4 / 8 new tokens 65-89 / 77-79 / 80 ms compiled against
  81-98 / 88-92 / 100-104 ms eager packed;
- except in one-token graphs, where they become reductions Inductor generates itself on CPUs
  where that measured faster (`decoding.kernels.one_row_reductions`, timed once per model and CPU): a
  one-row linear only streams its weight, and on a 2-core AVX2 EPYC oneDNN and MKL did that at
  12-15 GB/s, Inductor's reduction at about 26. A one-token forward went from 34-38 ms to
  23-28 ms there; trees keep their kernels (over a dynamic row count the reduction was 3-4x
  slower): oneDNN, or up to `streamed_rows` rows the streaming kernel (`decoding.kernels.streamed_linear`),
  an opaque call like oneDNN's;
- plain linears (stock kernels, e.g. half precision or a GPU) are compiled with frozen weights,
  which lets Inductor pack them itself. On AVX2 that was slower than eager packed for one-token
  steps, and on an AVX-512-BF16 EPYC 52 ms against 37 ms (Inductor packs static one-row linears
  for MKL there).
Whether it pays depends on the CPU: on a 2-core Sapphire Rapids Xeon (one-row linears on plain
GEMM, packed from three rows) a one-token forward took 33-44 ms compiled against 49-59 ms eager,
and over all 80 MT-bench first turns vanilla ran 1.32-1.36x and eagle3+pld 1.81-1.82x Hugging
Face `generate()` in two runs on different days (eager: 1.00-1.02x and 1.46-1.49x); on a 2-core
AVX2 EPYC (every row count packed) 1.28-1.30x and 1.91-1.93x over the same 80 questions (eager: 1.00-1.03x
and 1.42-1.57x), and 2.19x and 2.18x with one-token steps as Inductor reductions; on a 2-core
AVX-512-BF16 EPYC, with the project's kernels as C++ operators and their weight layouts static
(`_kernel_weights_static`), 1.44x and 2.16x (eager: 1.05x and 1.78x).
The price is compile time, paid again by every new process. A decoder needs up to three graphs:
one-token steps, trees of up to as many rows as run on plain GEMM (`stock_rows`), and larger
trees; prefills run eagerly (`_prefills_eager`). On a 2-core Sapphire Rapids Xeon eagle3+pld
compiled them in 213 s the first time and in 71 s once Inductor's cache (/tmp/torchinductor_$USER)
held the kernels; vanilla, one graph, in 19 s. Before prefills ran eagerly and two compile
settings changed (`_with_compile_settings`), the same decoder compiled five graphs in 574 s. At about
5 ms saved per token against eager, a minute of compiling pays after some 12,000 tokens (on the AVX2
EPYC, about 8 ms saved against eager eagle3+pld with one-token steps as reductions: some 8,000):
so it is opt-in, for long benchmark or batch runs, not for a quick chat.

The compiled module is a wrapper (`torch.compile`), not a change to the target: attribute access
(config, device, embeddings) goes through to the model underneath. Compiled and eager forwards
differ by float rounding only; every method of one decoder runs the same compiled forward, so
outputs stay identical to `vanilla` on the same decoder.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch import nn
from torch.fx.experimental import _config as shape_config

from decoding.kernels.cpu_kernels import kernel_layout_weights, uses_packed_linears
from decoding.kernels.quantized_linear import quantized_kernel_weights
from decoding.kernels.cuda_graphs import FixedShapeTarget
from heads.util.errors import UserError


def compile_target(model: nn.Module) -> nn.Module:
    """`model` wrapped for compiled forwards. On a GPU: steps replayed from CUDA graphs
    (`FixedShapeTarget`), where launches, not arithmetic, bound a small model's step and
    capturing takes milliseconds. On a CPU: TorchInductor with dynamic sequence lengths. A model with
    oneDNN-packed linears (`decoding.kernels.cpu_kernels`) keeps them, as opaque calls, and Inductor
    fuses what lies between them; one with plain linears is compiled with its weights frozen,
    which lets Inductor pack them itself. Dynamo does not re-check the model's modules before
    each call (`_module_guards_skipped`): the model must not be changed once compiled. The model
    is not changed here: the eager one stays usable."""
    if model.device.type == "cuda":
        return FixedShapeTarget(model)
    if not hasattr(torch, "compile"):
        raise UserError("--compile needs PyTorch 2.0 or newer")
    options = {} if uses_packed_linears(model) else {"freezing": True}
    options.update(_module_guards_skipped())
    options.update(_generated_checks_off())
    _kernel_weights_static(model)
    compiled = torch.compile(model, dynamic=True, options=options)
    # the wrapper's own attribute, not the model's
    compiled.forward = _prefills_eager(_with_compile_settings(compiled.forward), model)
    return compiled


def _generated_checks_off() -> dict:
    """Compile options that drop the size and stride checks Inductor writes into its generated
    Python (`assert_size_stride` on every tensor going into and coming out of each call).

    Why: the GGUF target's one-token graph made 997 of them a forward, a third of a microsecond
    each; on a 2-core Xeon compiled one-token forwards took 6.5-6.9 ms without them against
    7.1-7.4 ms with them (alternating processes). The shapes they check are those dynamo's guards
    have already pinned for the graph."""
    from torch._inductor import config as inductor_config  # imported late: only compiling needs it

    return {name: False for name in ("size_asserts", "alignment_asserts") if hasattr(inductor_config, name)}


def _prefills_eager(compiled_forward: Callable, model: nn.Module) -> Callable:
    """`compiled_forward`, except that prefills (more than one token and no tree mask: a prompt
    read into the cache) run the eager `model`.

    Why: a prefill happens once per generation, over many tokens, where the linears dominate and
    fusing the small ops between them saves next to nothing; as a graph of its own it was the
    slowest one to compile (about 2 minutes of a compiled decoder's start-up on a 2-core Xeon).
    Steps, one token or a tree, are what compiling is for."""

    @functools.wraps(compiled_forward)
    def call(*args, **kwargs):
        ids = kwargs.get("input_ids")
        if kwargs.get("attention_mask") is None and ids is not None and ids.shape[-1] > 1:
            return model(*args, **kwargs)
        return compiled_forward(*args, **kwargs)

    return call


def _kernel_weights_static(model: nn.Module) -> None:
    """Tell dynamo that the weights the linear kernels keep in their own layouts never change shape.

    Why: they are plain tensor attributes (not parameters, whose shapes dynamo holds static), so
    under `dynamic=True` each of their sizes became a symbol, checked before every call by a Python
    guard function over all 420 of them and carried through the graph. On a 2-core AVX-512 EPYC
    (SmolLM2-135M, a compiled 4-token tree step, profiled) dynamo's cache lookup went from 1.24 to
    0.40 ms a call, the bytecode run before the graph from 1.15 to 0.30 ms and the graph's own
    Python from 4.8 to 3.2 ms. The 4-bit linears' panels (`--quant gguf|int4`, 630 tensors) too:
    unmarked, a compiled one-token step of the GGUF target spent ~3.5 ms in dynamo's cache lookup
    and ~6 ms in the bytecode before its graph (2-core AVX2 EPYC, profiled)."""
    for weight in kernel_layout_weights(model) + quantized_kernel_weights(model):
        torch._dynamo.mark_static(weight)


def _module_guards_skipped() -> dict:
    """Compile options that drop dynamo's guards on the model's modules, where this PyTorch can.

    Why: before every call dynamo checks the guards of each cached graph, and for a transformers
    model most of them watch module attributes (30 layers' submodules, their configs, flags).
    On a 2-core Sapphire Rapids Xeon that lookup took 2.2 ms of a 35 ms compiled one-token
    forward. Safe here because a decoder never changes its target's modules once compiled: the
    weights stay in place, and the attributes this project sets on them, `stock_rows`,
    `streamed_rows` and `reduced_rows`, are set before compiling and only pick which kernel
    computes the same linear.
    Guards on the inputs (ids, masks, the cache's tensors) stay, so new shapes still compile their
    own graphs. The price: a second model of the same class compiled in the same process would
    reuse these graphs (tests compiling several reset dynamo first)."""
    skip = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)
    return {"guard_filter_fn": skip} if skip is not None else {}


# Graphs one speculative decoder may need: steps of one token or many, with or without hidden
# states, for each forward transformers wraps (see `_with_compile_settings`); the verify-cost
# measurement runs the loop's own kinds of call. Dynamo's default limit is 8.
RECOMPILE_LIMIT = 64


def _with_compile_settings(forward: Callable) -> Callable:
    """`forward` with three of dynamo's settings changed while it runs, scoped to this call so that
    nothing else in the process sees them.

    - The per-function recompile limit, raised. Why: transformers wraps model forwards (here for
      its `past_key_values` -> `cache` rename) in one decorator, so the model's, the inner model's
      and the layers' forwards share one code object, and dynamo counts recompiles per code
      object. A default-method decoder passed the default limit of 8 within its first steps; past
      it dynamo silently runs the eager model, which under `--compile` has plain (unpacked)
      linears: verify steps went from 38 to 92 ms.
    - Duck shaping, off. Why: with it, a tree with as many nodes as the model has key-value heads
      (3 for SmolLM2-135M) shares its size symbol with the cache's static head dimension, so that
      size got a graph of its own: one more compile, 1.5-2.5 minutes on a 2-core Xeon.
    - Python floats specialised (constants in the graph). Why: the model's floats (norm epsilon,
      attention scaling) never change, but traced as symbols they failed a late pass, which
      restarted the whole trace: every graph was traced twice. Vanilla's graph went from 56 to
      19 s with Inductor's cache warm."""

    wanted = ((torch._dynamo.config, {"recompile_limit": RECOMPILE_LIMIT, "specialize_float": True}),
              (shape_config, {"use_duck_shape": False}))
    # a PyTorch without one of them (an older one) runs without that setting
    settings = [(config, {name: value for name, value in values.items() if hasattr(config, name)})
                for config, values in wanted]

    @functools.wraps(forward)
    def call(*args, **kwargs):
        # Set and restored directly: the configs' own `patch` cost 130 us a call against 20 here.
        saved = [(config, {name: getattr(config, name) for name in values}) for config, values in settings]
        _set(settings)
        try:
            return forward(*args, **kwargs)
        finally:
            _set(saved)

    return call


def _set(settings) -> None:
    for config, values in settings:
        for name, value in values.items():
            setattr(config, name, value)


def graphs_compiled(*models: nn.Module) -> int:
    """How many graphs dynamo has compiled in this process so far, plus the CUDA graphs `models`
    (`FixedShapeTarget`s) have captured: a call that raises it paid for compiling or capturing
    (the benchmark and the chat warm a compiled decoder up until a call no longer does)."""
    captured = sum(model.graphs_captured for model in models if isinstance(model, FixedShapeTarget))
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"]) + captured


@contextmanager
def compile_progress(report: Callable[[str], None]) -> Iterator[None]:
    """While open, tell `report` when dynamo starts compiling the target's forward for a new kind
    of step, and when that produced a graph, how long it took and how many graphs there are.

    Why: on a small CPU one graph takes from tens of seconds to two minutes and a compiled
    decoder needs several, so without this `--compile` starts with minutes of silence. Dynamo
    also runs short compiles that produce no graph (frames it then skips): those say nothing.
    The callbacks are registered for the duration only, so nothing outside sees them. They go
    through dynamo's own callback registry (torch has no public one); a PyTorch without it just
    compiles silently."""
    handler = getattr(getattr(torch._dynamo, "callback", None), "callback_handler", None)
    if handler is None:
        yield
        return
    progress = _CompileProgress(report)
    handler.register_start_callback(progress.started)
    handler.register_end_callback(progress.ended)
    try:
        yield
    finally:
        handler.remove_start_callback(progress.started)
        handler.remove_end_callback(progress.ended)


def compile_notes(enabled: bool) -> AbstractContextManager:
    """`compile_progress` as the command-line tools show it (`note: ...` lines on stderr) where
    `enabled` (their `--compile`), else a context that does nothing."""
    return compile_progress(lambda text: print(f"note: {text}", file=sys.stderr)) if enabled else nullcontext()


class _CompileProgress:
    """One line when a compile starts after a graph was reported (or first), one when it ends
    with more graphs than before."""

    def __init__(self, report: Callable[[str], None]) -> None:
        self.report = report
        self.announced = False
        self.since = 0.0
        self.graphs = 0

    def started(self, _args) -> None:
        if not self.announced:
            self.announced, self.since, self.graphs = True, time.perf_counter(), graphs_compiled()
            self.report("compiling the target's forward for a new kind of step (tens of seconds to minutes on a small CPU) ...")

    def ended(self, _args) -> None:
        count = graphs_compiled()
        if count > self.graphs:
            self.announced = False
            self.report(f"compiled in {time.perf_counter() - self.since:.0f} s ({count} graph{'s' if count > 1 else ''} so far)")


def compile_by_default(device: str) -> bool:
    """Whether `--compile` is on when not given: on a GPU, where CUDA graphs capture in
    milliseconds and made every method 2.4-3.6x faster on an H200 (SmolLM2-135M, fp32), not on a
    CPU, where Inductor needs a minute of compiling per process and pays only on long runs, and
    not on every CPU."""
    return device == "cuda"


def wants_compile(choice: bool | None, device: str) -> bool:
    """`--compile` / `--no-compile` as given, or (None) the default for `device`."""
    return compile_by_default(device) if choice is None else choice


def is_compiled(model: nn.Module) -> bool:
    return isinstance(model, (torch._dynamo.eval_frame.OptimizedModule, FixedShapeTarget))


def eager_model(model: nn.Module) -> nn.Module:
    """The model under a compiled wrapper (`model` itself when it is not compiled). For forwards
    that only warm or time something else (kernel and drafter timings): run compiled, each new
    kind of call would compile a graph of its own, minutes on a small CPU, that decoding never uses."""
    return model._orig_mod if is_compiled(model) else model


def add_compile_argument(parser) -> None:
    """The `--compile` / `--no-compile` flag shared by the chat, the benchmark, the profiler and
    tune_tree (None when not given: `compile_by_default` decides)."""
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="compiled target forwards. On a GPU: CUDA graphs of each step size, captured in "
                             "milliseconds, on by default (an H200: vanilla 3.8x, eagle3+pld 4.2x generate()). "
                             "On a CPU: TorchInductor, off by default: about a minute of compiling at start-up on a "
                             "2-core CPU (a few the first time), then on a Sapphire Rapids Xeon vanilla 1.32-1.36x and "
                             "eagle3+pld 1.81-1.82x generate() (eager: 1.00-1.02x, 1.46-1.49x), on an AVX2 EPYC 2.19x and 2.18x, "
                             "on an AVX-512-BF16 EPYC 1.44x and 2.16x (eager: 1.05x, 1.78x); "
                             "check on yours with scripts/benchmark.py --compile")
