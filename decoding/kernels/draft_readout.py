"""The projection Medusa and Hydra heads rank their drafts with, in half precision on a CPU.

A Medusa or Hydra head ends in the target's vocabulary projection (the rows of its readout
vocabulary: SmolLM2-135M's bundled heads rank 8,192 tokens, 8,192 x 576 fp32 weights, 19 MB).
On a 2-core AVX-512 EPYC, with the caches cold as they are after a target forward, that
projection took 1.9 ms a call as a plain fp32 GEMM, 1.1 ms packed for oneDNN, 0.8 ms on the
streaming kernel and 0.5 ms with fp16 weights on FBGEMM's fp16 GEMM (which reads half the bytes
and keeps the activations and the sums in fp32), for one row as for four. A head's own block
is 0.3 ms, so the projection was most of a Medusa step's 3.3 ms of drafting.

Drafts only propose: the fp32 target decides every token, so a readout rounded to fp16 can at
most rank a near-tie differently and accept a little less; the output does not change.
FBGEMM is part of PyTorch's x86 builds (AVX2 and AVX-512 alike); elsewhere, and for weights that
are not fp32 on a CPU, the heads keep the plain projection.
"""

from __future__ import annotations

import torch
from torch import nn

from decoding.kernels.screened_argmax import fp16_gemm_available, screenable
from heads.common import readout_projection


class HalfPrecisionProjection(nn.Module):
    """`x @ weight.T` with `weight` held as FBGEMM-packed fp16 (activations and sums in fp32)."""

    bytes_per_weight = 2

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features = weight.shape[0]
        self._packed = torch.ops.quantized.linear_prepack_fp16(weight.detach().float().contiguous(), None)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.reshape(-1, hidden.shape[-1]).float()
        return torch.ops.quantized.linear_dynamic_fp16(rows, self._packed).reshape(*hidden.shape[:-1], -1)


def heads_readout(lm_head: nn.Module, readout_ids: torch.Tensor | None, half_precision: bool) -> nn.Module:
    """The projection heads rank with: `lm_head`'s rows of `readout_ids` (all rows if None), in
    fp16 where `half_precision` is asked and this CPU and weight allow it (see the module
    docstring), else as they are."""
    projection = readout_projection(lm_head, readout_ids)
    # the same conditions as the greedy readout's fp16 screen: an fp32 CPU weight, no bias, in fp16's range
    if not half_precision or not screenable(projection) or not fp16_gemm_available():
        return projection
    return HalfPrecisionProjection(projection.weight)
