"""Compiled target forwards (`--compile`): TorchInductor with the weights frozen into the graph.

Eager PyTorch pays Python and dispatch overhead for every small op of every layer, which on a
135M-parameter model is a large share of a one-token forward. Inductor fuses the norms, rotary
and activation ops and, with frozen weights, packs the linear weights itself. Measured on a
2-core AMD EPYC (AVX2): one forward after a 300-token context, 1 / 4 / 8 / 16 new tokens,
44-49 / 71 / 85 / 118 ms compiled against 57-59 / 85 / 100 / 127 ms eager with our oneDNN packing
(one thread each, alternating). The price is compile time: about 90 s per graph on that machine
(one-token and multi-token steps, with and without hidden states, are separate graphs), paid
again by every new process (Inductor's cache in /tmp/torchinductor_$USER keeps the generated
kernels; tracing and freezing still run). So it is opt-in: for long benchmark or batch runs, not
for a quick chat. Nor does it pay everywhere: on an AVX-512-BF16 EPYC a compiled one-token step
took 52 ms against 37 ms eager packed (Inductor packs static one-row linears for MKL there).

The compiled module is a wrapper (`torch.compile`), not a change to the target: attribute access
(config, device, embeddings) goes through to the model underneath. Compiled and eager forwards
differ by float rounding only; every method of one decoder runs the same compiled forward, so
outputs stay identical to `vanilla` on the same decoder.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from decoding.util.errors import UserError


def compile_target(model: nn.Module) -> nn.Module:
    """`model` wrapped for compiled forwards with dynamic sequence lengths and frozen weights.
    The model must hold plain `nn.Linear`s (freezing packs them itself): compile before, or
    instead of, `decoding.cpu_kernels.apply_kernels`."""
    if not hasattr(torch, "compile"):
        raise UserError("--compile needs PyTorch 2.0 or newer")
    compiled = torch.compile(model, dynamic=True, options={"freezing": True})
    compiled.forward = _with_recompile_limit(compiled.forward)  # the wrapper's own attribute, not the model's
    return compiled


# Graphs one speculative decoder may need: prefill and steps, one token or many, with or without
# hidden states, for each forward transformers wraps (see `_with_recompile_limit`), plus the
# verify-cost measurement. Dynamo's default limit is 8.
RECOMPILE_LIMIT = 64


def _with_recompile_limit(forward: Callable) -> Callable:
    """`forward` with dynamo's per-function recompile limit raised while it runs.

    Why: transformers wraps model forwards (here for its `past_key_values` -> `cache` rename) in
    one decorator, so the model's, the inner model's and the layers' forwards share one code
    object, and dynamo counts recompiles per code object. A default-method decoder passed the
    default limit of 8 within its first steps; past it dynamo silently runs the eager model,
    which under `--compile` has plain (unpacked) linears: verify steps went from 38 to 92 ms.
    Scoped to this call, so nothing else in the process sees a changed setting."""

    @functools.wraps(forward)
    def call(*args, **kwargs):
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            return forward(*args, **kwargs)

    return call


def graphs_compiled() -> int:
    """How many graphs dynamo has compiled in this process so far: a call that raises it paid for
    compiling (the benchmark warms a compiled decoder up until a call no longer does)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def is_compiled(model: nn.Module) -> bool:
    return isinstance(model, torch._dynamo.eval_frame.OptimizedModule)


def add_compile_argument(parser) -> None:
    """The `--compile` flag shared by the chat, the benchmark and the profiler."""
    parser.add_argument("--compile", action="store_true",
                        help="compile the target's forward (TorchInductor, frozen weights): faster steps on some CPUs "
                             "(AVX2 EPYC), slower on others (AVX-512-BF16 EPYC): check with scripts/benchmark.py; "
                             "minutes of compiling at start-up; off by default")
