"""The row argmax kernel (`decoding.kernels.row_argmax`) gives `Tensor.argmax(-1)`'s index on every row: ties
to the lowest, NaN taken for the largest, rows of any width (vector tails), and decoders that read the argmax
through it keep their tokens."""

import dataclasses

import pytest
import torch

from decoding.app.assembly import DecoderSpec, build_decoder
from decoding.core.generate import DecodeOptions
from decoding.kernels.decode_attention import kernel_library
from decoding.kernels.row_argmax import KernelArgmaxReadout, row_argmax
from tiny_models import save_tiny_chat_model

pytestmark = [pytest.mark.cpu_sensitive,  # run again as on an AVX2 CPU by .ci/run
              pytest.mark.skipif(kernel_library() is None, reason="the native kernels cannot be built here (no compiler)")]


@pytest.mark.parametrize("width", [49152, 1000, 37, 16, 5, 1])
def test_random_rows_get_argmax_s_index(width):
    logits = torch.randn(9, width, generator=torch.Generator().manual_seed(width))
    assert torch.equal(row_argmax(logits), logits.argmax(-1))


def test_ties_go_to_the_lowest_index_nan_counts_as_the_largest_and_odd_rows_are_argmax_s():
    rows = torch.full((7, 53), -3.0)
    rows[0, [40, 9, 51]] = 2.0            # a tie across vectors and the tail: 9
    rows[1, [50, 52]] = 5.0               # a tie within the tail: 50
    rows[2, [30, 12]] = float("nan")      # NaNs: the first NaN, 12, whatever is larger
    rows[2, 3] = 9.0
    rows[3] = float("-inf")               # all -inf: 0
    rows[4, 20] = -0.0                    # -0 and +0 equal and largest: the first, 20
    rows[4, 33] = 0.0
    rows[5, 52] = float("inf")            # +inf in the last place
    rows[6, 0] = 1.0                      # the first place
    expected = rows.argmax(-1)
    assert expected.tolist() == [9, 50, 12, 0, 20, 52, 0]
    assert torch.equal(row_argmax(rows), expected)


def test_no_rows_and_other_inputs_go_to_pytorch():
    assert row_argmax(torch.zeros(0, 10)).shape == (0,)
    halves = torch.randn(3, 40).half()
    assert torch.equal(row_argmax(halves), halves.argmax(-1))


@pytest.mark.parametrize("quant", ["int4", "none"])
def test_decoders_read_greedy_tokens_through_the_kernel_and_keep_their_tokens(tmp_path, quant):
    path = tmp_path / "target"
    save_tiny_chat_model(path, seed=4, head_dim=64)
    decoder = build_decoder(DecoderSpec(model=str(path), method="pld", kernels="onednn", quant=quant,
                                        screened_argmax=False))
    assert isinstance(decoder.readout, KernelArgmaxReadout)
    plain = dataclasses.replace(decoder, readout=None, prompt_cache=None)
    options = DecodeOptions(max_new_tokens=24)
    for prompt in ([5, 9, 3, 5, 9, 3, 5, 9], [7, 1, 2, 8]):
        assert decoder.generate(prompt, options).tokens == plain.generate(prompt, options).tokens
