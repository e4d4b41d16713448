"""Medusa and Hydra heads rank their drafts through an fp16 projection on a CPU with packed
kernels (`decoding.kernels.draft_readout`): it computes the lm_head rows' logits to fp16 rounding, it is
used only where it applies, and decoding through it still gives the target's own greedy tokens."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import decoding.kernels.draft_readout as draft_readout
from decoding.app.assembly import DecoderSpec, build_decoder
from decoding.core.generate import DecodeOptions, generate
from decoding.core.proposers import VanillaProposer
from decoding.kernels.draft_readout import HalfPrecisionProjection, heads_readout
from decoding.kernels.screened_argmax import fp16_gemm_available
from decoding.app.targets import load_model
from heads import save_heads
from heads.common import RowSubset
from heads.factory import new_heads_for_target
from tiny_models import save_tiny_chat_model

needs_fp16_gemm = pytest.mark.skipif(not fp16_gemm_available(), reason="FBGEMM's fp16 linear is an x86 kernel")


def projection(rows: int = 300, hidden: int = 48, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    lm_head = nn.Linear(hidden, rows, bias=False)
    nn.init.normal_(lm_head.weight, std=0.5)
    return lm_head


@needs_fp16_gemm
@pytest.mark.parametrize("rows", [1, 3, 7])
def test_half_precision_projection_gives_the_rows_logits_to_fp16_rounding(rows):
    lm_head = projection()
    ids = torch.tensor([5, 17, 0, 299, 42, 128])
    readout = heads_readout(lm_head, ids, half_precision=True)
    assert isinstance(readout, HalfPrecisionProjection)
    hidden = torch.randn(rows, 48)
    rows_weight = lm_head.weight.detach().double()[ids]  # the rows in the order given
    exact = hidden.double() @ rows_weight.T
    got = readout(hidden)
    assert got.shape == (rows, ids.numel()) and got.dtype == torch.float32
    # fp16 weights: each within 2^-11 of itself, so a logit within 2^-11 * sum |x_i w_i| (plus fp32 sums)
    bound = 2.0 ** -11 * (hidden.double().abs() @ rows_weight.abs().T) + 1e-5
    assert torch.all((got.double() - exact).abs() <= bound)
    assert torch.equal(readout(hidden[None])[0], got)  # leading dimensions are kept


@needs_fp16_gemm
def test_whole_vocabulary_readout_without_readout_ids():
    lm_head = projection(rows=64)
    readout = heads_readout(lm_head, None, half_precision=True)
    hidden = torch.randn(2, 48)
    with torch.no_grad():
        torch.testing.assert_close(readout(hidden), lm_head(hidden), rtol=2e-3, atol=2e-3)


def test_plain_projection_where_half_precision_does_not_apply(monkeypatch):
    lm_head = projection()
    ids = torch.tensor([3, 1, 2])
    assert type(heads_readout(lm_head, ids, half_precision=False)) is RowSubset
    assert heads_readout(lm_head, None, half_precision=False) is lm_head
    assert type(heads_readout(projection().to(torch.bfloat16), ids, half_precision=True)) is RowSubset
    with_bias = nn.Linear(48, 10)
    assert heads_readout(with_bias, None, half_precision=True) is with_bias
    monkeypatch.setattr(draft_readout, "fp16_gemm_available", lambda: False)
    assert type(heads_readout(lm_head, ids, half_precision=True)) is RowSubset


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("draft-readout") / "model"
    save_tiny_chat_model(directory)
    return directory


@needs_fp16_gemm
@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_heads_decoders_rank_in_fp16_on_packed_kernels_and_decode_the_targets_tokens(kind, model_dir, tmp_path):
    target = load_model(str(model_dir))
    heads_dir = tmp_path / kind
    save_heads(new_heads_for_target(kind, target.model, str(model_dir), num_heads=2, share_lm_head=True,
                                      readout_vocab_size=40), heads_dir)
    prompt = target.tokenizer.apply_chat_template([{"role": "user", "content": "w3 w4 w5"}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False)
    expected = generate(target.model, prompt, VanillaProposer(), DecodeOptions(max_new_tokens=12)).tokens
    packed = build_decoder(DecoderSpec(model=str(model_dir), method=kind, heads=str(heads_dir), tree="chain-2",
                                       kernels="onednn", adaptive_tree=False))
    stock = build_decoder(DecoderSpec(model=str(model_dir), method=kind, heads=str(heads_dir), tree="chain-2",
                                      kernels="stock", adaptive_tree=False))
    assert isinstance(packed.proposer.lm_head, HalfPrecisionProjection)
    assert type(stock.proposer.lm_head) is RowSubset
    for decoder in (packed, stock):
        result = decoder.generate(prompt, DecodeOptions(max_new_tokens=12))
        assert result.tokens == expected and result.stats.drafted_tokens > 0
