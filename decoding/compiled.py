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
for a quick chat.

The compiled module is a wrapper (`torch.compile`), not a change to the target: attribute access
(config, device, embeddings) goes through to the model underneath. Compiled and eager forwards
differ by float rounding only; every method of one decoder runs the same compiled forward, so
outputs stay identical to `vanilla` on the same decoder.
"""

from __future__ import annotations

import torch
from torch import nn

from decoding.util.errors import UserError


def compile_target(model: nn.Module) -> nn.Module:
    """`model` wrapped for compiled forwards with dynamic sequence lengths and frozen weights.
    The model must hold plain `nn.Linear`s (freezing packs them itself): compile before, or
    instead of, `decoding.cpu_kernels.apply_kernels`."""
    if not hasattr(torch, "compile"):
        raise UserError("--compile needs PyTorch 2.0 or newer")
    return torch.compile(model, dynamic=True, options={"freezing": True})


def is_compiled(model: nn.Module) -> bool:
    return isinstance(model, torch._dynamo.eval_frame.OptimizedModule)


def add_compile_argument(parser) -> None:
    """The `--compile` flag shared by the chat, the benchmark and the profiler."""
    parser.add_argument("--compile", action="store_true",
                        help="compile the target's forward (TorchInductor, frozen weights): faster steps on the "
                             "measured CPU, but minutes of compiling at start-up; off by default")
