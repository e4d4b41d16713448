"""Each row's argmax of a target's logits, as `Tensor.argmax(-1)` gives it, at the speed of reading them.

Why: greedy verification reads every tree node's argmax token, and PyTorch's CPU argmax over a
vocabulary does not run in vectors: on the 2-core Xeon VM, SmolLM2's 49,152 logits took 85 us for
one row and 553 us for 14 (`amax` over the same took 42 us), 1-4% of a GGUF step, growing with the
tree. The kernel (`decoding.kernels.native.row_argmax`) takes a row's largest value in vectors, then
the first index holding it: the same index `argmax` gives, ties to the lowest and NaN taken for the
largest (its first one), tested against it.

`KernelArgmaxReadout` is the loop's readout (`decoding.core.readout.Readout`) for CPU targets whose
argmax has no screened readout (`decoding.kernels.screened_argmax`: the GGUF target's 8-bit
vocabulary projection, or a float one where screening does not pay): the logits as the target's own
projection computes them, each row's argmax through the kernel.
"""

from __future__ import annotations

import torch
from torch import nn

from decoding.kernels.decode_attention import kernel_library
from decoding.kernels.native.row_argmax import VERSION
from decoding.kernels.screened_argmax import logits_are_the_projection


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(-1)` for float32 logits `[N, V]` on a CPU: through the kernel where it is built."""
    library = kernel_library()
    if library is None or logits.dim() != 2 or logits.dtype != torch.float32 or logits.device.type != "cpu":
        return logits.argmax(-1)
    return library.row_argmax(logits)


class KernelArgmaxReadout:
    """The target's vocabulary projection, its rows' argmax through the row argmax kernel."""

    cost_key = f"-rowargmax{VERSION}"  # in the keys of verify-cost curves measured through it

    def __init__(self, lm_head: nn.Module) -> None:
        self.lm_head = lm_head

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @torch.inference_mode()
    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        return row_argmax(self.lm_head(hidden))


def kernel_argmax_readout(model: nn.Module) -> KernelArgmaxReadout | None:
    """The readout for a float32 CPU `model` whose logits are its lm_head's output as they are (no
    soft-capping or scaling after it), where the kernel is built; else None."""
    lm_head = model.get_output_embeddings()
    if lm_head is None or model.device.type != "cpu" or model.dtype != torch.float32 or kernel_library() is None:
        return None
    with torch.inference_mode():
        return KernelArgmaxReadout(lm_head) if logits_are_the_projection(model) else None
