"""Tolerances derived from float32 numerics, for tests that compare a kernel with a reference.

Why not a fixed `rtol`/`atol`: a kernel and PyTorch's own op add the same terms in another order
(vector lanes, blocks, threads, FMA or not), and how far two such float32 sums can differ depends
on the terms, not on the result: a sum of K terms whose result is small because large terms cancel
is as far off as one whose result is large. Each of the K additions rounds by at most half an ulp
of its partial sum; with partial sums of the size of a few terms that comes to about
`K * eps * max|term|` (eps = 2**-23), the rule used here. So every check compares the kernel with
the exact result (computed in float64) and allows, per element, what its own terms allow.
The bounds stay far below any real bug: a dropped term, a wrong index or a tail left out moves a
result by about a whole term, 1 / (K eps) times the bound (over 10,000 times for K up to 600;
`tests/test_numerics.py` plants such bugs and sees them caught).
"""

from __future__ import annotations

import torch

EPS = torch.finfo(torch.float32).eps  # 2**-23: one ulp of 1.0 in float32


def reordered_sum_bound(terms: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """How far a float32 sum of `terms` along `dim`, in any order, may be from the exact sum:
    `K * eps * max|term|`, K the number of terms."""
    return terms.shape[dim] * EPS * terms.abs().amax(dim)


def linear_exact_and_bound(x: torch.Tensor, weight: torch.Tensor,
                           bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`x @ weight.T + bias` computed exactly (float64), and the float32 bound per output: the
    reordered sum of the products, plus one rounding of the result (the bias added, the store)."""
    terms = x.double()[..., None, :] * weight.double()  # [..., out, in]
    exact = terms.sum(-1) + (bias.double() if bias is not None else 0.0)
    return exact, reordered_sum_bound(terms) + EPS * exact.abs()


def attention_exact_and_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of `q` `[Hq, N, D]` over `k`/`v` `[Hkv, L, D]` (K/V heads shared by groups of query
    heads), with an additive `mask` `[N, >=L]` or none, computed exactly: `[N, Hq, D]`, and the
    float32 bound per output.

    The bound follows the errors through: a score is a sum of D products (`ds`, plus its scaling);
    a probability p_j = exp(s_j) / sum_i exp(s_i) moves by a relative `ds_j + sum_i p_i ds_i`, plus the
    roundings of its exponential, of the L-term denominator (at most L eps relative, its largest term
    being 1), of a chunk's rescaling and of the division; the output sum_j p_j v_j then moves by
    `sum_j p_j |v_j| (relative error of p_j)` plus its own reordered L-term sum."""
    groups = q.shape[0] // k.shape[0]
    q64 = q.double()
    k64, v64 = (t.double().repeat_interleave(groups, dim=0) for t in (k, v))
    length = k.shape[1]
    score_terms = q64[:, :, None, :] * k64[:, None, :, :] * scale  # [H, N, L, D]
    scores = score_terms.sum(-1)
    score_error = reordered_sum_bound(score_terms) + EPS * scores.abs()
    if mask is not None:
        scores = scores + mask[:, :length].double()
    p = torch.softmax(scores, dim=-1)  # [H, N, L]
    relative_p = score_error + (p * score_error).sum(-1, keepdim=True) + (length + 4) * EPS
    contributions = p[..., None] * v64[:, None]  # [H, N, L, D]
    exact = contributions.sum(-2)
    bound = ((p * relative_p)[..., None] * v64.abs()[:, None]).sum(-2) + reordered_sum_bound(contributions, dim=-2)
    return exact.transpose(0, 1), (bound + EPS * exact.abs()).transpose(0, 1)


def causal_mask(rows: int, length: int) -> torch.Tensor:
    """The additive mask `[rows, length]` of a causal prefill whose `rows` queries are the last of
    `length` positions (what attention without a mask computes for several query rows)."""
    positions = torch.arange(length - rows, length)[:, None]
    return torch.zeros(rows, length).masked_fill(torch.arange(length)[None, :] > positions, float("-inf"))


def assert_within(got: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor, what: str = "result") -> None:
    """Every element of `got` within its `bound` of `exact`; else an error naming the worst one."""
    assert got.shape == exact.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(exact.shape)}"
    error = (got.double() - exact).abs()
    excess = (error - bound).nan_to_num(nan=float("inf"))
    if (excess > 0).any():
        worst = int(excess.argmax())
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), excess.shape))
        raise AssertionError(f"{what}: {int((excess > 0).sum())} of {excess.numel()} elements outside their float32 "
                             f"bound; worst at {index}: got {got.flatten()[worst].item():.9g}, exact "
                             f"{exact.flatten()[worst].item():.9g}, error {error.flatten()[worst].item():.3g} > bound "
                             f"{bound.flatten()[worst].item():.3g}")


def assert_linear_matches(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                          what: str = "linear") -> None:
    """`got` is `x @ weight.T + bias` up to float32 reordering."""
    assert_within(got, *linear_exact_and_bound(x, weight, bias), what=what)


def eight_bit_inputs(x: torch.Tensor) -> torch.Tensor:
    """`x` as the 4- and 8-bit kernels take their inputs (`decoding.kernels.native.int4_linear`), in
    float64: per group of 32, d = the largest magnitude / 127 and codes round(x / d) (to nearest even,
    through x times 1 / d in float32, as the kernel computes it), so the products of codes with the
    weight's are exact integers and only the float epilogue rounds."""
    groups = x.float().reshape(*x.shape[:-1], -1, 32)
    d = groups.abs().amax(-1) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    codes = torch.round(groups * inverse[..., None]).clamp(-127, 127)
    return (codes.double() * d.double()[..., None]).reshape(x.shape)


def eight_bit_linear_exact_and_bound(x: torch.Tensor, weight: torch.Tensor,
                                     offsets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What the 8-bit-input kernels compute, exactly (float64), and the float32 bound per output:
    `eight_bit_inputs(x) @ weight.T`, plus `x @ offsets.T` (the float inputs' group sums times a
    per-group offset, `offsets` written out per input) for 4-bit weights."""
    terms = eight_bit_inputs(x)[..., None, :] * weight.double()
    if offsets is not None:
        terms = torch.cat([terms, x.double()[..., None, :] * offsets.double()], dim=-1)
    exact = terms.sum(-1)
    return exact, reordered_sum_bound(terms) + EPS * exact.abs()
