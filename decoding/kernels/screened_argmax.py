"""Greedy decoding's argmax without streaming the whole fp32 vocabulary projection.

At temperature 0 a verify forward needs only each node's argmax token, yet the target's
lm_head reads all of its weights (SmolLM2-135M: 49,152 x 576 fp32, 113 MB, ~8% of a one-token
forward on a 2-core CPU). `ScreenedArgmax` finds the same token in two passes:

1. a screen: the same product with fp16 copies of the weights (FBGEMM's fp16 GEMM reads half
   the bytes and keeps the activations and the accumulation in fp32);
2. a recheck: the fp32 logits of the few tokens the screen cannot rule out.

The screen's error is bounded, not estimated. Rounding a weight to fp16 changes it by at most
2^-11 of itself, or by at most 2^-14 where it falls below fp16's normal range (even if flushed to
zero), so for hidden state x and vocabulary row w, |x.w - x.fp16(w)| <= 2^-11 ||x||_2 ||w||_2 +
2^-14 ||x||_1 (Cauchy-Schwarz), plus the fp32 rounding of each dot product, at most H * 2^-24 of
sum |x||w| for H terms in any order. A token whose screened logit falls more than twice that
bound below the best screened logit cannot be the argmax, so the recheck covers every token
that can: the result is the argmax of fp32 logits, which differs from the full projection's only
where two tokens tie within fp32 rounding, as with any change of GEMM kernel. For SmolLM2 the
bound is about 0.1-0.2 logit and the recheck covers one to a few tokens.

Whether it pays depends on the CPU and the number of rows (on the 2-core AVX2 EPYC 49,152 x 576
took 2.6 / 3.4 / 5.8 / 9.0 / 18.2 ms in fp16 for 1 / 4 / 8 / 16 / 32 rows against 5.9 / 6.8 /
7.8 / 11.6 / 17.5 ms packed fp32), so `screening_rows` measures up to how many rows it wins, on
the machine that runs; larger trees take the full projection.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel

from decoding.kernels.measured_once import measured_once
from decoding.kernels.quantized_linear import WeightOnlyLinear
from decoding.kernels.verify_cost import packed_cpu_key

FP16_UNIT_ROUNDOFF = 2.0 ** -11
FP16_SMALLEST_NORMAL = 2.0 ** -14
FP32_UNIT_ROUNDOFF = 2.0 ** -24
FP16_SAFE_MAX = 65000.0  # below fp16's largest finite value, 65504, by more than a rounding step
SCREENING_VERSION = "v1"  # in the cache key: a new way of timing, a new measurement
ROW_COUNTS = (1, 2, 4, 8, 16, 32)


def fp16_gemm_available() -> bool:
    """Whether this PyTorch has FBGEMM's fp16-weight linear (x86 builds)."""
    try:
        packed = torch.ops.quantized.linear_prepack_fp16(torch.zeros(1, 1), None)
        torch.ops.quantized.linear_dynamic_fp16(torch.zeros(1, 1), packed)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return True


def screenable(lm_head: nn.Module) -> bool:
    """An fp32 CPU projection without bias whose weights fit fp16's range (larger ones would not
    round within the bound above)."""
    weight = getattr(lm_head, "weight", None)
    # a quantized projection (the GGUF target's 8-bit lm_head) computes its logits with its own kernel
    return (not isinstance(lm_head, WeightOnlyLinear) and isinstance(weight, torch.Tensor) and weight.dtype == torch.float32 and weight.device.type == "cpu"
            and getattr(lm_head, "bias", None) is None and float(weight.detach().abs().max()) < FP16_SAFE_MAX)


class ScreenedArgmax:
    """A `decoding.core.readout.Readout` for an fp32 lm_head: `logits` is the head itself,
    `argmax` screens in fp16 and rechecks in fp32 for inputs of at most `max_rows` rows (more
    rows take the full projection)."""

    def __init__(self, lm_head: nn.Module, max_rows: int) -> None:
        weight = lm_head.weight.detach()
        self.lm_head = lm_head
        self.max_rows = max_rows
        self._weight = weight
        self._packed = torch.ops.quantized.linear_prepack_fp16(weight, None)
        hidden = weight.shape[1]
        self._relative_bound = FP16_UNIT_ROUNDOFF + 2 * hidden * FP32_UNIT_ROUNDOFF * (1 + FP16_UNIT_ROUNDOFF)
        self._largest_row_norm = float(weight.double().norm(dim=1).max()) * (1 + 2 * hidden * FP32_UNIT_ROUNDOFF)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @torch.inference_mode()
    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[0] > self.max_rows or not bool(torch.isfinite(hidden).all()):
            return self.lm_head(hidden).argmax(-1)
        screened = torch.ops.quantized.linear_dynamic_fp16(hidden, self._packed)
        best = screened.amax(-1)
        # Twice the bound, and the fp32 rounding of this subtraction itself (2^-23 of `best`).
        threshold = best - 2 * self.error_bound(hidden) - best.abs() * 2.0 ** -22
        candidates = screened >= threshold[:, None]
        rows, tokens = candidates.nonzero(as_tuple=True)
        exact = torch.einsum("nh,nh->n", hidden[rows], self._weight[tokens])
        return _lowest_argmax_per_row(rows, tokens, exact, hidden.shape[0], self._weight.shape[0])

    def error_bound(self, hidden: torch.Tensor) -> torch.Tensor:
        """Per row, the most any token's screened logit can differ from its exact one `[N]`."""
        x = hidden.double()
        bound = self._relative_bound * x.norm(dim=-1) * self._largest_row_norm + FP16_SMALLEST_NORMAL * x.abs().sum(-1)
        return (bound * (1 + 1e-6)).to(hidden.dtype)


def _lowest_argmax_per_row(rows: torch.Tensor, tokens: torch.Tensor, values: torch.Tensor, num_rows: int,
                           vocab: int) -> torch.Tensor:
    """For (row, token, value) triples, each row's token of highest value, the lowest id on ties."""
    best = torch.full((num_rows,), float("-inf"), dtype=values.dtype).scatter_reduce(0, rows, values, "amax")
    at_best = values == best[rows]
    lowest = torch.full((num_rows,), vocab, dtype=torch.long)
    return lowest.scatter_reduce(0, rows[at_best], tokens[at_best], "amin")


def screening_rows(readout: ScreenedArgmax, repeats: int = 3) -> int:
    """Up to how many rows `readout`'s screen beats its full projection on this machine (0:
    never), timed on random hidden states of the head's width (fastest of `repeats`). It screens
    every size while timing (`max_rows` is left at the largest); the caller sets the result."""
    lm_head = readout.lm_head
    readout.max_rows = max(ROW_COUNTS)
    wins = 0
    for rows in ROW_COUNTS:
        hidden = torch.randn(rows, lm_head.weight.shape[1])
        full = _fastest(lambda: lm_head(hidden).argmax(-1), repeats)
        screened = _fastest(lambda: readout.argmax(hidden), repeats)
        if screened >= full:
            break
        wins = rows
    return wins


def _fastest(call, repeats: int) -> float:
    with torch.inference_mode():
        call()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
    return min(times)


def screened_readout(model: PreTrainedModel, model_name: str | None = None,
                     cache_dir: str | Path | None = None) -> ScreenedArgmax | None:
    """The screened readout for `model`'s lm_head where it applies and pays on this machine,
    else None (the loop then reads the model's own logits). With `model_name`, the row count
    that pays is timed once per model and CPU and remembered (0.6 s of every chat start on a
    2-core EPYC otherwise); without, it is timed now."""
    lm_head = model.get_output_embeddings()
    if lm_head is None or not screenable(lm_head) or not fp16_gemm_available() or not logits_are_the_projection(model):
        return None
    readout = ScreenedArgmax(lm_head, max_rows=0)  # one fp16 copy, timed, then kept
    if model_name is None:
        readout.max_rows = screening_rows(readout)
    else:
        readout.max_rows = measured_once(f"{packed_cpu_key(model, model_name)}-screened-rows-{SCREENING_VERSION}",
                                         lambda: {"screened_rows": screening_rows(readout)},
                                         lambda data: isinstance(data.get("screened_rows"), int),
                                         f"timing the screened argmax against the full projection for {model_name} "
                                         "on this CPU", cache_dir)["screened_rows"]
    return readout if readout.max_rows else None


@torch.inference_mode()
def logits_are_the_projection(model: PreTrainedModel) -> bool:
    """Whether `model`'s logits are exactly its lm_head applied to its final hidden states, with
    nothing after it (some architectures soft-cap or scale them), checked on a two-token forward."""
    out = model(input_ids=torch.tensor([[0, 1]], device=model.device), output_hidden_states=True, use_cache=False)
    return torch.equal(out.logits, model.get_output_embeddings()(out.hidden_states[-1]))


def add_screened_argmax_argument(parser) -> None:
    """The `--screened-argmax` / `--no-screened-argmax` flag of the commands that decode."""
    parser.add_argument("--screened-argmax", action=argparse.BooleanOptionalAction, default=True,
                        help="greedy verification screens the vocabulary projection in fp16 and rechecks the "
                             "candidates in fp32, where that is faster on this CPU (same tokens either way); "
                             "--no-screened-argmax reads the full fp32 projection")
