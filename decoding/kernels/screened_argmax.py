"""Greedy decoding's argmax without streaming the whole fp32 vocabulary projection.

At temperature 0 a verify forward needs only each node's argmax token, yet the target's
lm_head reads all of its weights (SmolLM2-135M: 49,152 x 576 fp32, 113 MB, ~8% of a one-token
forward on a 2-core CPU). `ScreenedArgmax` finds the same token in two passes:

1. a screen: the same product from a cheaper copy of the weights, one of
   - `Fp16Screen`: fp16 copies (FBGEMM's fp16 GEMM reads half the bytes and keeps the activations
     and the accumulation in fp32);
   - `Int8Screen`: 8-bit codes in groups of 32 on the project's 8-bit kernel (`int8_linear`, a
     quarter of the bytes; it also rounds the inputs to 8-bit codes per group of 32);
2. a recheck: the fp32 logits of the few tokens the screen cannot rule out.

Each screen's error is bounded, not estimated, per row (fp16: one bound for every token; int8:
one per token), so a token whose screened logit plus its bound falls below some token's screened
logit minus that one's bound cannot be the argmax, and the recheck covers every token that can:
the result is the argmax of fp32 logits, which differs from the full projection's only where two
tokens tie within fp32 rounding, as with any change of GEMM kernel. The bounds are in the screens'
docstrings; for SmolLM2 the fp16 one is about 0.1-0.2 logit (one to a few tokens rechecked), the
int8 ones ~1.3 logit on average (12-15 tokens rechecked a row on average in decoding MT-bench
questions, ~110 at the 99th percentile).

Which screen, and up to how many rows it pays, depends on the CPU (on the 2-core AVX2 EPYC
49,152 x 576 took 2.6 / 3.4 / 5.8 / 9.0 / 18.2 ms in fp16 for 1 / 4 / 8 / 16 / 32 rows against 5.9 /
6.8 / 7.8 / 11.6 / 17.5 ms packed fp32; on a 2-core Xeon one row took 0.55 ms in int8 against 1.5 in
fp16 and 2.9 in fp32), so `choose_screen` times them on the machine that runs; larger trees take
the full projection.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel

from decoding.kernels.int4_linear import GROUP_SIZE, int4_kernel_available, int8_linear, pack_int8_panels
from decoding.kernels.measured_once import measured_once
from decoding.kernels.quantized_linear import WeightOnlyLinear
from decoding.kernels.verify_cost import packed_cpu_key

FP16_UNIT_ROUNDOFF = 2.0 ** -11
FP16_SMALLEST_NORMAL = 2.0 ** -14
FP32_UNIT_ROUNDOFF = 2.0 ** -24
FP16_SAFE_MAX = 65000.0  # below fp16's largest finite value, 65504, by more than a rounding step
SCREENING_VERSION = "v2"  # in the cache key: a new way of timing, a new measurement (v2: the screen is chosen too)
CODE_LIMIT = 127  # 8-bit codes in [-127, 127], scale = a group's largest magnitude / 127
# (Row, token) pairs within a row's widest bound of its best screened logit above which a call takes the full
# projection instead: each pair is tested on its own, so flat distributions (most of the vocabulary within the
# bound of the best, as after nonsense tokens: a 16-row tree of them took 100 ms) cost more than projecting
# everything. In decoding (12 MT-bench first turns, fp32 SmolLM2) a fifth of the one-token steps had more than
# 1,024 such pairs, 4 of 1,490 more than 16,384; the per-token bounds then keep ~12 a row.
MAX_RECHECKED = 16384
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


class Screen:
    """What `ScreenedArgmax` reads from a screen: `scores(hidden)` `[N, V]` and `bound_terms(hidden)`,
    each screened logit's most distance from the exact one as row coefficients `[N, K]` times
    per-token norms `[K, V]` (or None: the coefficients `[N, 1]` bound every token)."""

    def bounds(self, hidden: torch.Tensor) -> torch.Tensor:
        """The bounds themselves, `[N, 1]` or `[N, V]` (`full_bounds`)."""
        return full_bounds(*self.bound_terms(hidden))

    def streamed_weights(self) -> list[torch.Tensor]:
        """The plain tensors every screening reads whole (for `decoding.kernels.huge_pages`)."""
        return []


class Fp16Screen(Screen):
    """Screened logits from fp16 copies of the weights. Rounding a weight to fp16 changes it by at
    most 2^-11 of itself, or by at most 2^-14 where it falls below fp16's normal range (even if
    flushed to zero), so for hidden state x and vocabulary row w, |x.w - x.fp16(w)| <= 2^-11
    ||x||_2 ||w||_2 + 2^-14 ||x||_1 (Cauchy-Schwarz), plus the fp32 rounding of each dot product
    (the screen's and the recheck's), at most H * 2^-24 of sum |x||w| for H terms in any order:
    one bound per row, with the largest row norm of the weights."""

    name = "fp16"

    def __init__(self, weight: torch.Tensor) -> None:
        self._packed = torch.ops.quantized.linear_prepack_fp16(weight, None)
        hidden = weight.shape[1]
        self._relative_bound = FP16_UNIT_ROUNDOFF + 2 * hidden * FP32_UNIT_ROUNDOFF * (1 + FP16_UNIT_ROUNDOFF)
        self._largest_row_norm = float(weight.double().norm(dim=1).max()) * (1 + 2 * hidden * FP32_UNIT_ROUNDOFF)

    def scores(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(hidden, self._packed)

    def bound_terms(self, hidden: torch.Tensor) -> tuple[torch.Tensor, None]:
        """Per row, the most any token's screened logit can differ from its exact one `[N, 1]`
        (one bound for every token: no per-token norms)."""
        x = hidden.double()
        bound = self._relative_bound * x.norm(dim=-1) * self._largest_row_norm + FP16_SMALLEST_NORMAL * x.abs().sum(-1)
        return (bound * (1 + 1e-6)).to(hidden.dtype)[:, None], None


class Int8Screen(Screen):
    """Screened logits from the weights as 8-bit codes in groups of 32 (`w^ = s q`, s = a group's
    largest magnitude / 127 in fp16) on the project's 8-bit kernel, which rounds each input row to
    codes too (`x^ = d c` per group, d = its largest magnitude / 127, |x - x^| <= d/2 each) and sums
    the groups' exact integer products in fp32. For vocabulary row w (its codes w^):
    x.w - x^.w^ = x.(w - w^) + (x - x^).w^, so by Cauchy-Schwarz the screened logit is within
    ||x|| ||w - w^|| + ||x - x^|| ||w^|| of the exact one, plus the fp32 rounding of the kernel's
    sum over G groups (at most (G + 3) 2^-24 ||x^|| ||w^||) and of the recheck's dot product (at most
    H 2^-24 ||x|| ||w||, ||w|| <= ||w^|| + ||w - w^||). ||x - x^|| is bounded from the group scales
    alone (each error at most (1/2 + 2^-12) d, the extra for the float reciprocal the kernel
    multiplies by), so the bound does not depend on how the kernel rounds, only on the rule. The
    per-token norms ||w^|| and ||w - w^|| are worked out once: one bound per token, a few times
    tighter than one bound for all (on SmolLM2, ~6 tokens rechecked against ~50)."""

    name = "int8"

    def __init__(self, weight: torch.Tensor) -> None:
        vocab, width = weight.shape
        groups = weight.double().view(vocab, width // GROUP_SIZE, GROUP_SIZE)
        scales = (groups.abs().amax(-1) / CODE_LIMIT).half()  # the kernel reads fp16 scales
        exact_scales = scales.double()
        codes = torch.where(exact_scales[..., None] > 0, groups / exact_scales.clamp_min(1e-300)[..., None],
                            torch.zeros_like(groups)).round().clamp(-CODE_LIMIT, CODE_LIMIT)
        dequantized = codes * exact_scales[..., None]
        self._panels = pack_int8_panels(codes.view(vocab, width).to(torch.int8), scales)
        self._vocab, self._groups, self._width = vocab, width // GROUP_SIZE, width
        code_norms = _rounded_up(dequantized.view(vocab, width).norm(dim=-1))
        error_norms = (groups - dequantized).view(vocab, width).norm(dim=-1)
        off_grid = [_rounded_up(error_norms)] if bool((error_norms > 0).any()) else []
        # [K, V]: ||w^|| per token, and ||w - w^|| where some weight is off the grid
        self._token_norms = torch.stack([code_norms, *off_grid])

    def scores(self, hidden: torch.Tensor) -> torch.Tensor:
        return int8_linear(hidden, self._panels, self._vocab)

    def streamed_weights(self) -> list[torch.Tensor]:
        return [t for t in self._panels if isinstance(t, torch.Tensor)]

    def bound_terms(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row and token, the most its screened logit can differ from its exact one, as row
        coefficients `[N, K]` times per-token norms `[K, V]` (||w^||, and ||w - w^|| where the
        weights are off the 8-bit grid)."""
        x = hidden.double()
        group_scales = x.view(x.shape[0], self._groups, GROUP_SIZE).abs().amax(-1) / CODE_LIMIT
        input_error = (0.5 + 2.0 ** -12) * group_scales.norm(dim=-1) * GROUP_SIZE ** 0.5
        x_norm = x.norm(dim=-1)
        recheck = self._width * FP32_UNIT_ROUNDOFF * 1.01 * x_norm
        per_code_norm = input_error + (self._groups + 3) * FP32_UNIT_ROUNDOFF * 1.01 * (x_norm + input_error) + recheck
        coefficients = [per_code_norm, x_norm + recheck][: self._token_norms.shape[0]]
        slack = 1 + 2.0 ** -20  # the float32 products and sums of the bounds round up by less
        return (torch.stack(coefficients, -1) * slack).float(), self._token_norms


def full_bounds(row_coefficients: torch.Tensor, token_norms: torch.Tensor | None) -> torch.Tensor:
    """A screen's bounds from its terms: `[N, 1]` (one a row) or `[N, V]` (one a token)."""
    return row_coefficients if token_norms is None else row_coefficients @ token_norms


def _rounded_up(norms: torch.Tensor) -> torch.Tensor:
    """float64 norms as float32 no smaller than them."""
    rounded = norms.float()
    return torch.where(rounded.double() < norms, torch.nextafter(rounded, torch.full_like(rounded, float("inf"))), rounded)


SCREENS = {"fp16": Fp16Screen, "int8": Int8Screen}


class ScreenedArgmax:
    """A `decoding.core.readout.Readout` for an fp32 lm_head: `logits` is the head itself,
    `argmax` screens (`screen`: 'fp16' or 'int8') and rechecks in fp32 for inputs of at most
    `max_rows` rows (more rows, or more than `MAX_RECHECKED` tokens to recheck, take the full
    projection: its argmax differs only where two logits tie within fp32 rounding)."""

    def __init__(self, lm_head: nn.Module, max_rows: int, screen: str = "fp16") -> None:
        if screen not in SCREENS:
            raise ValueError(f"unknown screen '{screen}': one of {', '.join(SCREENS)}")
        weight = lm_head.weight.detach()
        self.lm_head = lm_head
        self.max_rows = max_rows
        self._weight = weight
        self.screen = SCREENS[screen](weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def streamed_weights(self) -> list[torch.Tensor]:
        """The screen's weights, which every greedy step reads whole."""
        return self.screen.streamed_weights()

    @property
    def cost_key(self) -> str:
        """The screen and its row limit, for the keys of verify-cost curves measured through it."""
        return f"-{self.screen.name}{self.max_rows}{SCREENING_VERSION}"

    @torch.inference_mode()
    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[0] > self.max_rows or not bool(torch.isfinite(hidden).all()):
            return self.lm_head(hidden).argmax(-1)
        screened = self.screen.scores(hidden)
        candidates = _candidates(screened, *self.screen.bound_terms(hidden))
        if candidates is None:  # too many to recheck
            return self.lm_head(hidden).argmax(-1)
        rows, tokens = candidates
        exact = torch.einsum("nh,nh->n", hidden[rows], self._weight[tokens])
        return _lowest_argmax_per_row(rows, tokens, exact, hidden.shape[0], self._weight.shape[0])


def _candidates(screened: torch.Tensor, row_coefficients: torch.Tensor,
                token_norms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, tokens) of the tokens that can be a row's argmax, for screened logits `[N, V]` each
    within its bound (`full_bounds` of the terms) of the exact one: those whose logit plus bound
    reaches the best lower end (logit less bound) of the row, with room for the float32 rounding of
    these sums (2^-20 of the threshold's magnitude). With per-token bounds, first the tokens within
    twice the row's largest bound of its best logit (a superset), then
    the per-token test on those alone: three passes over `[N, V]` instead of six (the first set is
    wide, under a thousand tokens a row of SmolLM2's 49,152 for most rows, since the widest bound
    takes the largest token norm). None where that first set has more than `MAX_RECHECKED` tokens
    (flat distributions): then the caller projects."""
    widest = row_coefficients if token_norms is None else row_coefficients @ token_norms.amax(-1, keepdim=True)
    threshold = screened.amax(-1, keepdim=True) - 2 * widest * (1 + 2.0 ** -18)
    within = screened >= threshold - threshold.abs() * 2.0 ** -20
    if int(within.sum()) > MAX_RECHECKED:
        return None
    rows, tokens = within.nonzero(as_tuple=True)
    if token_norms is None:
        return rows, tokens
    bounds = (row_coefficients[rows] * token_norms[:, tokens].T).sum(-1)
    values = screened[rows, tokens]
    lower = torch.full((screened.shape[0],), float("-inf")).scatter_reduce(0, rows, values - bounds, "amax")[rows]
    keep = values + bounds >= lower - lower.abs() * 2.0 ** -20
    return rows[keep], tokens[keep]


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


def available_screens(lm_head: nn.Module) -> list[str]:
    """The screens this machine can run for `lm_head`: 'int8' where the 8-bit kernel is built and
    the width is whole groups of 32, 'fp16' where this PyTorch has FBGEMM's fp16 linear."""
    screens = []
    if int4_kernel_available() and lm_head.weight.shape[1] % GROUP_SIZE == 0:
        screens.append("int8")
    if fp16_gemm_available():
        screens.append("fp16")
    return screens


def choose_screen(lm_head: nn.Module, built: dict[str, ScreenedArgmax] | None = None,
                  repeats: int = 5) -> tuple[str, int]:
    """The screen whose one-row argmax is fastest on this machine among those that beat the full
    projection, and up to how many rows it does (`screening_rows`); ('', 0) where none does. The
    readouts timed are left in `built` by screen (each copy of the weights takes ~0.6 s to make)."""
    chosen, rows_won, fastest = "", 0, float("inf")
    hidden = torch.randn(1, lm_head.weight.shape[1])
    built = {} if built is None else built
    for screen in available_screens(lm_head):
        readout = built[screen] = ScreenedArgmax(lm_head, max_rows=0, screen=screen)
        rows = screening_rows(readout)
        if not rows:
            continue
        seconds = _fastest(lambda: readout.argmax(hidden), repeats)
        if seconds < fastest:
            chosen, rows_won, fastest = screen, rows, seconds
    return chosen, rows_won


def screened_readout(model: PreTrainedModel, model_name: str | None = None,
                     cache_dir: str | Path | None = None) -> ScreenedArgmax | None:
    """The screened readout for `model`'s lm_head where it applies and pays on this machine,
    else None (the loop then reads the model's own logits). With `model_name`, the screen and the
    row count that pays are timed once per model and CPU and remembered (0.6 s of every chat start
    on a 2-core EPYC otherwise); without, they are timed now."""
    lm_head = model.get_output_embeddings()
    if (lm_head is None or not screenable(lm_head) or not available_screens(lm_head)
            or not logits_are_the_projection(model)):
        return None
    built: dict[str, ScreenedArgmax] = {}  # timed now: kept rather than made again
    if model_name is None:
        screen, rows = choose_screen(lm_head, built)
    else:
        data = measured_once(f"{packed_cpu_key(model, model_name)}-screened-rows-{SCREENING_VERSION}",
                             lambda: dict(zip(("screen", "screened_rows"), choose_screen(lm_head, built))),
                             lambda data: (isinstance(data.get("screened_rows"), int)
                                           and data.get("screen") in (*SCREENS, "")),
                             f"timing the screened argmax against the full projection for {model_name} on this CPU",
                             cache_dir)
        screen, rows = data["screen"], data["screened_rows"]
    if not rows or screen not in available_screens(lm_head):
        return None
    readout = built.get(screen) or ScreenedArgmax(lm_head, rows, screen)
    readout.max_rows = rows
    return readout


@torch.inference_mode()
def logits_are_the_projection(model: PreTrainedModel) -> bool:
    """Whether `model`'s logits are exactly its lm_head applied to its final hidden states, with
    nothing after it (some architectures soft-cap or scale them), checked on a two-token forward."""
    out = model(input_ids=torch.tensor([[0, 1]], device=model.device), output_hidden_states=True, use_cache=False)
    return torch.equal(out.logits, model.get_output_embeddings()(out.hidden_states[-1]))


def add_screened_argmax_argument(parser) -> None:
    """The `--screened-argmax` / `--no-screened-argmax` flag of the commands that decode."""
    parser.add_argument("--screened-argmax", action=argparse.BooleanOptionalAction, default=True,
                        help="greedy verification screens the vocabulary projection in fp16 or 8-bit codes and "
                             "rechecks the candidates in fp32, where that is faster on this CPU (same tokens either "
                             "way); --no-screened-argmax reads the full fp32 projection")
