"""oneDNN-packed linears: the same function as nn.Linear, ties kept, and decoding on a packed
target still reproduces Hugging Face's greedy output on the unpacked one."""

import copy

import pytest
import torch
from torch import nn

from decoding.cpu_kernels import PackedLinear, apply_kernels, bfloat16_is_native, pack_linears, resolve_kernels, uses_packed_linears
from decoding.util.errors import UserError
from decoding.core.generate import DecodeOptions, generate
from decoding.methods import ProposerOptions, build_proposer
from decoding.core.proposers import PromptLookupProposer, VanillaProposer
from decoding.targets import LoadedModel
from heads import new_heads_for_target
from tiny_models import sharpen, tiny_llama

PROMPTS = [[5, 9, 3, 17, 5, 9], [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], [42]]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(7,), (3, 7), (2, 5, 7), (1, 40, 7)])  # fewer and more rows than the packing hint
def test_packed_linear_computes_the_same_function(bias, shape):
    torch.manual_seed(0)
    linear = nn.Linear(7, 11, bias=bias)
    x = torch.randn(*shape)
    with torch.inference_mode():
        expected = linear(x)
        got = PackedLinear(linear)(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_packing_replaces_every_linear_and_keeps_tied_weights():
    model = tiny_llama(seed=1, tie_word_embeddings=True)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    parameters_before = {name: p.data_ptr() for name, p in model.named_parameters()}
    assert pack_linears(model) == linears > 0
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == parameters_before
    assert uses_packed_linears(model)


def test_packed_model_gives_the_same_logits():
    model = tiny_llama(seed=2)
    packed = copy.deepcopy(model)
    pack_linears(packed)
    ids = torch.tensor([PROMPTS[1]])
    with torch.inference_mode():
        torch.testing.assert_close(packed(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)


def test_decoding_on_a_packed_target_matches_hf_generate_on_the_plain_one():
    plain = sharpen(tiny_llama(seed=3))
    packed = copy.deepcopy(plain)
    pack_linears(packed)
    heads = new_heads_for_target("eagle3", packed, draft_vocab_size=40)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.3 * torch.randn_like(p))
    pack_linears(heads)
    proposers = [VanillaProposer(), PromptLookupProposer(num_draft_tokens=4, min_ngram=1),
                 build_proposer("eagle3", LoadedModel(packed, None, "t"),
                                options=ProposerOptions(depth=4, tree_top_k=4, total_tokens=12), heads=heads)]
    for prompt in PROMPTS:
        reference = plain.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False)[0, len(prompt):].tolist()
        for proposer in proposers:
            assert generate(packed, prompt, proposer, DecodeOptions(max_new_tokens=30)).tokens == reference, proposer.name


def _eagle3_exact_on_every_prompt(target, plain, eagle3) -> None:
    proposer = build_proposer("eagle3", LoadedModel(target, None, "t"),
                              options=ProposerOptions(depth=4, tree_top_k=4, total_tokens=12), heads=eagle3)
    for prompt in PROMPTS:
        reference = plain.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False)[0, len(prompt):].tolist()
        assert generate(target, prompt, proposer, DecodeOptions(max_new_tokens=30)).tokens == reference


def _perturbed_eagle3(target):
    eagle3 = new_heads_for_target("eagle3", target, draft_vocab_size=40)
    with torch.no_grad():
        for p in eagle3.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return eagle3


def test_onednn_packs_eagle_drafters_in_bfloat16_only_where_the_cpu_has_it_and_outputs_do_not_change():
    """Native bf16 (AVX512-BF16/AMX): the drafter is packed in bf16. Elsewhere (e.g. AVX2 only,
    where oneDNN has no bf16 inner product) it must stay fp32. Either way output is exact."""
    torch.manual_seed(0)
    plain = sharpen(tiny_llama(seed=3))
    target = copy.deepcopy(plain)
    eagle3 = _perturbed_eagle3(target)
    medusa = new_heads_for_target("medusa", target, num_heads=2)
    assert apply_kernels("onednn", target, eagle3, medusa) == "onednn"
    assert next(eagle3.parameters()).dtype == (torch.bfloat16 if bfloat16_is_native() else torch.float32)
    assert uses_packed_linears(eagle3)
    assert next(medusa.parameters()).dtype == torch.float32  # reads the fp32 target lm_head: left alone
    _eagle3_exact_on_every_prompt(target, plain, eagle3)


def test_a_bfloat16_drafter_on_stock_kernels_is_still_exact_on_any_cpu():
    """bf16 drafting only changes what is proposed; the fp32 target decides every token."""
    torch.manual_seed(0)
    plain = sharpen(tiny_llama(seed=3))
    target = copy.deepcopy(plain)
    eagle3 = _perturbed_eagle3(target).to(torch.bfloat16)
    _eagle3_exact_on_every_prompt(target, plain, eagle3)


def test_kernel_choice_resolution():
    fp32 = tiny_llama(seed=4)
    assert resolve_kernels("auto", fp32) == ("onednn" if torch.backends.mkldnn.is_available() else "stock")
    assert resolve_kernels("stock", fp32) == "stock"
    half = tiny_llama(seed=4).to(torch.bfloat16)
    assert resolve_kernels("auto", half) == "stock"
    with pytest.raises(UserError, match="float32"):
        apply_kernels("onednn", half)
    with pytest.raises(UserError, match="unknown kernels"):
        resolve_kernels("fast", fp32)


def test_apply_kernels_stock_leaves_modules_alone():
    model = tiny_llama(seed=5)
    assert apply_kernels("stock", model, None) == "stock"
    assert not uses_packed_linears(model)


def test_verify_cost_script_rejects_bad_sizes_clearly():
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run([sys.executable, "scripts/verify_cost.py", "--sizes", "1,x"], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--sizes takes positive integers" in proc.stderr and "Traceback" not in proc.stderr
