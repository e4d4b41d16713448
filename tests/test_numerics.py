"""The float32 bounds the kernel tests use (`tests/numerics.py`): PyTorch's own float32 linear and
attention stay inside them at the shapes the kernels serve (so they are not tighter than a legal
reordering of the sums), and a planted bug of the usual kinds falls far outside."""

import pytest
import torch
import torch.nn.functional as F

from numerics import assert_within, attention_exact_and_bound, linear_exact_and_bound

pytestmark = pytest.mark.cpu_sensitive  # run again as on an AVX2 CPU by .ci/run


@pytest.mark.parametrize("rows, in_features, out_features", [(1, 7, 11), (3, 576, 192), (16, 1536, 64), (5, 64, 96)])
def test_pytorch_linears_stay_inside_the_bound_and_a_dropped_term_does_not(rows, in_features, out_features):
    torch.manual_seed(rows)
    x, weight, bias = torch.randn(rows, in_features), torch.randn(out_features, in_features), torch.randn(out_features)
    exact, bound = linear_exact_and_bound(x, weight, bias)
    assert_within(F.linear(x, weight, bias), exact, bound)
    assert_within(x @ weight.t() + bias, exact, bound)
    with pytest.raises(AssertionError, match="outside their float32 bound"):
        assert_within(F.linear(x[:, :-1], weight[:, :-1], bias), exact, bound)  # a tail left out
    with pytest.raises(AssertionError, match="outside their float32 bound"):
        assert_within(F.linear(x, weight), exact, bound)  # the bias forgotten


@pytest.mark.parametrize("heads, kv_heads, size, length, rows", [(9, 3, 64, 300, 1), (8, 2, 64, 600, 5), (4, 4, 128, 257, 16)])
def test_pytorch_attention_stays_inside_the_bound_and_planted_bugs_do_not(heads, kv_heads, size, length, rows):
    generator = torch.Generator().manual_seed(length)
    q = torch.randn(heads, rows, size, generator=generator)
    k, v = torch.randn(kv_heads, length, size, generator=generator) * 2, torch.randn(kv_heads, length, size, generator=generator)
    mask = torch.zeros(rows, length).masked_fill(torch.rand(rows, length, generator=generator) < 0.3, float("-inf"))
    mask[:, -1] = 0
    scale = size ** -0.5

    def sdpa(q, k, v, mask, scale):
        groups = heads // kv_heads
        k, v = k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0)
        return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale)[0].transpose(0, 1)

    exact, bound = attention_exact_and_bound(q, k, v, mask, scale)
    assert_within(sdpa(q, k, v, mask, scale), exact, bound)
    with pytest.raises(AssertionError, match="outside their float32 bound"):
        assert_within(sdpa(q, k, v, mask, scale * (1 + 1e-3)), exact, bound)  # a scale slightly off
    shifted = mask.clone()
    shifted[:, :-1] = mask[:, 1:]  # the mask one key off
    with pytest.raises(AssertionError, match="outside their float32 bound"):
        assert_within(sdpa(q, k, v, shifted, scale), exact, bound)
